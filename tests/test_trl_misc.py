"""Issue 42's optimizer, schedule, reference-sync and training-argument fields, each against an independent
reference: torch's AdamW with the same betas on the same gradients, transformers' get_scheduler with the same
kwargs, transformers' own NEFTune hook, the TR-DPO mix computed by hand; and the facade's refusals with TRL's
reasons."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.parsing import with_values
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.models import make_optimizer
from refit.learner.ppo.refsync import REFERENCE_FILE, RefSync, mix_into
from refit.learner.run.config import DataSection, OptimSection
from refit.learner.run.optim import neftune, neftune_noise, rates, schedule
from refit.learner.trl import GRPOConfig, RLOOConfig, to_ppo_config

TINY = dict(steps=2, batch_size=4, num_generations=2, num_mini_batches=1, num_ppo_epochs=1, response_length=4,
            save_steps=1, keep_checkpoints=0, probe_size=4, progress=False, tensorboard=False, plots=False,
            max_operand=9, num_prompts=32, learning_rate=1e-2, export_final=False, advantage_estimator="grpo")


def _varied(prompts, completions, **kw):
    """A reward that differs between completions, so the group advantages move the policy."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _run(cfg):
    from refit.learner.api import run_ppo
    from refit.learner.run.metrics import read_metrics

    return [r for r in read_metrics(run_ppo(cfg, reward_funcs=[_varied], log=lambda *_: None).run_dir)
            if "kl/exact" in r]


def _ppo(**kw):
    return to_ppo_config(GRPOConfig(output_dir="out", max_steps=kw.pop("max_steps", 10), **kw), "model")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).requires_grad_(True), g


# ------------------------------------------------------------------ optimizer and schedule


def test_adam_betas_and_epsilon_are_torch_adamw_with_those_values():
    """GRPOConfig(adam_beta1, adam_beta2, adam_epsilon) -> the job's optimizer: three steps on the same gradients
    give torch.optim.AdamW(betas, eps)'s parameters exactly, and differ from the default betas'."""
    cfg = _ppo(adam_beta1=0.7, adam_beta2=0.95, adam_epsilon=1e-3, learning_rate=0.1, weight_decay=0.01)
    assert (cfg.optim.adam_beta1, cfg.optim.adam_beta2, cfg.optim.adam_epsilon) == (0.7, 0.95, 1e-3)
    ours, g = _params()
    theirs, default = _params()[0], _params()[0]
    for m in (theirs, default):
        m.load_state_dict(ours.state_dict())
    opt, _ = make_optimizer(cfg, ours, None)
    ref = torch.optim.AdamW(theirs.parameters(), lr=0.1, betas=(0.7, 0.95), eps=1e-3, weight_decay=0.01)
    plain = torch.optim.AdamW(default.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(3):
        x = torch.randn(6, 5, generator=g)
        for m, o in ((ours, opt), (theirs, ref), (default, plain)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b, c in zip(ours.parameters(), theirs.parameters(), default.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.allclose(a, c) for a, c in zip(ours.parameters(), default.parameters()))


@pytest.mark.parametrize("kind, kwargs", [("cosine_with_min_lr", {"min_lr": 1e-4}),
                                          ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                          ("cosine_with_restarts", {"num_cycles": 2}),
                                          ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
                                          ("warmup_stable_decay", {"num_decay_steps": 4, "min_lr_ratio": 0.1})])
def test_schedule_with_kwargs_is_transformers_get_scheduler(kind, kwargs):
    """lr_scheduler_type + lr_scheduler_kwargs (a dict, or its JSON string as transformers takes it) -> the job's
    schedule and the facade's logged rate, each step's rate equal to transformers.get_scheduler's with the same
    scheduler_specific_kwargs."""
    from transformers import get_scheduler

    for given in (kwargs, json.dumps(kwargs)):
        cfg = _ppo(lr_scheduler_type=kind, lr_scheduler_kwargs=given, warmup_steps=2, learning_rate=1e-3,
                   max_steps=12)
        model, _ = _params()
        opt, sched = make_optimizer(cfg, model, None)
        ref_opt = torch.optim.AdamW(_params()[0].parameters(), lr=1e-3)
        ref = get_scheduler(kind, ref_opt, num_warmup_steps=2, num_training_steps=12,
                            scheduler_specific_kwargs=dict(kwargs))
        logged = rates(cfg.optim, 12)
        ours, theirs = [], []
        for n in range(12):
            ours.append(sched.get_last_lr()[0])
            theirs.append(ref.get_last_lr()[0])
            assert logged(n) == pytest.approx(theirs[-1], rel=1e-12, abs=1e-18)
            opt.step(), sched.step(), ref_opt.step(), ref.step()
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    if kind in ("cosine_with_restarts", "polynomial"):  # the kwargs change the rates (the others need theirs)
        plain = _ppo(lr_scheduler_type=kind, warmup_steps=2, learning_rate=1e-3, max_steps=12)
        assert [rates(plain.optim, 12)(n) for n in range(12)] != pytest.approx(theirs, rel=1e-6)


def test_schedule_kwargs_refusals_are_one_line():
    with pytest.raises(RefitError, match="cosine_with_min_lr.*min_lr") as e:
        schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), OptimSection(
            lr_scheduler_type="cosine_with_min_lr"), 10)
    assert "\n" not in str(e.value)
    with pytest.raises(RefitError, match="lr_scheduler_kwargs.*'cosine'.*nope"):
        schedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), OptimSection(
            lr_scheduler_type="cosine", lr_scheduler_kwargs=("nope=1",)), 10)
    with pytest.raises(RefitError, match="is not NAME=VALUE"):
        OptimSection(lr_scheduler_kwargs=("min_lr",))
    with pytest.raises(RefitError, match="lr_scheduler_type='reduce_lr_on_plateau'.*evaluation metric"):
        _ppo(lr_scheduler_type="reduce_lr_on_plateau")


