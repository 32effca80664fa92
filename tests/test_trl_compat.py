"""A TRL user's script on Refit: TRL's GRPO/RLOO names with TRL's meanings (refit.learner.trl), the TRL-name
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
from refit.learner.trl import GRPOConfig, RLOOConfig, to_ppo_config

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
    d = _ppo(max_steps=1)  # TRL 1.16's defaults: 1e-6, 512 tokens, 8 generations, seed 42, no TensorBoard
    assert (d.optim.learning_rate, d.response_length, d.num_generations, d.run.seed, d.log.tensorboard) == (
        1e-6, 512, 8, 42, False)


@pytest.mark.parametrize("kw, msg", [
    (dict(loss_type="ppo"), "loss_type='ppo': TRL 1.16's loss types are grpo, bnpo, dr_grpo, dapo"),
    (dict(delta=1.1, epsilon_high=0.28), "delta=1.1 must be > 1 .* epsilon_high"),
    (dict(use_vllm=True), "use_vllm=True: generation runs on Refit's engine"),
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
    -min(r A, clip(r, 1-eps, 1+eps) A) + beta * (exp(ref - logp) - (ref - logp) - 1) * r, summed over response
    tokens / their count (loss_type 'dapo', use_bias_correction_kl True)."""
    import copy

    from refit.core.hf_folder import load_model
    from refit.learner.ppo.cycle import update_settings
    from refit.learner.ppo.objective import Norm
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
                     adv, torch.zeros(b, tr), None, cfg.sampling.temperature)  # the rollout's: TRL's temperature 0.9
    n = mask.sum()  # one generation, one minibatch: TRL's dapo normaliser is its token count
    norm = Norm(tokens=n, dapo_tokens=n, seqs=b, micro_tokens=n, scale=1)
    loss, _ = _micro_loss(policy, None, exp, torch.arange(b), norm, s, ref_model=ref)
    logp, ref_lp, old_lp = lp(policy), lp(ref), lp(old)
    ratio = (logp - old_lp).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.9, 1.1) * adv)
    # use_bias_correction_kl (TRL 1.16's default True): the k3 term times the ratio
    per_token = per_token + 0.3 * ((ref_lp - logp).exp() - (ref_lp - logp) - 1) * ratio
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
    from refit.learner.trl import GRPOTrainer

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


# ------------------------------------------------------------------ issue 31: the whole TRL surface


def test_the_docs_field_table_is_generated_from_the_code():
    from refit.learner.trl.fields import BEGIN, END, field_table

    doc = (ROOT / "docs" / "trl-facade.md").read_text()
    assert doc.split(BEGIN)[1].split(END)[0].strip() == field_table().strip(), \
        "docs/trl-facade.md is stale: python -m refit.learner.trl.fields --write docs/trl-facade.md"


