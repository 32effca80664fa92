"""A TRL user's run: datasets with columns (jsonl, parquet, save_to_disk), chat templates, TRL-signature reward
functions with weights and columns, RLOO/GRPO in the cycle, held-out evaluation, the final/ folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.rewards import load_rewards, score_rewards
from refit.learner.run.chat import encode_prompts, end_of_turn_ids, render
from refit.learner.run.dataset import load_prompt_dataset

REWARDS_PY = '''
def correct(prompts, completions, answer, **kwargs):
    """1 when the completion's text is the answer column; None where the row has no answer."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(None if a is None else float(text.strip() == a))
    return out


def chars(completions, completion_ids, **kwargs):
    """Characters per token of the completion, / 4."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / (4 * len(ids)) if ids else 0.0 for t, ids in zip(texts, completion_ids)]
'''


def _chat_rows(n: int, with_none: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "answer": None if with_none and i % 4 == 3 else str(a + b), "level": i % 3})
    return rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_tok(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    p.write_text(REWARDS_PY)
    return p


# ------------------------------------------------------------------ data


def test_jsonl_parquet_and_save_to_disk_load_with_splits_and_columns(tmp_path):
    import datasets

    rows = _chat_rows(10)
    train, held = load_prompt_dataset(str(_write_jsonl(tmp_path / "d.jsonl", rows)), "train[:80%]",
                                      eval_split="train[80%:]")
    assert len(train) == 8 and len(held) == 2
    assert train.prompts[0] == rows[0]["prompt"] and held.take([1]) == {"answer": ["4"], "level": [0]}  # row 9: 2+2
    assert load_prompt_dataset(str(tmp_path / "d.jsonl"), eval_fraction=0.3, seed=1)[1].__len__() == 3

    plain = datasets.Dataset.from_dict({"question": ["1+2=", "3+4=", "5+0="], "answer": ["3", "7", "5"]})
    plain.to_parquet(str(tmp_path / "d.parquet"))
    train, held = load_prompt_dataset(str(tmp_path / "d.parquet"), prompt_column="question")
    assert train.prompts == ["1+2=", "3+4=", "5+0="] and train.columns == {"answer": ["3", "7", "5"]} and held is None

    datasets.DatasetDict({"train": plain, "test": plain.select([2])}).save_to_disk(str(tmp_path / "disk"))
    train, held = load_prompt_dataset(str(tmp_path / "disk"), prompt_column="question", eval_split="test")
    assert len(train) == 3 and held.prompts == ["5+0="] and held.columns["answer"] == ["5"]


def test_dataset_errors_are_one_line(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _chat_rows(3))
    with pytest.raises(RefitError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(RefitError, match=r"has no column 'question' \(columns: prompt, answer, level\)"):
        load_prompt_dataset(str(tmp_path / "d.jsonl"), prompt_column="question")
    (tmp_path / "e.csv").write_text("prompt,answer\n")
    with pytest.raises(RefitError, match="is empty"):
        load_prompt_dataset(str(tmp_path / "e.csv"))
    with pytest.raises(RefitError, match="split 'test' is not one of"):
        load_prompt_dataset(str(tmp_path / "d.jsonl"), eval_split="test")


# ------------------------------------------------------------------ chat templates


def test_chat_prompts_are_templated_and_too_long_rows_named(chat_tok, tokenizer):
    msgs = [{"role": "user", "content": "2+3="}]
    assert render(chat_tok, msgs) == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_prompts(chat_tok, [msgs, "2+3="], 256, 8)
    start = chat_tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0][0] == start and ids[0].count(start) == 2 and ids[1] == chat_tok("2+3=").input_ids
    assert end_of_turn_ids(chat_tok) == (chat_tok.convert_tokens_to_ids("<|im_end|>"),)
    assert end_of_turn_ids(tokenizer) == ()  # no template: EOS alone
    with pytest.raises(RefitError, match=r"dataset row 1: the prompt is \d+ tokens after the chat template; with "
                                         r"response_length 8 that exceeds the model's 30 positions"):
        encode_prompts(chat_tok, [[{"role": "user", "content": "1"}], [{"role": "user", "content": "1+1=" * 5}]],
                       30, 8)
    with pytest.raises(RefitError, match="has no chat_template"):
        encode_prompts(tokenizer, [msgs], 256, 8)
    with pytest.raises(RefitError, match="dataset row 0: the prompt must be text or a list of"):
        encode_prompts(chat_tok, [[{"content": "no role"}]], 256, 8)


# ------------------------------------------------------------------ rewards


def test_two_reward_functions_with_weights_a_column_and_none(rewards_file):
    rewards = load_rewards([f"{rewards_file}:correct", f"{rewards_file}:chars"], [2.0, 0.5])
    prompts = [[{"role": "user", "content": "1+1="}]] * 3
    completions = [[{"role": "assistant", "content": t}] for t in ("2", "3", "2")]
    extra = {"answer": ["2", "2", None], "level": [0, 1, 2], "completion_ids": [[5, 5], [6, 7, 1], [5, 1]]}
    total, stats = score_rewards(rewards, prompts, completions, extra)
    # correct (weight 2): 1, 0, None (left out of the sum and the mean); chars (weight 0.5): 1/8, 1/12, 1/8
    torch.testing.assert_close(total, torch.tensor([2.0 + 0.5 / 8, 0.0 + 0.5 / 12, 0.5 / 8]))
    assert stats["reward/correct/mean"] == pytest.approx(0.5)
    assert stats["reward/chars/mean"] == pytest.approx((1 / 8 + 1 / 12 + 1 / 8) / 3)


def test_module_function_and_legacy_signature(rewards_file):
    legacy = load_rewards(["refit.learner.builtin.tasks:exact_match_reward"], [])
    total, stats = score_rewards(legacy, ["1+2=", "2+2="], ["3", "5"], {"completion_ids": [[1], [1]]})
    assert total.tolist() == [1.0, 0.0] and stats == {"reward/exact_match_reward/mean": 0.5}
    with pytest.raises(RefitError, match="reward_weights has 1 values for 2 reward functions"):
        load_rewards([f"{rewards_file}:correct", f"{rewards_file}:chars"], [1.0])
    with pytest.raises(RefitError, match="has no function 'nope'"):
        load_rewards([f"{rewards_file}:nope"], [])


def test_the_old_module_names_are_gone_and_a_reward_spec_naming_one_says_so():
    """The deprecation shims are deleted (never in a release; docs/changelog.md): ``refit.learner.examples``,
    ``refit.learner.cli`` and ``refit.learner.trl_compat`` no longer import, and a reward spec that still names the
    old ``examples`` path fails in one line that names the spec, not with a traceback."""
    import importlib

    for old in ("refit.learner.examples", "refit.learner.cli", "refit.learner.trl_compat"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(RefitError, match=r"cannot import reward 'refit.learner.examples.tasks:length_reward'"):
        load_rewards(["refit.learner.examples.tasks:length_reward"], [])
    assert load_rewards(["refit.learner.builtin.tasks:length_reward"], [])[0].fn.__name__ == "length_reward"


@pytest.mark.parametrize("body, msg", [
    ("return [1.0]", r"reward function 'bad' returned 1 values for 2 completions"),
    ("return [1.0, float('nan')]", r"reward function 'bad' returned nan for row 1"),
    ("raise KeyError('answer')", r"reward function 'bad' raised KeyError: 'answer'"),
    ("return [1.0, 'x']", r"reward function 'bad' returned str 'x' for row 1"),
])
def test_misbehaving_reward_is_one_line_naming_it(tmp_path, body, msg):
    f = tmp_path / "r.py"
    f.write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    with pytest.raises(RefitError, match=msg):
        score_rewards(load_rewards([f"{f}:bad"], []), ["a", "b"], ["x", "y"], {"completion_ids": [[1], [1]]})


# ------------------------------------------------------------------ the cycle


def _chat_cfg(chat_model_dir, chat_engine_dir, data, out, **kw):
    base = dict(model_dir=str(chat_model_dir), engine_dir=str(chat_engine_dir), output_dir=str(out), dataset=str(data),
                steps=2, batch_size=4, num_generations=2, advantage_estimator="gae", num_mini_batches=2, num_ppo_epochs=1, response_length=4,
                save_steps=2, probe_size=4, progress=False, tensorboard=False, plots=False, learning_rate=1e-3,
                export_final=False)
    base.update(kw)
    return PPOConfig.from_flat(**base)


def test_kl_zero_at_step_zero_with_chat_template_and_top_p(chat_model_dir, chat_engine_dir, tmp_path, chat_tok):
    from refit.learner.ppo.cycle import setup
    from refit.learner.ppo.route import experience
    from refit.rollout.types import SamplingParams

    data = _write_jsonl(tmp_path / "d.jsonl", _chat_rows(8))
    run = setup(_chat_cfg(chat_model_dir, chat_engine_dir, data, tmp_path / "run", top_p=0.8), False, lambda *_: None)
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    assert run.stop_ids == (im_end,) and run.sync.probe.stop_set() == {im_end, chat_tok.eos_token_id}
    assert run.prompt_ids[0] == encode_prompts(chat_tok, [run.prompts[0]], None, 4)[0]
    rollout = run.engine.generate(run.prompt_ids, SamplingParams(max_new_tokens=6, top_p=0.8, seed=3, n=2,
                                                                 stop_ids=run.stop_ids))
    assert (rollout.rollout_logprobs - rollout.rollout_plain_logprobs)[rollout.response_mask.bool()].max() > 0
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(stats[f"kl/{k}"]) <= 1e-6, (k, stats[f"kl/{k}"])
    run.engine.close()


def test_grpo_experience_advantages_are_the_group_formula(chat_model_dir, chat_engine_dir, tmp_path):
    """At step 0 policy == reference, so the KL penalty is 0 and the advantage of every token of a row is
    GRPO's (score - group mean) / (group std + 1e-4); no value head is used."""
    from refit.learner.losses import grpo_advantages
    from refit.learner.ppo.cycle import setup
    from refit.learner.ppo.route import experience
    from refit.rollout.types import SamplingParams

    data = _write_jsonl(tmp_path / "d.jsonl", _chat_rows(8))
    cfg = _chat_cfg(chat_model_dir, chat_engine_dir, data, tmp_path / "run", advantage_estimator="grpo",
                    num_generations=4, batch_size=2)
    run = setup(cfg, False, lambda *_: None)
    assert not any(p.requires_grad for p in run.value_head.parameters())
    rollout = run.engine.generate(run.prompt_ids[:2], SamplingParams(max_new_tokens=4, seed=1, n=4))
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    exp, stats = experience(run, rollout, scores)
    m = rollout.response_mask
    s = torch.tensor([1.0, 0.0, 0.0, 3.0]).std()  # group 2 is constant: advantage 0
    want = torch.tensor([1 - 1, 0 - 1, 0 - 1, 3 - 1, 0, 0, 0, 0]) / torch.tensor([s + 1e-4] * 4 + [1.0] * 4)
    torch.testing.assert_close(exp.advantages, want[:, None] * m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want, grpo_advantages(scores, 4)[0], atol=1e-5, rtol=1e-5)
    assert stats["advantage/zero_std_frac"] == 0.5 and "value/explained_variance" not in stats
    run.engine.close()