def test_optim_fields_from_flags_and_distill_config(tmp_path):
    """The same fields from `refit ppo` / `refit distill` flags; the distillation job's optimizer built from them."""
    from refit.learner.distill.config import DistillConfig
    from refit.learner.distill.cycle import _optimizer
    from refit.learner.run.config import parse_job

    argv = ["--optim.adam_beta1", "0.8", "--optim.adam_epsilon", "1e-6", "--optim.lr_scheduler_type",
            "cosine_with_min_lr", "--optim.lr_scheduler_kwargs", "min_lr=1e-7", "num_cycles=0.25",
            "--optim.neftune_noise_alpha", "5", "--data.data_seed", "3"]
    for cls in (PPOConfig, DistillConfig):
        cfg, _ = parse_job(cls, argv + (["--sync_ref_model", "--ref_model_sync_steps", "4", "--kl_coef", "0.1",
                                         "--num_ppo_epochs", "1", "--num_mini_batches", "2"]
                                        if cls is PPOConfig else []), "refit")
        o = cfg.optim
        assert (o.adam_beta1, o.adam_epsilon, o.lr_scheduler_kwargs, o.neftune_noise_alpha, cfg.data.data_seed) == (
            0.8, 1e-6, ("min_lr=1e-7", "num_cycles=0.25"), 5.0, 3)
    assert cfg.data.order_seed(0) == 3 and DataSection().order_seed(11) == 11
    ppo, _ = parse_job(PPOConfig, ["--sync_ref_model", "--ref_model_sync_steps", "4", "--kl_coef", "0.1"], "refit")
    assert (ppo.sync_ref_model, ppo.ref_model_sync_steps, ppo.ref_model_mixup_alpha) == (True, 4, 0.6)
    d = with_values(DistillConfig(), **{"optim.adam_beta2": 0.9, "optim.adam_epsilon": 1e-5})
    opt, _ = _optimizer(d, torch.nn.Linear(2, 2))
    assert (opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]) == ((0.9, 0.9), 1e-5)