def test_training_arguments_a_cpu_script_sets_are_honoured_accepted_or_refused():
    from refit.learner.trl.field_tables import ACCEPTED, GRPO_ARGS, HONOURED, REFUSED

    kinds = {k: GRPO_ARGS[k].kind for k in ("use_cpu", "no_cuda", "report_to", "save_strategy", "logging_steps",
                                            "dataloader_num_workers", "disable_tqdm", "push_to_hub", "bf16", "fp16")}
    assert kinds == {"use_cpu": HONOURED, "no_cuda": HONOURED, "report_to": HONOURED, "save_strategy": HONOURED,
                     "logging_steps": HONOURED, "dataloader_num_workers": ACCEPTED, "disable_tqdm": HONOURED,
                     "push_to_hub": REFUSED, "bf16": HONOURED, "fp16": REFUSED}
    c = _ppo(max_steps=4, use_cpu=True, disable_tqdm=True, report_to="none", save_strategy="no", logging_steps=2,
             dataloader_num_workers=0)
    assert (c.run.device, c.log.progress, c.log.tensorboard, c.ckpt.save_steps) == ("cpu", False, False, 4)
    assert _ppo(max_steps=1, no_cuda=True).run.device == "cpu" and _ppo(max_steps=1).run.device == "auto"
    assert _ppo(max_steps=1, report_to="tensorboard").log.tensorboard
    # TRL's bf16: None leaves run.precision auto; True forces bf16 (a CPU included); False: the learner in fp32
    assert [(c.run.precision, c.run.bf16) for c in (_ppo(max_steps=1), _ppo(max_steps=1, bf16=True, use_cpu=True),
                                                     _ppo(max_steps=1, bf16=False))] == [
        ("auto", True), ("bf16", True), ("auto", False)]
    args = GRPOConfig(output_dir="o", dataloader_num_workers=4, max_steps=1)
    assert args.ignored == {"dataloader_num_workers": 4} and args.dataloader_num_workers == 4  # callbacks read it
    assert to_ppo_config(args, "m") == to_ppo_config(GRPOConfig(output_dir="o", max_steps=1), "m")  # changes nothing
    for kw, msg in ((dict(push_to_hub=True), "push_to_hub=True: nothing leaves the machine"),
                    (dict(fp16=True), "fp16=True: fp16 mixed precision is CUDA's"),
                    (dict(report_to="wandb"), "report_to='wandb': nothing leaves the machine"),
                    (dict(save_strategy="epoch"), "save_strategy='epoch': Refit saves by steps"),
                    (dict(logging_strategy="epoch"), "logging_strategy='epoch'")):
        with pytest.raises(RefitError, match=msg.replace("(", r"\(")) as e:
            _ppo(max_steps=2, **kw)
        assert "\n" not in str(e.value)


def test_peft_lora_config_maps_to_the_lora_section(model_dirs):
    import peft

    from refit.learner.trl import lora_values

    gpt2 = str(model_dirs["tiny-gpt2"])
    c = to_ppo_config(GRPOConfig(output_dir="o", max_steps=1), gpt2, peft_config=peft.LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert (c.lora.r, c.lora.alpha, c.lora.dropout, c.lora.target_modules, c.lora.init) == (
        8, 32.0, 0.05, ("all-linear",), "default")
    v = lora_values(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"), gpt2)
    assert v["lora.target_modules"] == ("q_proj", "v_proj") and v["lora.init"] == "gaussian"
    assert lora_values(peft.LoraConfig(r=4), gpt2)["lora.target_modules"] == ("c_attn",)  # PEFT's gpt2 default
    assert to_ppo_config(GRPOConfig(output_dir="o", max_steps=1), gpt2).lora.r == 0  # none: full fine-tuning
    for kw, msg in ((dict(use_dora=True), "use_dora=True: DoRA is not supported"),
                    (dict(use_rslora=True), "use_rslora=True: rsLoRA is not supported"),
                    (dict(bias="all"), "bias='all': only bias='none'"),
                    (dict(modules_to_save=["lm_head"]), "modules_to_save=.*not supported"),
                    (dict(layers_to_transform=[0]), "layers_to_transform=.*not supported"),
                    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa': Refit takes True"),
                    (dict(init_lora_weights=False), "init_lora_weights=False: Refit takes True")):
        with pytest.raises(RefitError, match=msg):
            lora_values(peft.LoraConfig(r=4, target_modules=["c_attn"], **kw), gpt2)


def test_model_init_kwargs_bf16_holds_the_lora_base_in_bf16(model_dirs):
    """TRL's way to hold a LoRA base in bf16 (model_init_kwargs dtype bfloat16) is lora.base_dtype bf16; float32 /
    explicitly fp32; "auto" / none leave Refit's auto; bf16 without LoRA and other dtypes are one line."""
    import peft

    gpt2, lora = str(model_dirs["tiny-gpt2"]), peft.LoraConfig(r=4, target_modules="all-linear")
    for dtype in (torch.bfloat16, "bfloat16"):
        for key in ("dtype", "torch_dtype"):
            c = to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, model_init_kwargs={key: dtype}), gpt2,
                              peft_config=lora)
            assert c.lora.base_dtype == "bf16"
    for kw, want in ((None, "auto"), ({"dtype": "auto"}, "auto"), ({"dtype": torch.float32}, "fp32"),
                     ({"attn_implementation": "eager"}, "auto")):
        assert to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, model_init_kwargs=kw), gpt2,
                             peft_config=lora).lora.base_dtype == want
    with pytest.raises(RefitError, match="model_init_kwargs dtype bfloat16 without peft_config") as e:
        to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, model_init_kwargs={"dtype": "bfloat16"}), gpt2)
    assert "\n" not in str(e.value)
    with pytest.raises(RefitError, match="model_init_kwargs dtype float16: Refit takes bfloat16"):
        to_ppo_config(GRPOConfig(output_dir="o", max_steps=1, model_init_kwargs={"dtype": torch.float16}), gpt2,
                      peft_config=lora)


