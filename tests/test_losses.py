"""Tests for refit/learner/losses/ against hand computations and independent references."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from refit.learner.losses import (
    adaptive_kl_update,
    chunked_apply,
    compute_gae,
    entropy_from_logits,
    exact_kl_from_logits,
    explained_variance,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    logprob_mismatch_stats,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    sequence_mismatch_mask,
    token_mean,
    truncated_importance_weights,
)

D64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _right_padded_mask(lengths, T, dtype=torch.float32):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)


def _assert_detached(stats):
    for name, value in stats.items():
        assert isinstance(value, torch.Tensor), name
        assert not value.requires_grad, name
        assert value.grad_fn is None, name


# --------------------------------------------------------------------------- masked reductions


def test_masked_mean_hand_case():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert_close(masked_mean(x, mask), torch.tensor(7.0 / 3.0, dtype=D64), rtol=0, atol=1e-12)
    assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0], dtype=D64), rtol=0, atol=1e-12)
    assert_close(masked_sum(x, mask), torch.tensor(7.0, dtype=D64), rtol=0, atol=0)


def test_masked_mean_padding_does_not_leak_and_empty_mask_is_zero():
    x = torch.tensor([[1.0, float("inf"), float("nan")]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    assert_close(masked_mean(x, mask), torch.tensor(1.0), rtol=0, atol=0)
    assert_close(masked_mean(x, torch.zeros_like(mask)), torch.tensor(0.0), rtol=0, atol=0)
    assert_close(masked_mean(x, torch.tensor([[1.0, 0.0, 0.0]]), dim=1), torch.tensor([1.0]), rtol=0, atol=0)


def test_masked_var_hand_case():
    # valid values 1, 2, 4: mean 7/3, sum of squared deviations 16/9 + 1/9 + 25/9 = 42/9
    x = torch.tensor([[1.0, 2.0, 99.0], [4.0, -7.0, 3.0]], dtype=D64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=D64)
    assert_close(masked_var(x, mask, unbiased=False), torch.tensor(14.0 / 9.0, dtype=D64), rtol=0, atol=1e-12)
    assert_close(masked_var(x, mask), torch.tensor(7.0 / 3.0, dtype=D64), rtol=0, atol=1e-12)


def test_masked_var_unbiased_needs_two_tokens():
    with pytest.raises(ValueError):
        masked_var(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]))


def test_masked_whiten_mean0_var1_on_masked_entries():
    x = 3.0 + 5.0 * torch.randn(4, 9, generator=_gen(1), dtype=D64)
    mask = _right_padded_mask([9, 5, 2, 7], 9, D64)
    x = torch.where(mask > 0, x, torch.full_like(x, 1e6))  # padding garbage must not matter
    w = masked_whiten(x, mask)
    assert_close(masked_mean(w, mask), torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-10)
    assert_close(masked_var(w, mask), torch.tensor(1.0, dtype=D64), rtol=0, atol=1e-6)
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert_close(masked_mean(w2, mask), masked_mean(x, mask), rtol=0, atol=1e-9)
    assert_close(masked_var(w2, mask), torch.tensor(1.0, dtype=D64), rtol=0, atol=1e-6)


def test_token_mean_microbatch_sum_equals_full_batch_mean():
    x = torch.randn(4, 6, generator=_gen(2), dtype=D64)
    mask = _right_padded_mask([6, 1, 3, 5], 6, D64)
    full = masked_mean(x, mask)
    n = mask.sum()
    parts = [token_mean(x[s], mask[s], num_tokens=n) for s in (slice(0, 1), slice(1, 2), slice(2, 4))]
    assert_close(sum(parts), full, rtol=0, atol=1e-12)
    naive = sum(masked_mean(x[s], mask[s]) for s in (slice(0, 1), slice(1, 2), slice(2, 4))) / 3
    assert not torch.allclose(naive, full)  # averaging micro-batch means is not the token mean


def test_chunked_apply_matches_and_checkpoints_gradients():
    x = torch.randn(2, 7, 5, generator=_gen(3), dtype=D64, requires_grad=True)
    fn = lambda z: (z.softmax(-1) * z).sum(-1)  # noqa: E731
    ref = fn(x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    for chunk in (1, 3, 7, 100):
        out = chunked_apply(fn, [x], chunk)
        (g,) = torch.autograd.grad(out.sum(), x)
        assert_close(out, ref, rtol=0, atol=1e-12)
        assert_close(g, g_ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        chunked_apply(fn, [x], 0)


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_case():
    logp = torch.tensor([math.log(0.5)], dtype=D64)
    ref = torch.tensor([math.log(0.25)], dtype=D64)
    ln2 = math.log(2.0)
    assert_close(kl_k1(logp, ref), torch.tensor([ln2], dtype=D64), rtol=0, atol=1e-12)  # 0.693147...
    assert_close(kl_k2(logp, ref), torch.tensor([0.5 * ln2**2], dtype=D64), rtol=0, atol=1e-12)  # 0.240227...
    # r = ref - logp = -ln 2: exp(r) - r - 1 = 0.5 + ln 2 - 1 = 0.193147...
    assert_close(kl_k3(logp, ref), torch.tensor([0.5 + ln2 - 1.0], dtype=D64), rtol=0, atol=1e-12)
    for kind, fn in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        assert_close(kl_estimate(logp, ref, kind), fn(logp, ref), rtol=0, atol=0)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_exactly_zero_on_identical_inputs():
    logp = torch.log_softmax(torch.randn(3, 5, 7, generator=_gen(4)), -1)[..., 0]
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(logp, logp.clone(), kind), torch.zeros_like(logp))


def test_k2_k3_nonnegative_and_k1_k3_unbiased_monte_carlo():
    g = _gen(5)
    p_logits, q_logits = torch.randn(6, generator=g, dtype=D64), torch.randn(6, generator=g, dtype=D64)
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    true_kl = float((logp.exp() * (logp - logq)).sum())
    x = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    lp, lq = logp[x], logq[x]
    assert (kl_k2(lp, lq) >= 0).all() and (kl_k3(lp, lq) >= 0).all()
    for kind in ("k1", "k3"):
        est = kl_estimate(lp, lq, kind)
        stderr = float(est.std()) / math.sqrt(est.numel())
        assert abs(float(est.mean()) - true_kl) < 5 * stderr + 1e-9, kind


# --------------------------------------------------------------------------- log-probs, entropy, exact KL


def test_logprobs_from_logits_hand_and_reference():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=D64)
    assert_close(logprobs_from_logits(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.75)]], dtype=D64))
    g = _gen(6)
    logits = torch.randn(2, 4, 9, generator=g, dtype=D64)
    labels = torch.randint(0, 9, (2, 4), generator=g)
    for temp in (1.0, 0.7):
        out = logprobs_from_logits(logits, labels, temperature=temp)
        for b in range(2):
            for t in range(4):
                ref = torch.log_softmax(logits[b, t] / temp, -1)[labels[b, t]]
                assert_close(out[b, t], ref, rtol=0, atol=1e-12)


def test_entropy_from_logits():
    V = 8
    assert_close(entropy_from_logits(torch.zeros(2, 3, V, dtype=D64)), torch.full((2, 3), math.log(V), dtype=D64))
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=D64)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 0.562335...
    assert_close(entropy_from_logits(logits), torch.tensor([[expected]], dtype=D64), rtol=0, atol=1e-12)
    x = torch.randn(2, 5, 7, generator=_gen(7), dtype=D64)
    ref = -(x.softmax(-1) * x.log_softmax(-1)).sum(-1)
    assert_close(entropy_from_logits(x), ref, rtol=0, atol=1e-12)
    assert_close(entropy_from_logits(x, chunk_size=2), ref, rtol=0, atol=1e-12)
    assert_close(entropy_from_logits(x, temperature=2.0), entropy_from_logits(x / 2.0), rtol=0, atol=1e-12)


def test_exact_kl_hand_case():
    # p = [0.5, 0.5], q = [0.75, 0.25]: KL = 0.5 ln(2/3) + 0.5 ln 2 = 0.5 ln(4/3) = 0.143841...
    logits = torch.tensor([[[0.0, 0.0]]], dtype=D64)
    ref_logits = torch.tensor([[[math.log(3.0), 0.0]]], dtype=D64)
    out = exact_kl_from_logits(logits, ref_logits)
    assert_close(out, torch.tensor([[0.5 * math.log(4.0 / 3.0)]], dtype=D64), rtol=0, atol=1e-12)


def test_exact_kl_reference_nonneg_zero_mask_temperature_chunks():
    g = _gen(8)
    logits = torch.randn(3, 7, 11, generator=g, dtype=D64, requires_grad=True)
    ref_logits = torch.randn(3, 7, 11, generator=g, dtype=D64)
    mask = _right_padded_mask([7, 4, 1], 7, D64)
    ref = F.kl_div(ref_logits.log_softmax(-1), logits.log_softmax(-1), reduction="none", log_target=True).sum(-1)
    out = exact_kl_from_logits(logits, ref_logits)
    assert_close(out, ref, rtol=0, atol=1e-12)
    assert (out >= 0).all()
    assert torch.equal(exact_kl_from_logits(logits, logits.detach().clone()), torch.zeros(3, 7, dtype=D64))
    masked = exact_kl_from_logits(logits, ref_logits, mask=mask)
    assert_close(masked, ref * mask, rtol=0, atol=1e-12)
    assert_close(
        exact_kl_from_logits(logits, ref_logits, temperature=2.0),
        exact_kl_from_logits(logits / 2.0, ref_logits / 2.0),
        rtol=0,
        atol=1e-12,
    )
    (g_ref,) = torch.autograd.grad(masked_mean(out, mask), logits)
    for chunk in (1, 3, 5):
        chunked = exact_kl_from_logits(logits, ref_logits, chunk_size=chunk)
        assert_close(chunked, out, rtol=0, atol=1e-12)
        (g_chunk,) = torch.autograd.grad(masked_mean(chunked, mask), logits)
        assert_close(g_chunk, g_ref, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- GAE


def _gae_reference(rewards, values, lengths, gamma, lam):
    """Plain-Python GAE over each response's valid prefix; terminal after the last valid token."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        last = 0.0
        for t in reversed(range(lengths[b])):
            next_v = values[b][t + 1] if t + 1 < lengths[b] else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + values[b][t]
    return adv, ret