def test_chat_run_rloo_two_rewards_eval_and_final_folder(chat_model_dir, chat_engine_dir, tmp_path, rewards_file):
    """jsonl chat dataset, two TRL reward functions (weights, a column, None rows), RLOO, held-out evaluation at
    steps 0, 1, 2; final/ reloads with from_pretrained and gives the learner policy's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refit.learner.ppo.cycle import ppo_job
    from refit.learner.run.loop import run_job
    from refit.learner.run.metrics import read_metrics

    data = _write_jsonl(tmp_path / "d.jsonl", _chat_rows(12, with_none=True))
    cfg = _chat_cfg(chat_model_dir, chat_engine_dir, data, tmp_path / "run", advantage_estimator="rloo",
                    reward_funcs=(f"{rewards_file}:correct", f"{rewards_file}:chars"), reward_weights=(1.0, 0.5),
                    eval_fraction=0.25, eval_steps=1, export_final=True, top_p=0.9)
    run_dir, run = run_job(ppo_job(lambda *_: None), cfg, log=lambda *_: None)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["eval/reward/mean"] is not None and "eval/reward/chars/mean" in r for r in rows)
    assert all(r["reward/chars/mean"] > 0 and "advantage/baseline_mean" in r for r in rows[1:])
    assert "ppo/vf_loss" not in rows[1] and abs(rows[1]["kl/exact"]) < 1e-6

    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
    ids = torch.tensor([run.prompt_ids[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, run.policy(ids).logits, atol=1e-6, rtol=1e-6)
        assert (model(ids).logits - AutoModelForCausalLM.from_pretrained(chat_model_dir)(ids).logits).abs().max() > 0
    assert (run_dir / "final_engine" / "manifest.json").exists()
    assert not (run_dir / "final_value_head.safetensors").exists()  # RLOO trains no critic


def test_gae_parquet_run_then_export_final_on_resume(model_dirs, engine_dirs, tmp_path):
    """A plain-text parquet dataset through GAE; ``--resume --export-final`` on the finished run writes final/,
    final_engine/ and the value head beside them, equal to the last checkpoint's."""
    import datasets
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.checkpoint import load_checkpoint
    from refit.learner.run.policy import ValueHead

    datasets.Dataset.from_dict({"text": [f"{i}+{i}=" for i in range(10)]}).to_parquet(str(tmp_path / "d.parquet"))
    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                    output_dir=str(tmp_path / "run"), dataset=str(tmp_path / "d.parquet"), dataset_text_field="text",
                    steps=1, batch_size=4, num_generations=1, num_mini_batches=1, num_ppo_epochs=1,
                    response_length=4, save_steps=1, probe_size=2, progress=False, tensorboard=False, plots=False,
                    export_final=False)
    run_dir = run_ppo(cfg, log=lambda *_: None)
    assert not (run_dir / "final").exists()
    from dataclasses import replace

    run_ppo(replace(cfg, export_final=True), resume=True, log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    ref, vh = AutoModelForCausalLM.from_pretrained(model_dirs["tiny-gpt2"]), ValueHead(64)
    load_checkpoint(run_dir / "checkpoints" / "step_000001", ref, vh, None, None)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n
    saved = load_file(str(run_dir / "final_value_head.safetensors"))
    assert torch.equal(saved["summary.weight"], vh.summary.weight.detach())
    assert (run_dir / "final_engine" / "manifest.json").exists()


def test_distill_from_a_chat_dataset_writes_final(chat_model_dir, chat_engine_dir, tmp_path, chat_tok):
    """`refit distill` with a save_to_disk chat dataset (prompt messages, completion messages, a test split):
    completions end with the template's end-of-turn token, and final/ reloads with the student's logits."""
    import datasets
    from transformers import AutoModelForCausalLM

    from refit.learner.distill.config import DistillConfig
    from refit.learner.distill.cycle import DISTILL_JOB
    from refit.learner.run.loop import run_job

    rows = _chat_rows(12)
    for r in rows:
        r["completion"] = [{"role": "assistant", "content": r.pop("answer")}]
    ds = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": ds.select(range(9)), "test": ds.select(range(9, 12))}).save_to_disk(
        str(tmp_path / "disk"))
    cfg = DistillConfig.from_flat(teacher_model_dir=str(chat_model_dir), student_model_dir=str(chat_model_dir),
                        teacher_engine_dir=str(chat_engine_dir), student_engine_dir=str(chat_engine_dir),
                        output_dir=str(tmp_path / "run"), dataset=str(tmp_path / "disk"), eval_split="test",
                        steps=2, batch_size=4, eval_size=3, max_new_tokens=4, teacher_topk=4, probe_size=2,
                        eval_every=100, save_steps=2, warmup_steps=0, learning_rate=1e-2, lmbda=0.5,
                        progress=False, tensorboard=False, plots=False)
    run_dir, run = run_job(DISTILL_JOB, cfg, log=lambda *_: None)
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    assert run.stop_ids == (im_end,) and all(c[-1] == im_end for c in run.completion_ids)
    assert len(run.prompt_ids) == 9 and len(run.eval.pairs) == 3 and run.eval.pairs[0][1] == rows[9]["completion"][0]["content"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    ids = torch.tensor([run.prompt_ids[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, run.student(ids).logits, atol=1e-6, rtol=1e-6)
    assert (run_dir / "final_engine" / "manifest.json").exists()