def test_distillation_and_gkd_configs_map_trls_names():
    from refit.learner.trl import DistillationConfig, GKDConfig, to_distill_config

    d = to_distill_config(DistillationConfig(output_dir="o", max_steps=5, per_device_train_batch_size=4,
                                             gradient_accumulation_steps=2, beta=0.3, temperature=0.8,
                                             max_completion_length=12, use_cpu=True), "s", "t")
    assert (d.lmbda, d.loss, d.beta, d.sampling.temperature, d.loss_temperature, d.max_new_tokens) == (
        1.0, "jsd", 0.3, 0.8, 0.8, 12)
    assert (d.run.steps, d.run.batch_size, d.optim.gradient_accumulation_steps, d.run.device) == (5, 8, 2, "cpu")
    assert (d.sampling.top_p, d.student.model_dir, d.teacher.model_dir, d.optim.learning_rate) == (1.0, "s", "t",
                                                                                                      1e-6)
    g = to_distill_config(GKDConfig(output_dir="o", max_steps=3, lmbda=0.25), "s", "t")
    assert (g.lmbda, g.beta, g.sampling.temperature, g.max_new_tokens, g.seq_kd, g.loss) == (0.25, 0.5, 0.9, 128,
                                                                                            False, "jsd")
    assert g.loss_temperature == 1.0  # TRL's GKD loss is at temperature 1 (its DistillationTrainer's at T: d above)
    for beta in (0.0, 0.5, 1.0):  # TRL's seq_kd: the generalised JSD at beta on the teacher's sequences
        s = to_distill_config(GKDConfig(output_dir="o", max_steps=3, seq_kd=True, beta=beta, lmbda=0.5), "s", "t")
        assert (s.seq_kd, s.loss, s.beta, s.lmbda, s.loss_temperature) == (True, "jsd", beta, 0.5, 1.0)
    with pytest.raises(RefitError, match="GKDConfig: 'no_such' is not supported"):
        GKDConfig(no_such=1)
    with pytest.raises(RefitError, match="num_generations=4: not a DistillationConfig field in TRL 1.16"):
        DistillationConfig(num_generations=4)
    e = to_distill_config(DistillationConfig(output_dir="o", max_steps=6, eval_strategy="steps", eval_steps=2), "s",
                          "t", 20, None, 5)
    assert (e.eval_every, e.eval_size, e.data.eval_split) == (2, 5, "eval")  # eval_dataset: the split 'eval'
    assert to_distill_config(DistillationConfig(output_dir="o", max_steps=6), "s", "t", 20, None, 5).eval_every == 6
    with pytest.raises(RefitError, match="eval_strategy='epoch': Refit evaluates by steps"):
        to_distill_config(DistillationConfig(output_dir="o", max_steps=6, eval_strategy="epoch"), "s", "t", 20, None, 5)


