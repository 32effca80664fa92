"""The PPO update's loss terms against hand computations: the KL term of ``kl_penalty: loss`` with each
estimator, and bf16 autocast of the learner forward."""

from __future__ import annotations

import copy

import pytest
import torch

from refit.core.hf_folder import load_model
from refit.core.errors import RefitError
from refit.learner.ppo.update import Experience, UpdateSettings, _micro_loss, ppo_update
from refit.learner.run.policy import ValueHead, hidden_size

B, TP, TR = 4, 5, 6


@pytest.fixture(scope="module")
def models(model_dirs):
    """A tiny GPT-2 policy that differs from its reference (perturbed weights), and a zero value head."""
    torch.manual_seed(0)
    ref = load_model(model_dirs["tiny-gpt2"]).eval().requires_grad_(False)
    policy = copy.deepcopy(ref).requires_grad_(True)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref, ValueHead(hidden_size(policy))


def _experience(policy, ref, temperature: float) -> Experience:
    """Unpadded prompts (so a plain HF forward is the reference), a response with one padded tail."""
    g = torch.Generator().manual_seed(1)
    v = policy.config.vocab_size
    prompt = torch.randint(4, v, (B, TP), generator=g)
    response = torch.randint(4, v, (B, TR), generator=g)
    mask = torch.ones(B, TR)
    mask[0, 4:] = 0  # a short row: its padding must not count
    old = _hand_logprobs(policy, prompt, response, temperature)[0].detach()
    ref_lp = _hand_logprobs(ref, prompt, response, temperature)[0]
    z = torch.zeros(B, TR)
    return Experience(prompt, torch.ones(B, TP, dtype=torch.long), response, mask, old, ref_lp, z,
                      torch.linspace(-1, 1, B * TR).view(B, TR), z, None, temperature)


def _hand_logprobs(model, prompt, response, temperature):
    """log pi(response | prompt) per token and the full log-softmax, from ONE plain forward of the sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, response], 1)).logits[:, TP - 1:TP - 1 + TR].float()
    logp_all = torch.log_softmax(logits / temperature, -1)
    return logp_all.gather(-1, response[..., None])[..., 0], logp_all


def _hand_kl(policy, ref, exp: Experience, kind: str, temperature: float) -> float:
    """The KL term by its definition (Schulman, "Approximating KL divergence", 2020), masked token mean."""
    lp, lp_all = _hand_logprobs(policy, exp.prompt_ids, exp.response_ids, temperature)
    rlp, rlp_all = _hand_logprobs(ref, exp.prompt_ids, exp.response_ids, temperature)
    log_ratio = rlp - lp  # log q/p at the sampled token
    per_token = {"k1": -log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": log_ratio.exp() - 1 - log_ratio,
                 "exact": (lp_all.exp() * (lp_all - rlp_all)).sum(-1)}[kind]
    return float((per_token * exp.mask).sum() / exp.mask.sum())


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "exact"])
def test_loss_mode_kl_term_equals_hand_computation(models, kind):
    policy, ref, vh = models
    t = 0.8
    exp = _experience(policy, ref, t)
    s = UpdateSettings(1, 1, 1, 0.2, 0.2, 0.0, 0.0, 1.0, kl_coef=0.5, kl_in_loss=True, kl_estimator=kind)
    idx = torch.arange(B)
    loss, stats = _micro_loss(policy, vh, exp, idx, exp.mask.sum(), s, ref_model=ref)
    want = _hand_kl(policy, ref, exp, kind, t)
    assert abs(want) > 1e-4  # policy != reference: the term is not trivially 0
    assert float(stats["kl_loss"]) == pytest.approx(want, rel=1e-4, abs=1e-6)
    # and it entered the loss with the coefficient: the same call without the term differs by 0.5 * KL
    base, _ = _micro_loss(policy, vh, exp, idx, exp.mask.sum(), UpdateSettings(1, 1, 1, 0.2, 0.2, 0.0, 0.0, 1.0))
    assert float((loss - base).detach()) == pytest.approx(0.5 * want, rel=1e-4, abs=1e-6)


def test_exact_kl_in_loss_without_reference_is_one_line(models):
    from refit.core.errors import RefitError

    policy, ref, vh = models
    exp = _experience(policy, ref, 1.0)
    s = UpdateSettings(1, 1, 1, 0.2, 0.2, 0.0, 0.0, 1.0, kl_coef=0.5, kl_in_loss=True, kl_estimator="exact")
    with pytest.raises(RefitError, match="needs ref_model"):
        _micro_loss(policy, vh, exp, torch.arange(B), exp.mask.sum(), s)


def _bf16_update(policy, vh, exp, autocast: bool) -> tuple[dict, list[torch.dtype]]:
    seen = []
    hook = policy.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    policy, vh = copy.deepcopy(policy), copy.deepcopy(vh)
    opt = torch.optim.SGD(list(policy.parameters()) + list(vh.parameters()), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    s = UpdateSettings(1, 1, 1, 0.2, 0.2, 0.1, 0.0, 1e9, autocast_bf16=autocast)
    stats = ppo_update(policy, vh, opt, sched, exp, s, torch.Generator().manual_seed(0))
    hook.remove()
    return stats, seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_autocast_runs_the_forward_in_bf16_and_matches_fp32(models, device):
    """bf16 autocast on the learner's device: the lm_head computes in bf16, the loss stays within bf16
    precision of the fp32 update. CPU autocast is in every torch build; CUDA needs a bf16-capable GPU."""
    if device == "cuda" and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        pytest.skip("no CUDA device with bf16 here")
    policy, ref, vh = models
    exp = _experience(policy, ref, 1.0)
    policy, vh = copy.deepcopy(policy).to(device), copy.deepcopy(vh).to(device)
    fp32, seen32 = _bf16_update(policy, vh, exp, autocast=False)
    bf16, seen16 = _bf16_update(policy, vh, exp, autocast=True)
    assert set(seen32) == {torch.float32} and set(seen16) == {torch.bfloat16}
    assert bf16["pg_loss"] == pytest.approx(fp32["pg_loss"], rel=5e-2, abs=2e-2)
    assert bf16["approx_kl"] == pytest.approx(fp32["approx_kl"], abs=5e-2)


def test_tis_warning_fires_once_on_a_planted_top_k_case(model_dirs, engine_dirs, tmp_path):
    """top_k=5 on a tiny random policy: the sampler's probabilities dwarf the policy's, the mean TIS weight
    (the policy gradient's scale) is far below 1; one warning line, logged as mismatch/tis_grad_scale."""
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import setup, train_step

    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                    output_dir=str(tmp_path), steps=2, batch_size=4, num_generations=1, num_mini_batches=1,
                    num_ppo_epochs=1, response_length=4, probe_size=2, progress=False, tensorboard=False,
                    plots=False, num_prompts=16, max_operand=9, top_k=5, mismatch_correction="tis")
    run = setup(cfg, resume=False, log=lambda *_: None)
    lines = []
    m1 = train_step(run, 1, log=lines.append)
    m2 = train_step(run, 2, log=lines.append)
    run.engine.close()
    assert m1["mismatch/tis_grad_scale"] < 0.5 and m2["mismatch/tis_grad_scale"] < 0.5
    assert m1["mismatch/tis_grad_scale"] == pytest.approx(m1["ppo/is_weights_mean"], rel=1e-4)  # one minibatch
    warned = [ln for ln in lines if "tis_warn_below" in ln]
    assert len(warned) == 1 and "top_k=5" in warned[0] and "step 1" in warned[0]


