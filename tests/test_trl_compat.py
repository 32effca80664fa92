"""A TRL user's script on Refit: TRL's GRPO/RLOO names with TRL's meanings (refit.learner.trl_compat), the TRL-name
hints of `refit ppo`'s YAML and flags, TRL's extra reward keywords, and examples/trl_chat/grpo.py for 2 steps."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.config import PPOConfig
from refit.learner.trl_compat import GRPOConfig, RLOOConfig, to_ppo_config

ROOT = Path(__file__).resolve().parents[1]


def _ppo(specs=(), **kw):
    return to_ppo_config(GRPOConfig(output_dir="out", **kw), "model", reward_specs=specs)


# ------------------------------------------------------------------ the name mapping


def test_batch_counts_completions_and_max_steps_counts_optimizer_steps():
    c = _ppo(per_device_train_batch_size=16, num_generations=8, max_steps=5)
    assert (c.run.batch_size, c.num_generations, c.num_mini_batches, c.num_ppo_epochs, c.run.steps) == (2, 8, 1, 1, 5)
    # 16 completions a micro-batch, 2 micro-batches an optimizer step, 4 micro-batches a generation (64 completions
    # = 8 prompts of 8), 3 passes over each generation: 2 optimizer steps a pass, 6 a generation
    c = _ppo(per_device_train_batch_size=16, gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=3,
             num_generations=8, max_steps=12)
    assert (c.run.batch_size, c.num_mini_batches, c.optim.gradient_accumulation_steps, c.num_ppo_epochs) == (8, 2, 2, 3)
    assert c.run.steps == 2  # 12 optimizer steps / 6 per generation
    by_size = _ppo(per_device_train_batch_size=16, generation_batch_size=64, num_generations=8, max_steps=4)
    assert by_size.run.batch_size == 8
    with pytest.raises(RefitError, match=r"max_steps=10 optimizer steps is not a multiple of the 6 .* use 6 or 12"):
        _ppo(per_device_train_batch_size=16, gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=3,
             num_generations=8, max_steps=10)
    with pytest.raises(RefitError, match="must be a multiple of num_generations=8"):
        _ppo(per_device_train_batch_size=12, num_generations=8, max_steps=1)
    # no max_steps: num_train_epochs passes over the prompts (40 prompts, 2 a generation, 1.5 epochs: 30 rollouts)
    assert to_ppo_config(GRPOConfig(per_device_train_batch_size=16, num_train_epochs=1.5), "m", 40).run.steps == 30


def test_beta_is_the_k3_loss_term_for_grpo_and_the_k1_reward_penalty_for_rloo():
    g = _ppo(beta=0.04, max_steps=1)
    assert (g.kl_coef, g.kl_penalty, g.kl_estimator, g.advantage_estimator) == (0.04, "loss", "k3", "grpo")
    r = to_ppo_config(RLOOConfig(output_dir="o", per_device_train_batch_size=4, max_steps=1), "m")
    assert (r.kl_coef, r.kl_penalty, r.kl_estimator, r.advantage_estimator, r.num_generations) == (0.05, "reward", "k1",
                                                                                                   "rloo", 2)
    assert r.run.batch_size == 2 and r.response_length == 512


@pytest.mark.parametrize("given, want", [(True, "group"), (False, "none"), ("group", "group"), ("batch", "batch"),
                                         ("none", "none")])
def test_scale_rewards_bool_and_strings(given, want):
    assert _ppo(scale_rewards=given, max_steps=1).scale_rewards == want


def test_other_trl_names_and_defaults():
    c = _ppo(("m:a", "m:b"), max_steps=8, per_device_train_batch_size=8, steps_per_generation=2, epsilon=0.3,
             learning_rate=3e-5,
             temperature=0.7, top_p=0.9, top_k=None, max_completion_length=12, seed=5, save_steps=3, warmup_ratio=0.25,
             save_total_limit=3, report_to=["tensorboard"], reward_weights=[1, 0.5], loss_type="bnpo",
             use_vllm=False, gradient_checkpointing=True, refit={"rollout.backend": "torch", "top_k": 0})
    assert (c.cliprange, c.optim.learning_rate, c.sampling.temperature, c.sampling.top_p, c.sampling.top_k) == (
        0.3, 3e-5, 0.7, 0.9, 0)
    assert (c.response_length, c.run.seed, c.run.steps, c.ckpt.keep_checkpoints, c.log.tensorboard) == (
        12, 5, 4, 3, True)
    assert c.ckpt.save_steps == 2  # 3 optimizer steps -> the rollout boundary at or after it (2 per rollout)
    assert c.optim.warmup_steps == 2 and c.optim.lr_scheduler_type == "linear"  # TRL's (HF's) default schedule
    assert c.rollout.backend == "torch" and c.reward_weights == (1.0, 0.5)
    d = _ppo(max_steps=1)  # TRL's defaults: 1e-6, 256 tokens, 8 generations, seed 42, no TensorBoard
    assert (d.optim.learning_rate, d.response_length, d.num_generations, d.run.seed, d.log.tensorboard) == (
        1e-6, 256, 8, 42, False)


@pytest.mark.parametrize("kw, msg", [
    (dict(loss_type="grpo"), "loss_type='grpo': not supported; Refit normalises the loss by the response-token count"),
    (dict(loss_type="bnpo", gradient_accumulation_steps=2, steps_per_generation=2), "loss_type='bnpo'"),
    (dict(epsilon_high=0.28), "epsilon_high=0.28 != epsilon=0.2: not supported"),
    (dict(use_vllm=True), "use_vllm=True: generation runs on Refit's engine"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions=True: not supported"),
    (dict(max_prompt_length=128), "max_prompt_length=128: not supported: prompts are kept whole"),
    (dict(no_such_name=1), "'no_such_name' is not supported; the names GRPOConfig takes"),
    (dict(scale_rewards="mean"), "scale_rewards='mean': Refit takes True/'group', 'batch', False/'none'"),
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), "steps_per_generation=3 must be a multiple of "
                                                                  "gradient_accumulation_steps=2"),
    (dict(refit={"nope": 1}), r"GRPOConfig\(refit=...\): unknown field nope"),
])
def test_what_refit_cannot_honour_is_one_line(kw, msg):
    with pytest.raises(RefitError, match=msg.replace("(", r"\(").replace(")", r"\)") if "refit=" not in msg else msg):
        _ppo(max_steps=2, **kw)


def test_grpo_loss_with_beta_is_trls_dapo_loss(model_dirs):
    """The update's loss under the mapped settings, against TRL GRPO's per-token formula written out here:
    -min(r A, clip(r, 1-eps, 1+eps) A) + beta * (exp(ref - logp) - (ref - logp) - 1), summed over response
    tokens / their count (loss_type 'dapo')."""
    import copy

    from refit.core.checkpoint import load_model
    from refit.learner.ppo.cycle import update_settings
    from refit.learner.ppo.update import Experience, _micro_loss

    torch.manual_seed(0)
    ref = load_model(model_dirs["tiny-gpt2"]).eval().requires_grad_(False)
    policy = copy.deepcopy(ref)
    old = copy.deepcopy(ref)
    with torch.no_grad():
        for p, q in zip(policy.parameters(), old.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.add_(0.05 * torch.randn_like(q))
    cfg = _ppo(beta=0.3, epsilon=0.1, temperature=0.9, max_steps=1)
    s = update_settings(cfg, cfg.kl_coef, on_cuda=False)
    b, tp, tr = 4, 5, 6
    g = torch.Generator().manual_seed(1)
    v = ref.config.vocab_size
    prompt, resp = torch.randint(4, v, (b, tp), generator=g), torch.randint(4, v, (b, tr), generator=g)
    mask = torch.ones(b, tr)
    mask[1, 3:] = 0

    def lp(model):
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, resp], 1)).logits[:, tp - 1:tp - 1 + tr] / 0.9
        return torch.log_softmax(logits.float(), -1).gather(-1, resp[..., None])[..., 0]

    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None] * mask
    exp = Experience(prompt, torch.ones(b, tp, dtype=torch.long), resp, mask, lp(old), lp(ref), torch.zeros(b, tr),
                     adv, torch.zeros(b, tr), None)
    loss, _ = _micro_loss(policy, None, exp, torch.arange(b), mask.sum(), s, ref_model=ref)
    logp, ref_lp, old_lp = lp(policy), lp(ref), lp(old)
    ratio = (logp - old_lp).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.9, 1.1) * adv)
    per_token = per_token + 0.3 * ((ref_lp - logp).exp() - (ref_lp - logp) - 1)
    want = (per_token * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    assert (ratio[mask.bool()] - 1).abs().max() > 0.1  # the clip is exercised


# ------------------------------------------------------------------ YAML and flags


def test_trl_names_in_yaml_and_flags_are_answered_with_refit_names(tmp_path):
    from refit.learner.run.config import parse_job

    y = tmp_path / "c.yaml"
    y.write_text("per_device_train_batch_size: 16\nmax_completion_length: 64\nbeta: 0.02\nmax_steps: 10\n")
    with pytest.raises(RefitError) as e:
        parse_job(PPOConfig, ["--config", str(y)], "refit ppo")
    msg = str(e.value)
    assert "\n" not in msg and "unknown fields per_device_train_batch_size (TRL's name; here: run.batch_size counts " \
                               "prompts" in msg
    assert "max_completion_length (TRL's name; here: response_length)" in msg
    assert "beta (TRL's name; here: kl_coef with kl_penalty: loss and kl_estimator: k3" in msg
    assert "max_steps (TRL's name; here: run.steps counts rollouts" in msg
    with pytest.raises(RefitError, match=r"unknown arguments: --beta \(TRL's name; here: kl_coef with kl_penalty: "
                                         r"loss .*\) 0.02 \(see refit ppo --help\)"):
        parse_job(PPOConfig, ["--beta", "0.02"], "refit ppo")


def test_scale_rewards_takes_trls_bool_in_yaml_and_flags(tmp_path):
    from refit.learner.run.config import parse_job

    y = tmp_path / "c.yaml"
    for given, want in (("true", "group"), ("false", "none"), ("batch", "batch")):
        y.write_text(f"scale_rewards: {given}\nnum_generations: 2\nadvantage_estimator: grpo\n")
        assert parse_job(PPOConfig, ["--config", str(y)], "refit ppo")[0].scale_rewards == want
    for flag, want in (("False", "none"), ("true", "group"), ("false", "none"), ("batch", "batch")):
        assert parse_job(PPOConfig, ["--scale_rewards", flag], "refit ppo")[0].scale_rewards == want
    assert PPOConfig(scale_rewards=True).scale_rewards == "group"


def test_num_generations_without_an_estimator_is_refused():
    with pytest.raises(RefitError, match="num_generations=8 needs advantage_estimator chosen: grpo"):
        PPOConfig(num_generations=8)
    assert PPOConfig().advantage_estimator == "gae"  # one sample: PPO with the value head, as before
    assert PPOConfig(num_generations=8, advantage_estimator="gae").advantage_estimator == "gae"


# ------------------------------------------------------------------ runs


TRL_REWARD = '''
def scored(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """Uses everything TRL 1.x passes: the step, a logged metric, a logged column."""
    lengths = [len(c[0]["content"]) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    log_metric("global_step_seen", trainer_state.global_step)
    log_extra("chars", lengths)
    return [float(n) / 10 for n in lengths]
'''


def _chat_dataset(n=8):
    import datasets

    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i % 7}+{i % 5}="}],
                                        "answer": str(i % 7 + i % 5)} for i in range(n)])


def test_trl_reward_with_trainer_state_log_metric_log_extra(chat_model_dir, chat_engine_dir, tmp_path):
    from refit.learner.trl_compat import GRPOTrainer

    mod = tmp_path / "trl_rewards.py"
    mod.write_text(TRL_REWARD)
    sys.path.insert(0, str(tmp_path))
    try:
        from trl_rewards import scored
    finally:
        sys.path.remove(str(tmp_path))

    def correct(prompts, completions, answer, **kwargs):  # a plain callable beside it
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, steps_per_generation=2,
                      num_generations=2, max_completion_length=4, max_steps=4, beta=0.02, learning_rate=1e-3,
                      reward_weights=[1.0, 2.0],
                      refit={"model.engine_dir": str(chat_engine_dir), "export_final": False, "log.plots": False,
                             "log.progress": False, "rollout.probe_size": 2})
    trainer = GRPOTrainer(model=str(chat_model_dir), reward_funcs=[scored, correct], args=args,
                          train_dataset=_chat_dataset())
    out = trainer.train()
    rows = [r for r in trainer.result.metrics if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and out.global_step == 4  # 2 rollouts x 2 optimizer steps
    assert [r["global_step_seen"] for r in rows] == [0.0, 2.0]  # optimizer steps before each rollout (TRL's count)
    extras = [json.loads(ln) for ln in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [e["step"] for e in extras] == [1, 2]
    for r, e in zip(rows, extras):
        assert len(e["chars"]) == len(e["completion"]) == 8  # 4 prompts x 2 generations
        assert e["chars"] == [len(c[0]["content"]) for c in e["completion"]]
        assert r["mean_chars"] == pytest.approx(sum(e["chars"]) / 8)
        assert r["reward/scored/mean"] == pytest.approx(sum(e["chars"]) / 80, rel=1e-5)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "trl_rewards:scored" in saved and "kl_estimator: k3" in saved and "kl_penalty: loss" in saved


def test_a_reward_returning_a_non_number_stops_in_one_line():
    from refit.learner.ppo.rewards import load_rewards, score_rewards

    def text(prompts, completions, **kw):
        return ["yes" for _ in completions]

    with pytest.raises(RefitError, match=r"reward function 'text' returned str 'yes' for row 0; expected a number"):
        score_rewards(load_rewards([text], []), ["a"], ["b"], {})
    with pytest.raises(RefitError, match="neither a spec string"):
        load_rewards([3], [])


def test_examples_trl_chat_grpo_script_runs_two_steps(chat_model_dir, chat_engine_dir, tmp_path, monkeypatch):
    """examples/trl_chat/grpo.py as written (TRL names, callables, a datasets object), with only its length and
    batch cut for the test: 2 generations of 4 optimizer steps each (2 minibatches x 2 iterations). The embedded
    chat model is the session's tiny chat model here (REFIT_DEMO_MODELS), so nothing is built or exported."""
    import refit as tc  # the script imports from the public face

    models = tmp_path / "models"
    models.mkdir()
    (models / "policy").symlink_to(chat_model_dir)
    monkeypatch.setenv("REFIT_DEMO_MODELS", str(models))
    real = tc.GRPOConfig
    cut = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=8, save_steps=4,
               refit={"model.engine_dir": str(chat_engine_dir), "export_final": False, "log.plots": False,
                      "log.progress": False, "rollout.probe_size": 2})
    class Cut(real):  # the script's GRPOConfig(...), with the test's cuts on top
        def __init__(self, **kw):
            super().__init__(**{**kw, **cut})

    monkeypatch.setattr(tc, "GRPOConfig", Cut)
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "trl_chat"))
    runpy.run_path(str(ROOT / "examples" / "trl_chat" / "grpo.py"), run_name="__main__")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"reward/correct/mean", "reward/carry_bonus/mean", "kl/exact", "ppo/kl_loss"} <= set(r)
        assert 0.0 <= r["reward/mean"] <= 1.5 and r["kl/exact"] >= -1e-6
    saved = (tmp_path / "run" / "config.yaml").read_text()
    for line in ("batch_size: 2", "num_generations: 8", "num_mini_batches: 2", "num_ppo_epochs: 2", "kl_coef: 0.02",
                 "response_length: 6", "advantage_estimator: grpo", "scale_rewards: group"):
        assert line in saved, line


@pytest.mark.slow  # 52 s here (2 distillation steps with evaluation, on a loaded 2-core machine)
def test_run_distill_from_a_dataset_object(model_dirs, engine_dirs, tmp_path):
    """refit.learner.api.run_distill with a datasets.Dataset: saved under the run folder, named in config.yaml, trained
    on (its prompts, not the embedded task's)."""
    import datasets
    from conftest import tiny_distill_config

    from refit.learner.api import run_distill

    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(4)]
    cfg = tiny_distill_config(model_dirs, engine_dirs, tmp_path / "run", steps=2, save_steps=2)
    res = run_distill(cfg, train_dataset=datasets.Dataset.from_list(rows), log=lambda *_: None)
    assert [r["step"] for r in res.metrics if "loss" in r or "distill/loss" in r][-1] == 2
    assert res.run_dir == tmp_path / "run" and (res.run_dir / "train_dataset").is_dir()
    assert f"dataset: {tmp_path / 'run' / 'train_dataset'}" in (res.run_dir / "config.yaml").read_text()
    assert res.summary["steps"] == 2