def test_gkd_messages_rows_become_prompt_and_completion():
    import datasets

    from refit.learner.trl.distill import prompt_completion

    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "1+2="},
                                                   {"role": "assistant", "content": "3"}]}])
    row = prompt_completion(ds)[0]
    assert row["prompt"] == [{"role": "user", "content": "1+2="}]
    assert row["completion"] == [{"role": "assistant", "content": "3"}]


class _Recorder:
    """A TrainerCallback that records every event, times each step, and asks for a save and a stop."""

    def __new__(cls, stop_at=None, save_at=None):
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self):
                self.events, self.times, self.logs = [], [], []

            def on_train_begin(self, args, state, control, **kw):
                self.events.append(("train_begin", state.global_step))

            def on_step_begin(self, args, state, control, **kw):
                self.events.append(("step_begin", state.global_step))
                self.t0 = __import__("time").perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self.events.append(("step_end", state.global_step))
                self.times.append(__import__("time").perf_counter() - self.t0)
                if state.global_step == save_at:
                    control.should_save = True
                if state.global_step == stop_at:
                    control.should_training_stop = True
                return control

            def on_log(self, args, state, control, logs=None, **kw):
                self.events.append(("log", state.global_step))
                self.logs.append(dict(logs))

            def on_evaluate(self, args, state, control, metrics=None, **kw):
                self.events.append(("evaluate", state.global_step))

            def on_save(self, args, state, control, **kw):
                self.events.append(("save", state.global_step))

            def on_train_end(self, args, state, control, **kw):
                self.events.append(("train_end", state.global_step))

        return Recorder()


def test_grpo_callbacks_state_and_a_model_object(chat_model_dir, chat_engine_dir, tmp_path):
    """A model object without processing_class (its tokenizer from name_or_path), transformers' callbacks firing
    at TRL's points, should_save saving, should_training_stop stopping after step 3 of 4, log_history in TRL's
    names every logging_steps, use_cpu; the object given in holds the trained weights afterwards."""
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerState

    from refit.learner.trl import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(chat_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rec = _Recorder(stop_at=3, save_at=1)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=4, beta=0.02, learning_rate=1e-3, use_cpu=True,
                      logging_steps=2, save_steps=100, report_to="none", disable_tqdm=True,
                      refit={"model.engine_dir": str(chat_engine_dir), "log.plots": False, "rollout.probe_size": 2})

    def correct(prompts, completions, answer, **kwargs):
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model=model, reward_funcs=[correct], args=args, train_dataset=_chat_dataset(),
                          callbacks=[rec, PrinterCallback])
    trainer.remove_callback(PrinterCallback)
    assert trainer.callbacks == [rec] and isinstance(trainer.state, TrainerState) and trainer.state.global_step == 0
    out = trainer.train()
    assert rec.events == [("train_begin", 0), ("step_begin", 0), ("step_end", 1), ("save", 1), ("step_begin", 1),
                          ("step_end", 2), ("log", 2), ("step_begin", 2), ("step_end", 3), ("log", 3),
                          ("log", 3), ("train_end", 3)]
    assert len(rec.times) == 3 and all(t > 0 for t in rec.times)
    assert out.global_step == trainer.state.global_step == 3
    rows = trainer.state.log_history
    assert [r["step"] for r in rows] == [2, 3, 3] and rec.logs == [{k: v for k, v in r.items() if k != "step"}
                                                                   for r in rows]
    for key in ("reward", "reward_std", "rewards/correct/mean", "kl", "loss", "learning_rate", "grad_norm",
                "completions/mean_length", "epoch", "step_time", "entropy", "frac_reward_zero_std"):
        assert key in rows[0], key
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # stopped after step 3; every step in metrics.jsonl
    assert rows[0]["reward"] == pytest.approx((metrics[0]["reward/mean"] + metrics[1]["reward/mean"]) / 2)
    assert rows[0]["completions/mean_length"] == pytest.approx(
        (metrics[0]["response/length"] + metrics[1]["response/length"]) / 2)
    assert metrics[2]["reward"] == metrics[2]["reward/mean"] and metrics[2]["kl"] == metrics[2]["ppo/kl_loss"]
    assert rows[0]["epoch"] == 2 * 2 / 8 and rows[1]["epoch"] == 3 * 2 / 8  # 2 prompts a step, 8 prompts
    assert rows[0]["learning_rate"] == pytest.approx(1e-3 * (4 - 1) / 4)  # the rate step 2 used (TRL's)
    assert rows[-1]["train_loss"] == pytest.approx(out.training_loss) and "train_runtime" in rows[-1]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts[0].endswith("1") and (tmp_path / "run" / "final" / "config.json").is_file()  # should_save: step 1
    assert trainer.model is model and any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(torch.equal(final.state_dict()[k], v) for k, v in model.state_dict().items())