def test_gae_hand_case():
    rewards = torch.tensor([[0.0, 1.0]], dtype=D64)
    values = torch.tensor([[0.5, 0.2]], dtype=D64)
    mask = torch.ones(1, 2, dtype=D64)
    # gamma = lam = 1: delta_1 = 1 - 0.2 = 0.8, delta_0 = 0.2 - 0.5 = -0.3, A = [0.5, 0.8]
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(adv, torch.tensor([[0.5, 0.8]], dtype=D64), rtol=0, atol=1e-12)
    assert_close(ret, torch.tensor([[1.0, 1.0]], dtype=D64), rtol=0, atol=1e-12)
    # gamma = 0.9, lam = 0.95: delta_0 = 0.9 * 0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.855 * 0.8 = 0.364
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.95)
    assert_close(adv, torch.tensor([[0.364, 0.8]], dtype=D64), rtol=0, atol=1e-12)
    assert_close(ret, torch.tensor([[0.864, 1.0]], dtype=D64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)])
def test_gae_matches_python_loop_and_padding_does_not_leak(gamma, lam):
    g = _gen(9)
    B, T, lengths = 4, 8, [8, 3, 1, 6]
    mask = _right_padded_mask(lengths, T, D64)
    rewards = torch.randn(B, T, generator=g, dtype=D64)
    values = torch.randn(B, T, generator=g, dtype=D64)
    garbage = torch.full((B, T), 1e3, dtype=D64)
    rewards_p = torch.where(mask > 0, rewards, garbage)
    values_p = torch.where(mask > 0, values, -garbage)
    adv, ret = compute_gae(rewards_p, values_p, mask, gamma, lam)
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    assert_close(adv, torch.tensor(ref_adv, dtype=D64), rtol=0, atol=1e-10)
    assert_close(ret, torch.tensor(ref_ret, dtype=D64), rtol=0, atol=1e-10)