# ------------------------------------------------------------------ NEFTune


def test_neftune_noise_is_transformers_hook_and_its_magnitude_the_formula(model_dirs):
    """On the same RNG draws Refit's noise is transformers' neftune_post_forward_hook's; every element is within
    alpha / sqrt(L * d) and the largest reaches it (L: the forward's sequence length, d: the hidden size); the
    learner's forward changes inside the context only."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.neftune import neftune_post_forward_hook

    emb = torch.randn(3, 7, 16)
    torch.manual_seed(0)
    ours = emb + neftune_noise(emb, 5.0)
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.neftune_noise_alpha = 5.0
    theirs = neftune_post_forward_hook(module, None, emb)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    big = torch.zeros(4, 50, 64)
    noise = neftune_noise(big, 10.0)
    bound = 10.0 / math.sqrt(50 * 64)
    assert noise.abs().max() <= bound and noise.abs().max() > 0.99 * bound and abs(float(noise.mean())) < bound / 20

    model = AutoModelForCausalLM.from_pretrained(str(model_dirs["tiny-gpt2"])).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    emb = model.get_input_embeddings()
    clean, clean_emb = model(ids).logits, emb(ids).detach()
    with neftune(model, 5.0):
        seen = []
        h = emb.register_forward_hook(lambda m, i, o: seen.append(o.detach()))  # runs after Refit's noise hook
        noisy = model(ids).logits
        h.remove()
    after = model(ids).logits
    bound = 5.0 / math.sqrt(ids.shape[1] * model.config.n_embd)
    diff = (seen[0] - clean_emb).abs().max()
    assert 0.9 * bound < diff <= bound + 1e-7
    assert not torch.allclose(clean, noisy) and torch.equal(clean, after)


@pytest.mark.slow
def test_neftune_in_a_ppo_and_a_distill_step(model_dirs, engine_dirs, tmp_path):
    """NEFTune in a run: the PPO step (the probe of the push on the clean probe batch, not on the noisy rollout
    scoring) and the distillation step both change with it; the engine's sampling does not (same tokens)."""
    from conftest import tiny_distill_config

    from refit.learner.distill.cycle import run_distill
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    rows = {}
    for alpha in (0.0, 20.0):
        cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                                  output_dir=str(tmp_path / f"ppo{alpha}"), neftune_noise_alpha=alpha, **TINY)
        rows[alpha] = read_metrics(run_ppo(cfg, log=lambda *_: None))
    clean, noisy = ([r for r in rows[a] if r.get("step") == 1 and "kl/exact" in r][0] for a in (0.0, 20.0))
    assert clean["response/length"] == noisy["response/length"]  # step 1: the engine sampled the same tokens
    # the noisy policy against the clean step-0 reference: KL > 0 at step 1 (0 without NEFTune), as in TRL
    assert abs(clean["kl/exact"]) < 1e-6 and noisy["kl/exact"] > 1e-5
    assert clean["ppo/grad_norm"] != noisy["ppo/grad_norm"]
    losses = {}
    for alpha in (0.0, 20.0):
        cfg = tiny_distill_config(model_dirs, engine_dirs, tmp_path / f"d{alpha}", steps=1, neftune_noise_alpha=alpha)
        losses[alpha] = [r for r in read_metrics(run_distill(cfg, log=lambda *_: None)) if "loss" in r][0]["loss"]
    assert losses[0.0] != losses[20.0]


# ------------------------------------------------------------------ sync_ref_model


def test_mix_is_alpha_policy_plus_one_minus_alpha_reference_and_due_at_trl_steps():
    ref, _ = _params(1)
    pol, _ = _params(2)
    want = [0.3 * p.detach() + 0.7 * r.detach() for p, r in zip(pol.parameters(), ref.parameters())]
    mix_into(ref, pol, 0.3)
    for r, w in zip(ref.parameters(), want):
        torch.testing.assert_close(r.detach(), w, rtol=0, atol=1e-7)
    s = RefSync(ref, 0.3, every=4, per=2)  # TRL: global_step % 4 == 0, two optimizer steps per Refit step
    assert [st for st in range(1, 7) if s.due(st)] == [2, 4, 6]