def test_distillation_and_gkd_trainers_run_with_callbacks(model_dirs, engine_dirs, tmp_path):
    """DistillationTrainer (on-policy) and GKDTrainer (lmbda 0.5) through the TRL surface on the tiny pair: each
    step fires on_step_end, the held-out evaluation on_evaluate, log_history carries TRL's names."""
    import datasets

    from refit.learner.trl import DistillationConfig, DistillationTrainer, GKDConfig, GKDTrainer

    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(4)]
    for cls, cfg_cls, kw in ((DistillationTrainer, DistillationConfig, dict(max_completion_length=4)),
                             (GKDTrainer, GKDConfig, dict(max_new_tokens=4, lmbda=0.5))):
        rec = _Recorder()
        out = tmp_path / cls.__name__
        args = cfg_cls(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                       logging_steps=1, use_cpu=True, disable_tqdm=True, **kw,
                       refit={"teacher.engine_dir": str(engine_dirs["tiny-llama"]),
                              "student.engine_dir": str(engine_dirs["tiny-gpt2"]), "eval_size": 4, "eval_every": 2,
                              "export_final": False, "log.plots": False, "rollout.probe_size": 2})
        trainer = cls(model=str(model_dirs["tiny-gpt2"]), teacher_model=str(model_dirs["tiny-llama"]), args=args,
                      train_dataset=datasets.Dataset.from_list(rows), callbacks=[rec])
        assert trainer.config.loss == "jsd" and trainer.config.lmbda == (1.0 if cls is DistillationTrainer else 0.5)
        trainer.train()
        assert [e for e in rec.events if e[0] in ("step_end", "evaluate", "log")] == [
            ("step_end", 1), ("log", 1), ("step_end", 2), ("log", 2), ("log", 2), ("evaluate", 2), ("log", 2)]
        held = trainer.state.log_history[2]
        assert held["eval_kl_to_teacher"] >= 0 and 0 <= held["eval_accuracy"] <= 1 and trainer.evaluate() == {
            k: v for k, v in held.items() if k != "step"}
        first = trainer.state.log_history[0]
        for key in ("loss", "grad_norm", "learning_rate", "completions/mean_length", "epoch", "step_time"):
            assert key in first, key
        metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        assert first["loss"] == metrics[1]["loss"] and first["learning_rate"] == 1e-3  # row 0: step 0
        assert trainer.state.log_history[1]["learning_rate"] == pytest.approx(metrics[1]["lr"])  # step 2's
        assert trainer.state.global_step == 2 and trainer.model is not None