def _ppo_run(model_dirs, engine_dirs, tmp_path, single: bool, critic: bool = True):
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import setup

    extra = {} if critic else dict(advantage_estimator="rloo", num_generations=2)
    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                              output_dir=str(tmp_path / f"single-{single}"), steps=2, batch_size=4,
                              num_mini_batches=1, num_ppo_epochs=1, response_length=6, probe_size=2,
                              progress=False, tensorboard=False, plots=False, num_prompts=16, max_operand=9,
                              learning_rate=1e-3, single_pass=single, **({"num_generations": 1} | extra))
    return setup(cfg, resume=False, log=lambda *_: None)


@pytest.mark.parametrize("critic", [True, False], ids=["gae", "rloo"])
def test_single_pass_equals_separate_scoring_forward(model_dirs, engine_dirs, tmp_path, critic):
    """One epoch, one minibatch: the update's forward also gives the old log-probs, values and entropy. The
    step's metrics and the updated weights equal those of the two-forward path (a separate no-grad scoring
    forward in chunks, then the update's forward) up to float summation order; one policy forward fewer."""
    from refit.learner.ppo.cycle import train_step

    results = {}
    for single in (False, True):
        run = _ppo_run(model_dirs, engine_dirs, tmp_path, single, critic)
        calls = []
        hook = run.policy.register_forward_hook(lambda *_: calls.append(1))
        m = train_step(run, 1, log=lambda *_: None)
        hook.remove()
        run.engine.close()
        if run.ref_engine is not None:
            run.ref_engine.close()
        results[single] = (m, [p.detach().clone() for p in run.policy.parameters()], len(calls))
    (m2, p2, n2), (m1, p1, n1) = results[False], results[True]
    assert n1 == n2 - 1  # the probe after the push forwards the policy once on both paths
    for key in ("kl/k1", "kl/exact", "ppo/pg_loss", "ppo/approx_kl", "ppo/clipfrac", "policy/entropy",
                "reward/mean") + (("ppo/vf_loss", "value/explained_variance") if critic else ()):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-6)  # old log-probs ARE the update's
    moved = max(float((b - a).abs().max()) for a, b in zip(p1, p2))
    step = max(float((a - b).abs().max()) for a, b in zip(p1, [p.detach() for p in load_model(
        model_dirs["tiny-gpt2"]).parameters()]))
    assert step > 1e-4 and moved < 1e-3 * step  # both paths took the same (non-zero) step


def test_precomputed_forward_needs_single_pass_settings(models):
    policy, ref, vh = models
    exp = _experience(policy, ref, 1.0)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    s = UpdateSettings(2, 1, 1, 0.2, 0.2, 0.1, 0.0, 1e9)
    from types import SimpleNamespace

    from refit.learner.ppo.update import policy_forward

    rows = SimpleNamespace(prompt_ids=exp.prompt_ids, prompt_mask=exp.prompt_mask, response_ids=exp.response_ids,
                           is_seq2seq=False, sampling=SimpleNamespace(temperature=1.0))
    fwd = policy_forward(policy, vh, rows, s)
    with pytest.raises(RefitError, match="single_pass"):
        ppo_update(policy, vh, opt, sched, exp, s, torch.Generator().manual_seed(0), forward=fwd)