@pytest.mark.parametrize("ref_backend", [pytest.param("torch", marks=pytest.mark.slow), "onnxruntime"])
def test_sync_ref_model_mixes_the_reference_by_hand_and_the_engine_takes_it(model_dirs, engine_dirs, tmp_path,
                                                                           ref_backend):
    """Two steps, a mix after each: KL(0) = 0 at step 1; each checkpoint's reference.pt is alpha x that step's
    policy + (1 - alpha) x the reference before, computed by hand from the checkpoints (the engine reference is
    pushed each mix: test_engine_and_torch_references_agree_after_syncs)."""
    from safetensors.torch import load_file

    out = tmp_path / ref_backend
    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                              output_dir=str(out), ref_backend=ref_backend, kl_coef=0.5, kl_penalty="loss",
                              kl_estimator="k3", sync_ref_model=True, ref_model_sync_steps=1,
                              ref_model_mixup_alpha=0.4, **TINY)
    rows = _run(cfg)
    assert abs(rows[0]["kl/exact"]) <= 1e-6 and rows[0]["ref/syncs"] == 1 and rows[1]["ref/syncs"] == 2
    assert rows[1]["kl/exact"] > 1e-6  # the policy moved: the mixes below are not of equal weights
    prev = load_file(str(Path(model_dirs["tiny-gpt2"]) / "model.safetensors"))
    for step in (1, 2):
        ck = out / "checkpoints" / f"step_{step:06d}"
        policy = load_file(str(ck / "policy" / "model.safetensors"))
        ref = torch.load(ck / REFERENCE_FILE, weights_only=False)
        assert ref["syncs"] == step
        for name, w in ref["weights"].items():
            if name in policy:
                torch.testing.assert_close(w, 0.4 * policy[name] + 0.6 * prev[name], rtol=0, atol=1e-6)
        prev = {k: v for k, v in ref["weights"].items()}


@pytest.mark.slow
def test_engine_and_torch_references_agree_after_syncs(model_dirs, engine_dirs, tmp_path):
    """Three steps, a mix after each: the engine reference (pushed each mix) scores the KL the PyTorch one does."""
    kls = {}
    for backend in ("torch", "onnxruntime"):
        cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                                  output_dir=str(tmp_path / backend), ref_backend=backend, kl_coef=0.5,
                                  sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                                  **{**TINY, "steps": 3, "save_steps": 3})
        kls[backend] = [r["kl/exact"] for r in _run(cfg)]
    assert kls["torch"][2] > 1e-5  # the policy moved off the (mixed) reference
    assert kls["torch"] == pytest.approx(kls["onnxruntime"], abs=2e-5)


def test_sync_ref_model_refusals_follow_trl(model_dirs):
    import peft

    c = to_ppo_config(RLOOConfig(output_dir="o", max_steps=4, sync_ref_model=True, ref_model_sync_steps=2,
                                 ref_model_mixup_alpha=0.9), "m")
    assert (c.sync_ref_model, c.ref_model_sync_steps, c.ref_model_mixup_alpha) == (True, 2, 0.9)
    for kw, msg in ((dict(beta=0.0), "sync_ref_model at kl_coef 0: the reference is never scored"),
                    (dict(beta=0.1, num_iterations=2, ref_model_sync_steps=3), "ref_model_sync_steps=3 must be a "
                                                                               "multiple of num_ppo_epochs")):
        with pytest.raises(RefitError, match=msg):
            _ppo(sync_ref_model=True, max_steps=6, **kw)
    with pytest.raises(RefitError, match="sync_ref_model with lora: a LoRA run's reference is the base"):
        to_ppo_config(GRPOConfig(output_dir="o", max_steps=2, beta=0.1, sync_ref_model=True),
                      str(model_dirs["tiny-gpt2"]), peft_config=peft.LoraConfig(r=4, target_modules="all-linear"))