def test_grpo_eval_dataset_eval_steps_and_evaluate(chat_model_dir, chat_engine_dir, tmp_path):
    """eval_dataset with eval_strategy='steps': Refit's held-out evaluation every eval_steps, logged in TRL's names
    (eval_reward, eval_rewards/<f>/mean, eval_completions/mean_length) before on_evaluate; evaluate() returns the
    last step's, the one metrics.jsonl holds."""
    from refit.learner.trl import GRPOTrainer

    def correct(prompts, completions, answer, **kwargs):
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    def chars(completions, **kwargs):
        return [len(c[0]["content"]) / 10 for c in completions]

    rec = _Recorder()
    refit = {"model.engine_dir": str(chat_engine_dir), "log.plots": False, "export_final": False,
             "rollout.probe_size": 2}
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=4, learning_rate=1e-3, logging_steps=1, beta=0.02,
                      eval_strategy="steps", eval_steps=2, use_cpu=True, disable_tqdm=True, refit=refit)
    with pytest.raises(RefitError, match=r"eval_strategy='steps' needs an eval_dataset"):
        GRPOTrainer(model=str(chat_model_dir), reward_funcs=correct, args=args, train_dataset=_chat_dataset())
    trainer = GRPOTrainer(model=str(chat_model_dir), reward_funcs=[correct, chars], args=args,
                          train_dataset=_chat_dataset(), eval_dataset=_chat_dataset(3), callbacks=[rec])
    assert trainer.config.eval_steps == 2 and trainer.config.data.eval_split == "eval"
    with pytest.raises(RefitError, match="nothing evaluated yet"):
        trainer.evaluate()
    trainer.train()
    assert [e for e in rec.events if e[0] == "evaluate"] == [("evaluate", 2), ("evaluate", 4)]
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2, 4]
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    for r in evals:
        m = metrics[r["step"]]
        assert r["eval_reward"] == m["eval/reward/mean"] and r["eval_rewards/chars/mean"] == m["eval/reward/chars/mean"]
        assert r["eval_completions/mean_length"] == m["eval/response_length"]
    assert "eval/reward/mean" in metrics[0]  # and at step 0, in metrics.jsonl
    out = trainer.evaluate()
    assert out == {k: v for k, v in evals[-1].items() if k != "step"} and rec.events[-1] == ("evaluate", 4)
    assert trainer.state.log_history[-1]["eval_reward"] == out["eval_reward"]


@pytest.mark.parametrize("kw", [dict(tools=[len]), dict(rollout_func=len), dict(environment_factory=len),
                                dict(quantization_config=object()), dict(optimizers=(object(), None)),
                                dict(reward_processing_classes=object())])
def test_grpo_trainer_arguments_refit_does_not_build_are_one_line(kw, tmp_path):
    """TRL 1.16's GRPOTrainer arguments beyond the config: each one Refit does not build is one line, before any work."""
    from refit.learner.trl import GRPOTrainer

    with pytest.raises(RefitError, match=f"GRPOTrainer: {next(iter(kw))} is not supported \\(Refit: "):
        GRPOTrainer(model="m", reward_funcs=len, args=GRPOConfig(output_dir=str(tmp_path)), train_dataset=[], **kw)


def test_trainer_signatures_are_trls_in_order():
    """Each trainer takes TRL 1.16's arguments by TRL's names and in TRL's positional order (read from
    trl/trainer/grpo_trainer.py, rloo_trainer.py, distillation_trainer.py, trl/experimental/gkd/gkd_trainer.py);
    RLOOTrainer's are GRPOTrainer's first 11."""
    import inspect

    from refit.learner.trl import DistillationTrainer, GKDTrainer, GRPOTrainer, RLOOTrainer

    grpo = ["model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
            "reward_processing_classes", "callbacks", "optimizers", "quantization_config", "peft_config", "tools",
            "rollout_func", "environment_factory"]
    want = {GRPOTrainer: grpo, RLOOTrainer: grpo,
            DistillationTrainer: ["model", "teacher_model", "args", "train_dataset", "eval_dataset",
                                  "processing_class", "callbacks", "optimizers", "quantization_config", "peft_config",
                                  "tools"],
            GKDTrainer: ["model", "teacher_model", "args", "data_collator", "train_dataset", "eval_dataset",
                         "processing_class", "compute_metrics", "callbacks", "optimizers",
                         "preprocess_logits_for_metrics", "peft_config", "formatting_func"]}
    for cls, names in want.items():
        assert list(inspect.signature(cls.__init__).parameters)[1:] == names, cls.__name__
