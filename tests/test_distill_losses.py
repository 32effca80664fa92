"""Tests for refit/learner/losses/distill.py against F.kl_div, explicit-sum references and hand cases."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from refit.learner.losses import (
    forward_kl_loss,
    generalized_jsd_loss,
    reverse_kl_loss,
    teacher_token_ce_loss,
    topk_kl_loss,
)
from refit.learner.losses import exact_kl_from_logits, masked_mean

D64 = torch.float64
B, T, V = 3, 7, 11
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(seed: int, shape=(B, T, V), scale: float = 2.0, grad: bool = False) -> torch.Tensor:
    x = scale * torch.randn(*shape, generator=_gen(seed), dtype=D64)
    return x.requires_grad_(grad)


def _mask() -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor([7, 4, 1])[:, None]).to(D64)


def _kl_explicit(p_logits, q_logits):
    """KL(p || q) per token by explicit probability sums, (B, T)."""
    p = p_logits.softmax(-1)
    return (p * (p.log() - q_logits.log_softmax(-1))).sum(-1)


def _jsd_explicit(student, teacher, beta):
    """GKD generalized JSD with P = teacher, Q = student, M = beta P + (1 - beta) Q, via probabilities."""
    p, q = teacher.softmax(-1), student.softmax(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)


def _topk(teacher_logits, k):
    t_lp = teacher_logits.log_softmax(-1)
    vals, ids = t_lp.topk(k, dim=-1)
    return vals, ids


# --------------------------------------------------------------------------- generalized JSD


@pytest.mark.parametrize("beta, wrapper, stat", [(0.0, forward_kl_loss, "forward_kl"),
                                                   (1.0, reverse_kl_loss, "reverse_kl")])
def test_jsd_at_beta_0_and_1_is_forward_and_reverse_kl_matching_f_kl_div(beta, wrapper, stat):
    """beta 0: KL(teacher || student); beta 1: KL(student || teacher); each equal to its named wrapper."""
    s, t, mask = _logits(0), _logits(1), _mask()
    loss, stats = generalized_jsd_loss(s, t, mask, beta=beta)
    p, q = (t, s) if beta == 0.0 else (s, t)  # KL(p || q)
    per_tok = F.kl_div(q.log_softmax(-1), p.log_softmax(-1), reduction="none", log_target=True).sum(-1)
    assert_close(loss, masked_mean(per_tok, mask), rtol=0, atol=1e-12)
    assert_close(loss, masked_mean(_kl_explicit(p, q), mask), rtol=0, atol=1e-12)
    assert_close(stats["jsd"], loss.detach())
    named, named_stats = wrapper(s, t, mask)
    assert_close(named, loss, rtol=0, atol=0)
    assert set(named_stats) == {stat}


def test_forward_kl_hand_case():
    # teacher p = [0.5, 0.5], student q = [0.75, 0.25]: KL(p || q) = 0.5 ln(4/3) = 0.143841...
    student = torch.tensor([[[math.log(3.0), 0.0]]], dtype=D64)
    teacher = torch.tensor([[[0.0, 0.0]]], dtype=D64)
    loss, _ = forward_kl_loss(student, teacher)
    assert_close(loss, torch.tensor(0.5 * math.log(4.0 / 3.0), dtype=D64), rtol=0, atol=1e-12)
    # reverse: KL(q || p) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.130812...
    loss, _ = reverse_kl_loss(student, teacher)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert_close(loss, torch.tensor(expected, dtype=D64), rtol=0, atol=1e-12)
    # JSD(0.5): M = [0.625, 0.375]
    m = [0.625, 0.375]
    jsd = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    jsd += 0.5 * (0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1]))
    loss, _ = generalized_jsd_loss(student, teacher, beta=0.5)
    assert_close(loss, torch.tensor(jsd, dtype=D64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_interior_matches_explicit_probability_reference(beta):
    s, t, mask = _logits(4), _logits(5), _mask()
    loss, _ = generalized_jsd_loss(s, t, mask, beta=beta)
    assert_close(loss, masked_mean(_jsd_explicit(s, t, beta), mask), rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_zero_on_identical_inputs_and_nonnegative(beta):
    s, mask = _logits(6), _mask()
    loss, _ = generalized_jsd_loss(s, s.clone(), mask, beta=beta)
    assert_close(loss, torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-12)
    loss, _ = generalized_jsd_loss(s, _logits(7), mask, beta=beta)
    assert loss > 0


def test_jsd_symmetry():
    s, t, mask = _logits(8), _logits(9), _mask()
    a, _ = generalized_jsd_loss(s, t, mask, beta=0.5)
    b, _ = generalized_jsd_loss(t, s, mask, beta=0.5)
    assert_close(a, b, rtol=0, atol=1e-12)
    assert a <= math.log(2.0)  # JSD(0.5) is bounded by ln 2
    for beta in BETAS:  # JSD_beta(s, t) == JSD_{1-beta}(t, s), endpoints included
        a, _ = generalized_jsd_loss(s, t, mask, beta=beta)
        b, _ = generalized_jsd_loss(t, s, mask, beta=1.0 - beta)
        assert_close(a, b, rtol=0, atol=1e-12)


def test_jsd_interior_tends_to_scaled_kls_near_endpoints():
    s, t, mask = _logits(10), _logits(11), _mask()
    fwd, _ = forward_kl_loss(s, t, mask)
    rev, _ = reverse_kl_loss(s, t, mask)
    eps = 1e-6
    near0, _ = generalized_jsd_loss(s, t, mask, beta=eps)
    near1, _ = generalized_jsd_loss(s, t, mask, beta=1 - eps)
    assert_close(near0 / eps, fwd, rtol=1e-3, atol=0)
    assert_close(near1 / eps, rev, rtol=1e-3, atol=0)


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_chunked_equals_unchunked_values_and_grads(beta):
    t, mask = _logits(13), _mask()
    s = _logits(12, grad=True)
    ref, _ = generalized_jsd_loss(s, t, mask, beta=beta)
    (g_ref,) = torch.autograd.grad(ref, s)
    for chunk in (1, 2, 3, 7):
        out, _ = generalized_jsd_loss(s, t, mask, beta=beta, chunk_size=chunk)
        (g,) = torch.autograd.grad(out, s)
        assert_close(out, ref, rtol=0, atol=1e-12)
        assert_close(g, g_ref, rtol=0, atol=1e-12)
    with torch.no_grad():
        out, _ = generalized_jsd_loss(s, t, mask, beta=beta, chunk_size=2)
    assert_close(out, ref.detach(), rtol=0, atol=1e-12)


def test_jsd_temperature_and_default_mask():
    s, t = _logits(14), _logits(15)
    a, _ = generalized_jsd_loss(s, t, beta=0.3, temperature=2.0)
    b, _ = generalized_jsd_loss(s / 2.0, t / 2.0, beta=0.3)
    assert_close(a, b, rtol=0, atol=1e-12)
    full, _ = generalized_jsd_loss(s, t, torch.ones(B, T, dtype=torch.bool), beta=0.3)
    none, _ = generalized_jsd_loss(s, t, None, beta=0.3)
    assert_close(full, none, rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        generalized_jsd_loss(s, t, beta=1.5)


def test_jsd_microbatch_sum_equals_full_batch_mean():
    s, t, mask = _logits(16, grad=True), _logits(17), _mask()
    full, _ = generalized_jsd_loss(s, t, mask, beta=0.5)
    (g_full,) = torch.autograd.grad(full, s)
    n = mask.sum()
    parts = [generalized_jsd_loss(s[i : i + 1], t[i : i + 1], mask[i : i + 1], 0.5, num_tokens=n)[0] for i in range(B)]
    total = sum(parts)
    (g_split,) = torch.autograd.grad(total, s)
    assert_close(total, full, rtol=0, atol=1e-12)
    assert_close(g_split, g_full, rtol=0, atol=1e-12)


def test_stats_are_detached():
    s, t, mask = _logits(18, grad=True), _logits(19), _mask()
    vals, ids = _topk(t, 4)
    results = [
        generalized_jsd_loss(s, t, mask, 0.5)[1],
        forward_kl_loss(s, t, mask)[1],
        reverse_kl_loss(s, t, mask)[1],
        teacher_token_ce_loss(s, ids[..., 0], mask)[1],
        topk_kl_loss(s, vals, ids, mask)[1],
    ]
    for stats in results:
        for key, value in stats.items():
            assert not value.requires_grad and value.grad_fn is None, key


# --------------------------------------------------------------------------- sequence-level KD


def test_teacher_token_ce_hand_case_and_cross_entropy_reference():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 0.0]]], dtype=D64)
    ids = torch.tensor([[1, 1]])
    mask = torch.tensor([[1.0, 0.0]], dtype=D64)
    loss, stats = teacher_token_ce_loss(logits, ids, mask)
    assert_close(loss, torch.tensor(-math.log(0.75), dtype=D64), rtol=0, atol=1e-12)  # 0.287682...
    assert_close(stats["teacher_token_acc"], torch.tensor(1.0, dtype=D64), rtol=0, atol=0)

    s, mask = _logits(20, grad=True), _mask()
    ids = torch.randint(0, V, (B, T), generator=_gen(21))
    labels = torch.where(mask > 0, ids, torch.full_like(ids, -100))
    for temp in (1.0, 1.7):
        loss, _ = teacher_token_ce_loss(s, ids, mask, temperature=temp)
        ref = F.cross_entropy((s / temp).reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        assert_close(loss, ref, rtol=0, atol=1e-12)
        chunked, _ = teacher_token_ce_loss(s, ids, mask, temperature=temp, chunk_size=3)
        assert_close(chunked, ref, rtol=0, atol=1e-12)
        g1, g2 = torch.autograd.grad(loss, s)[0], torch.autograd.grad(chunked, s)[0]
        assert_close(g1, g2, rtol=0, atol=1e-12)
    _, stats = teacher_token_ce_loss(s, s.argmax(-1), mask)
    assert_close(stats["teacher_token_acc"], torch.tensor(1.0, dtype=D64), rtol=0, atol=0)


# --------------------------------------------------------------------------- top-k KL


def test_topk_kl_hand_case():
    # teacher p = [0.5, 0.3, 0.2], student q = [0.25, 0.25, 0.5], k = 1 (id 0):
    # KL = 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 ln(4/3) = 0.143841...
    student = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]], dtype=D64))
    t_lp = torch.tensor([[[math.log(0.5)]]], dtype=D64)
    ids = torch.tensor([[[0]]])
    mask = torch.ones(1, 1, dtype=D64)
    loss, stats = topk_kl_loss(student, t_lp, ids, mask)
    assert_close(loss, torch.tensor(0.5 * math.log(4.0 / 3.0), dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["teacher_tail_mass"], torch.tensor(0.5, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["student_tail_mass"], torch.tensor(0.75, dtype=D64), rtol=0, atol=1e-12)


def test_topk_kl_equals_full_kl_when_k_equals_vocab():
    s, t, mask = _logits(22), _logits(23), _mask()
    t_lp = t.log_softmax(-1)
    perm = torch.stack([torch.randperm(V, generator=_gen(24 + i)) for i in range(B * T)]).reshape(B, T, V)
    loss, stats = topk_kl_loss(s, t_lp.gather(-1, perm), perm, mask)
    full = masked_mean(exact_kl_from_logits(t, s), mask)  # KL(teacher || student)
    assert_close(loss, full, rtol=0, atol=1e-10)
    fwd, _ = forward_kl_loss(s, t, mask)
    assert_close(loss, fwd, rtol=0, atol=1e-10)
    assert_close(stats["teacher_tail_mass"], torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3, 6, 10])
def test_topk_kl_nonnegative_and_bounded_by_full_kl(k):
    mask = _mask()
    for seed in range(5):
        s, t = _logits(100 + seed, scale=3.0), _logits(200 + seed, scale=3.0)
        vals, ids = _topk(t, k)
        out, _ = topk_kl_loss(s, vals, ids, mask)
        full = masked_mean(_kl_explicit(t, s), mask)
        assert 0.0 <= out <= full + 1e-12
    # float32 inputs too (clamp against rounding keeps it >= 0)
    s32, t32 = _logits(300).float(), _logits(301).float()
    vals, ids = _topk(t32, k)
    out32, _ = topk_kl_loss(s32, vals, ids, mask.float())
    assert out32 >= 0


def test_topk_kl_zero_on_identical_distributions():
    s, mask = _logits(25), _mask()
    vals, ids = _topk(s, 4)
    loss, stats = topk_kl_loss(s, vals, ids, mask)
    assert_close(loss, torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-12)
    assert_close(stats["teacher_tail_mass"], stats["student_tail_mass"], rtol=0, atol=1e-12)


def test_topk_kl_neg_inf_padding_equals_smaller_k_with_finite_grads():
    s, t, mask = _logits(26, grad=True), _logits(27), _mask()
    vals, ids = _topk(t, 3)
    vals_pad = torch.cat([vals[..., :2], torch.full_like(vals[..., :1], float("-inf"))], dim=-1)
    padded, _ = topk_kl_loss(s, vals_pad, ids, mask)
    small, _ = topk_kl_loss(s, vals[..., :2], ids[..., :2], mask)
    assert_close(padded, small, rtol=0, atol=1e-12)
    all_pad = torch.full_like(vals, float("-inf"))
    loss, _ = topk_kl_loss(s, all_pad, ids, mask)  # everything is tail: both tails are 1 -> KL 0
    (g,) = torch.autograd.grad(padded + loss, s)
    assert torch.isfinite(g).all()
    assert_close(loss, torch.tensor(0.0, dtype=D64), rtol=0, atol=1e-12)


def test_topk_kl_chunked_temperature_microbatch():
    s, t, mask = _logits(28, grad=True), _logits(29), _mask()
    vals, ids = _topk(t, 4)
    ref, _ = topk_kl_loss(s, vals, ids, mask)
    (g_ref,) = torch.autograd.grad(ref, s)
    for chunk in (1, 3, 7):
        out, stats = topk_kl_loss(s, vals, ids, mask, chunk_size=chunk)
        (g,) = torch.autograd.grad(out, s)
        assert_close(out, ref, rtol=0, atol=1e-12)
        assert_close(g, g_ref, rtol=0, atol=1e-12)
    # temperature applies to the student logits only
    a, _ = topk_kl_loss(s, vals, ids, mask, temperature=2.0)
    b, _ = topk_kl_loss(s / 2.0, vals, ids, mask)
    assert_close(a, b, rtol=0, atol=1e-12)
    n = mask.sum()
    total = sum(
        topk_kl_loss(s[i : i + 1], vals[i : i + 1], ids[i : i + 1], mask[i : i + 1], num_tokens=n)[0] for i in range(B)
    )
    assert_close(total, ref, rtol=0, atol=1e-12)