# ------------------------------------------------------------------ the other training arguments


@pytest.mark.slow
def test_num_generations_eval_samples_n_completions_per_held_out_prompt(model_dirs, engine_dirs, tmp_path):
    import datasets

    from refit.learner.api import run_ppo

    seen = []

    def reward(prompts, completions, **kw):
        seen.append(len(completions))
        return [0.0] * len(completions)

    data = datasets.Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(12)]})
    assert _ppo(num_generations_eval=3).num_generations_eval == 3 and _ppo().num_generations_eval == 0
    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                              output_dir=str(tmp_path), eval_steps=1, eval_fraction=0.25, num_generations_eval=3,
                              **{**TINY, "steps": 1})
    run_ppo(cfg, reward_funcs=[reward], train_dataset=data)
    assert seen == [9, 8, 9]  # step-0 evaluation: 3 held-out prompts x 3; the step: 4 prompts x 2; the last eval


def test_facade_refusals_and_acceptances_say_trls_reason():
    from refit.learner.trl import DistillationConfig, GKDConfig, to_distill_config

    for cls, kw, msg in ((GKDConfig, dict(packing=True), "GKDTrainer refuses it too"),
                         (DistillationConfig, dict(num_generations=4), "not a DistillationConfig field in TRL 1.16"),
                         (DistillationConfig, dict(generation_batch_size=8), "not a DistillationConfig field")):
        with pytest.raises(RefitError, match=msg) as e:
            cls(output_dir="o", **kw)
        assert "\n" not in str(e.value)
    a = GRPOConfig(output_dir="o", max_steps=1, resume_from_checkpoint="somewhere")
    assert a.ignored == {"resume_from_checkpoint": "somewhere"}
    # what TRL 1.16's trainers take and ignore is taken and ignored here too (a script moves over unchanged)
    for cls, kw in ((GRPOConfig, dict(label_smoothing_factor=0.1)), (GKDConfig, dict(label_smoothing_factor=0.1)),
                    (GRPOConfig, dict(data_seed=3))):
        assert cls(output_dir="o", max_steps=1, **kw).ignored == kw
    g = GKDConfig(output_dir="o", max_steps=1, assistant_only_loss=True, data_seed=7, neftune_noise_alpha=5.0,
                  adam_beta2=0.98)
    d = to_distill_config(g, "s", "t")
    assert (d.data.data_seed, d.optim.neftune_noise_alpha, d.optim.adam_beta2) == (7, 5.0, 0.98)
    assert to_distill_config(GKDConfig(output_dir="o", max_steps=1), "s", "t").data.data_seed == -1


@pytest.mark.slow
def test_resume_continues_with_the_mixed_reference(model_dirs, engine_dirs, tmp_path):
    """A run stopped after step 1 and resumed scores step 2 against the mixed reference of its checkpoint (engine
    reference, pushed on resume): its metrics equal the uninterrupted run's."""
    from refit.learner.api import run_ppo

    def cfg(out, **kw):
        return PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                                   output_dir=str(out), ref_backend="onnxruntime", kl_coef=0.5, sync_ref_model=True,
                                   ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, **{**TINY, **kw})

    full = _run(cfg(tmp_path / "full"))
    run_ppo(cfg(tmp_path / "part", max_steps_this_run=1), reward_funcs=[_varied], log=lambda *_: None)
    run_ppo(cfg(tmp_path / "part"), reward_funcs=[_varied], resume=True, log=lambda *_: None)
    from refit.learner.run.metrics import read_metrics

    part = [r for r in read_metrics(tmp_path / "part") if "kl/exact" in r]
    assert [r["step"] for r in part] == [1, 2] and part[1]["ref/syncs"] == 2
    assert part[1]["kl/exact"] == pytest.approx(full[1]["kl/exact"], abs=1e-6) and full[1]["kl/exact"] > 1e-6