def test_gae_gamma_lam_one_returns_are_reward_to_go():
    rewards = torch.randn(2, 5, generator=_gen(10), dtype=D64)
    values = torch.randn(2, 5, generator=_gen(11), dtype=D64)
    mask = _right_padded_mask([5, 3], 5, D64)
    _, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    r = rewards * mask
    to_go = r.flip(1).cumsum(1).flip(1) * mask
    assert_close(ret, to_go, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- PPO losses


def _ppo_hand_inputs():
    # cliprange 0.2; a 7th, masked token holds garbage.
    ratios = [1.1, 1.5, 0.5, 0.5, 1.5, 0.9, 100.0]
    adv = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1e6]
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=D64, requires_grad=True)
    old = torch.zeros(1, 7, dtype=D64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=D64)
    return logprobs, old, torch.tensor([adv], dtype=D64), mask, ratios[:6]


def test_ppo_policy_loss_hand_clip_cases():
    logprobs, old, adv, mask, ratios = _ppo_hand_inputs()
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r)):
    #  A=+1 r=1.1 inside -> -1.1 | A=+1 r=1.5 above -> -1.2 (clipped) | A=+1 r=0.5 below -> -0.5 (unclipped)
    #  A=-1 r=0.5 below -> 0.8 (clipped) | A=-1 r=1.5 above -> 1.5 (unclipped) | A=-1 r=0.9 inside -> 0.9
    per_token = [-1.1, -1.2, -0.5, 0.8, 1.5, 0.9]
    assert_close(loss, torch.tensor(sum(per_token) / 6, dtype=D64), rtol=0, atol=1e-12)  # 0.0666...
    assert_close(stats["pg_loss"], loss.detach())
    assert_close(stats["clipfrac"], torch.tensor(2 / 6, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["ratio_mean"], torch.tensor(1.0, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["ratio_max"], torch.tensor(1.5, dtype=D64), rtol=0, atol=1e-12)
    logs = [math.log(r) for r in ratios]
    assert_close(stats["approx_kl"], torch.tensor(0.5 * sum(x * x for x in logs) / 6, dtype=D64), rtol=0, atol=1e-12)
    k3 = sum(r - 1 - math.log(r) for r in ratios) / 6
    assert_close(stats["approx_kl_k3"], torch.tensor(k3, dtype=D64), rtol=0, atol=1e-12)
    _assert_detached(stats)
    # gradient d/dlogp of -A r is -A r on unclipped tokens, 0 on clipped ones and on padding
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = torch.tensor([[-1.1, 0.0, -0.5, 0.0, 1.5, 0.9, 0.0]], dtype=D64) / 6
    assert_close(grad, expected, rtol=0, atol=1e-12)


def test_ppo_policy_loss_is_weights_and_identical_logprobs():
    logprobs, old, adv, mask, _ = _ppo_hand_inputs()
    w = torch.tensor([[2.0, 1.0, 0.0, 1.0, 0.5, 1.0, 7.0]], dtype=D64)
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, 0.2, is_weights=w)
    expected = (2 * -1.1 - 1.2 + 0.0 + 0.8 + 0.5 * 1.5 + 0.9) / 6
    assert_close(loss, torch.tensor(expected, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["is_weights_mean"], torch.tensor(5.5 / 6, dtype=D64), rtol=0, atol=1e-12)
    _assert_detached(stats)
    # identical new/old log-probs: ratio 1, no clipping, zero KL, loss = -mean(A)
    lp = old.clone().requires_grad_(True)
    adv = adv + 0.5  # valid advantages 1.5, 1.5, 1.5, -0.5, -0.5, -0.5 -> mean 0.5
    loss, stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    assert_close(loss, torch.tensor(-0.5, dtype=D64), rtol=0, atol=1e-12)
    for key in ("clipfrac", "approx_kl", "approx_kl_k3"):
        assert_close(stats[key], torch.tensor(0.0, dtype=D64), rtol=0, atol=0)
    loss, _ = ppo_policy_loss(lp, old, torch.zeros_like(adv), mask, 0.2)
    assert_close(loss, torch.tensor(0.0, dtype=D64), rtol=0, atol=0)


def test_ppo_value_loss_hand_case():
    # c = 0.2, returns = 1:
    #  v=1.0 old=0.5 -> clipped v 0.7: max(0, 0.09) = 0.09 (clipped)
    #  v=0.6 old=0.5 -> 0.6 inside: 0.16
    #  v=0.0 old=0.5 -> clipped v 0.3: max(1.0, 0.49) = 1.0
    values = torch.tensor([[1.0, 0.6, 0.0, 50.0]], dtype=D64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, -50.0]], dtype=D64)
    returns = torch.tensor([[1.0, 1.0, 1.0, 9.0]], dtype=D64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert_close(loss, torch.tensor(0.5 * 1.25 / 3, dtype=D64), rtol=0, atol=1e-12)  # 0.208333...
    assert_close(stats["vf_clipfrac"], torch.tensor(1 / 3, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["vf_loss"], loss.detach())
    _assert_detached(stats)
    (grad,) = torch.autograd.grad(loss, values)  # clipped token gets no gradient
    assert_close(grad, torch.tensor([[0.0, -0.4, -1.0, 0.0]], dtype=D64) / 3, rtol=0, atol=1e-12)
    loss, _ = ppo_value_loss(values, old, returns, mask, cliprange_value=None)
    assert_close(loss, torch.tensor(0.5 * 1.16 / 3, dtype=D64), rtol=0, atol=1e-12)
    same, stats = ppo_value_loss(returns, returns, returns, mask, 0.2)
    assert_close(same, torch.tensor(0.0, dtype=D64), rtol=0, atol=0)
    assert_close(stats["vf_clipfrac"], torch.tensor(0.0, dtype=D64), rtol=0, atol=0)


def test_ppo_losses_microbatch_split_matches_full_batch():
    g = _gen(12)
    B, T = 5, 6
    mask = _right_padded_mask([6, 2, 5, 1, 4], T, D64)
    logprobs = (0.1 * torch.randn(B, T, generator=g, dtype=D64)).requires_grad_(True)
    old = 0.1 * torch.randn(B, T, generator=g, dtype=D64)
    adv = torch.randn(B, T, generator=g, dtype=D64)
    values = torch.randn(B, T, generator=g, dtype=D64, requires_grad=True)
    returns = torch.randn(B, T, generator=g, dtype=D64)
    full_pg, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    full_vf, _ = ppo_value_loss(values, old, returns, mask, 0.2)
    g_full = torch.autograd.grad(full_pg + full_vf, [logprobs, values])
    n = mask.sum()
    total = 0.0
    for s in (slice(0, 2), slice(2, 3), slice(3, 5)):
        pg, _ = ppo_policy_loss(logprobs[s], old[s], adv[s], mask[s], 0.2, num_tokens=n)
        vf, _ = ppo_value_loss(values[s], old[s], returns[s], mask[s], 0.2, num_tokens=n)
        total = total + pg + vf
    g_split = torch.autograd.grad(total, [logprobs, values])
    assert_close(total, full_pg + full_vf, rtol=0, atol=1e-12)
    for a, b in zip(g_split, g_full):
        assert_close(a, b, rtol=0, atol=1e-12)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, 0.0, 0.0]], dtype=D64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=D64)
    assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0, dtype=D64), rtol=0, atol=1e-12)
    const = torch.full_like(returns, 7.0)
    assert_close(explained_variance(const, returns, mask), torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-12)
    # valid returns 1,2,3,4 (var 1.25); residuals [0.5, 0, -0.5, 0] (var 0.125) -> 0.9
    values = returns - torch.tensor([[0.5, 0.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D64)
    assert_close(explained_variance(values, returns, mask), torch.tensor(0.9, dtype=D64), rtol=0, atol=1e-12)
    assert torch.isnan(explained_variance(returns, torch.ones_like(returns), mask))


# --------------------------------------------------------------------------- rollout/learner mismatch


def test_logprob_mismatch_stats_hand_case():
    rollout = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D64)
    learner = torch.tensor([[-1.1, -2.0, -0.2]], dtype=D64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=D64)  # the 0.3 difference is padding
    stats = logprob_mismatch_stats(rollout, learner, mask)
    assert_close(stats["mean_abs_diff"], torch.tensor(0.05, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["max_abs_diff"], torch.tensor(0.1, dtype=D64), rtol=0, atol=1e-12)
    # (e^0.1 + e^0) / 2 = 1.0525854590...
    assert_close(stats["token_mult_prob_error"], torch.tensor(1.0525854590378239, dtype=D64), rtol=0, atol=1e-12)
    _assert_detached(stats)
    same = logprob_mismatch_stats(rollout, rollout.clone(), mask)
    assert_close(same["mean_abs_diff"], torch.tensor(0.0, dtype=D64), rtol=0, atol=0)
    assert_close(same["max_abs_diff"], torch.tensor(0.0, dtype=D64), rtol=0, atol=0)
    assert_close(same["token_mult_prob_error"], torch.tensor(1.0, dtype=D64), rtol=0, atol=0)


def test_truncated_importance_weights_capped_and_detached():
    rollout = torch.zeros(1, 4, dtype=D64)
    learner = torch.tensor([[math.log(0.5), math.log(2.0), math.log(10.0), 0.0]], dtype=D64, requires_grad=True)
    w = truncated_importance_weights(learner, rollout, cap=3.0)
    assert_close(w, torch.tensor([[0.5, 2.0, 3.0, 1.0]], dtype=D64), rtol=0, atol=1e-12)
    assert not w.requires_grad
    rand = torch.randn(3, 5, generator=_gen(13), dtype=D64)
    assert (truncated_importance_weights(rand, -rand, cap=2.0) <= 2.0).all()
    assert torch.equal(truncated_importance_weights(rand, rand, cap=2.0), torch.ones_like(rand))


def test_sequence_mismatch_mask():
    learner = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [-5.0, 0.0, 0.0]], dtype=D64)
    rollout = torch.tensor([[0.0, -1.5, 0.0], [0.1, 0.0, 9.0], [0.0, 0.0, 0.0]], dtype=D64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=D64)
    # max |diff| over valid tokens: 0.5, 0.1 (the 9.0 is padding), none -> False
    out = sequence_mismatch_mask(learner, rollout, mask, threshold=0.3)
    assert out.dtype == torch.bool and out.shape == (3,)
    assert out.tolist() == [True, False, False]
    assert sequence_mismatch_mask(learner, rollout, mask, threshold=0.5).tolist() == [False, False, False]


# --------------------------------------------------------------------------- adaptive KL


def test_adaptive_kl_update_hand_cases():
    # e = clip(6/4 - 1, -0.2, 0.2) = 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    assert adaptive_kl_update(0.1, 6.0, 4.0, 10000, 256) == pytest.approx(0.100512, abs=1e-15)
    # e = 3.6/4 - 1 = -0.1; mult = 1 - 0.1 * 256 / 10000 = 0.99744
    assert adaptive_kl_update(0.1, 3.6, 4.0, 10000, 256) == pytest.approx(0.099744, abs=1e-15)
    # e clipped at -0.2
    assert adaptive_kl_update(0.1, 0.0, 4.0, 10000, 256) == pytest.approx(0.1 * (1 - 0.2 * 0.0256), abs=1e-15)
    assert adaptive_kl_update(0.1, 4.0, 4.0, 10000, 256) == pytest.approx(0.1, abs=1e-15)
    assert isinstance(adaptive_kl_update(0.1, 6.0, 4.0, 10000, 256), float)
