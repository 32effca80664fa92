"""Token-chunked log-prob / entropy / exact KL (refit/learner/losses/chunked.py) against the plain formulas of
refit/learner/losses/common.py and a float64 hand computation: values and gradients, chunks that do not divide T."""

import math

import pytest
import torch

from refit.learner import losses as L


def _inputs(b=3, t=7, v=11, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=g, dtype=dtype)).requires_grad_()
    ref = 3 * torch.randn(b, t, v, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    return logits, ref, labels


def _reference(logits, ref, labels, temperature):
    """The unchunked formulas of refit.learner.losses.common."""
    return (L.logprobs_from_logits(logits, labels, temperature), L.entropy_from_logits(logits, temperature),
            L.exact_kl_from_logits(logits, ref, temperature=temperature))


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 100])  # 3 and 4 do not divide T = 7
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_unchunked_formulas(chunk, temperature):
    logits, ref, labels = _inputs()
    w = torch.randn(3, 3, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # weights per output
    got = L.token_stats(logits, labels, ref, temperature, chunk_size=chunk)
    (gg,) = torch.autograd.grad(sum((x * wi).sum() for x, wi in zip(got, w)), logits)
    want = _reference(logits, ref, labels, temperature)
    (gw,) = torch.autograd.grad(sum((x * wi).sum() for x, wi in zip(want, w)), logits)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gg, gw, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("used", [(0,), (0, 2), (1,), (2,), (1, 2)])  # which of (lp, H, KL) the loss takes
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_when_the_loss_leaves_outputs_out(used, temperature):
    """The backward skips the terms of outputs the loss does not use (GRPO's default logs the entropy and leaves it
    out); the gradient still equals the unchunked formulas' with the same outputs."""
    logits, ref, labels = _inputs()
    w = torch.randn(3, 3, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = L.token_stats(logits, labels, ref, temperature, chunk_size=3)
    (gg,) = torch.autograd.grad(sum((got[i] * w[i]).sum() for i in used), logits)
    want = _reference(logits, ref, labels, temperature)
    (gw,) = torch.autograd.grad(sum((want[i] * w[i]).sum() for i in used), logits)
    torch.testing.assert_close(gg, gw, rtol=1e-9, atol=1e-12)


def test_by_hand_one_position():
    """V = 3 by hand: p = softmax([0, ln 2, ln 4]) = [1/7, 2/7, 4/7], q uniform, label 2."""
    logits = torch.log(torch.tensor([[[1.0, 2.0, 4.0]]], dtype=torch.float64)).requires_grad_()
    ref = torch.zeros(1, 1, 3, dtype=torch.float64)
    st = L.token_stats(logits, torch.tensor([[2]]), ref, chunk_size=1)
    p = torch.tensor([1, 2, 4], dtype=torch.float64) / 7
    h = float(-(p * p.log()).sum())
    assert float(st.logprobs.detach()) == pytest.approx(math.log(4 / 7), abs=1e-12)
    assert float(st.entropy.detach()) == pytest.approx(h, abs=1e-12)
    assert float(st.exact_kl.detach()) == pytest.approx(math.log(3) - h, abs=1e-12)  # KL to uniform = log V - H
    (g,) = torch.autograd.grad(st.logprobs.sum(), logits)  # d lp / dz = onehot - p
    torch.testing.assert_close(g[0, 0], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64) - p)


def test_identical_inputs_give_zero_kl_and_zero_kl_gradient():
    logits, _, labels = _inputs(dtype=torch.float32, v=151)
    st = L.token_stats(logits, labels, logits.detach().clone(), chunk_size=2)
    assert float(st.exact_kl.detach().abs().max()) <= 1e-6
    (g,) = torch.autograd.grad(st.exact_kl.sum(), logits)
    assert float(g.abs().max()) <= 1e-6


def test_fp32_large_vocab_matches_and_default_chunk_bounds_temporaries():
    logits, ref, labels = _inputs(b=2, t=9, v=50_000, dtype=torch.float32)
    got = L.token_stats(logits, labels, ref, chunk_size=L.default_chunk(2, 50_000, elements=200_000))
    want = _reference(logits, ref, labels, 1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert L.default_chunk(8, 151_936) == 13 and L.default_chunk(1, 10) == (1 << 24) // 10


def test_without_reference_and_bad_input():
    logits, ref, labels = _inputs()
    st = L.token_stats(logits, labels, chunk_size=2)
    assert st.exact_kl is None
    (g,) = torch.autograd.grad((st.logprobs + st.entropy).sum(), logits)
    (gw,) = torch.autograd.grad((L.logprobs_from_logits(logits, labels) + L.entropy_from_logits(logits)).sum(), logits)
    torch.testing.assert_close(g, gw)
    with pytest.raises(ValueError, match="chunk_size"):
        L.token_stats(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match="must not require grad"):
        L.token_stats(logits, labels, logits)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        L.token_stats(logits[0], labels)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_vocab_152k_matches_float64_formulas(device, dtype):
    """At Qwen2.5's vocabulary (151936), fp32 and bf16 logits (a bf16 learner's lm_head), on the CPU and on a
    CUDA device: values and gradients against the unchunked float64 formulas of the same, already rounded,
    logits. bf16 chunks are computed in fp32 (the values are fp32, only the gradient is rounded to bf16);
    identical inputs give KL 0 and a zero KL gradient (KL(0) = 0 of a policy against itself)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    logits, ref, labels = _inputs(b=2, t=33, v=151936, dtype=torch.float32)
    logits, ref = logits.detach().to(dtype), ref.to(dtype)
    dev = logits.to(device).requires_grad_()
    st = L.token_stats(dev, labels.to(device), ref.to(device), 0.7, chunk_size=8)  # 8 does not divide 33
    w = torch.randn(3, 2, 33, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad(sum((x * wi.to(device)).sum() for x, wi in zip(st, w)), dev)
    z64 = logits.double().requires_grad_()
    want = _reference(z64, ref.double(), labels, 0.7)
    (g64,) = torch.autograd.grad(sum((x * wi.double()).sum() for x, wi in zip(want, w)), z64)
    for a, b in zip(st, want):
        assert a.device.type == device and a.dtype == torch.float32
        torch.testing.assert_close(a.detach().double().cpu(), b.detach(), rtol=1e-4, atol=1e-4)  # fp32 sums of 152k terms
    assert g.dtype == dtype
    # the gradient as a whole (fp32 log-softmaxes over 152k terms err by ~2e-5 relative; bf16 rounds the result)
    err = float((g.double().cpu() - g64).norm() / g64.norm())
    assert err <= {torch.float32: 1e-4, torch.bfloat16: 1e-2}[dtype], err
    same = L.token_stats(dev, labels.to(device), dev.detach().clone(), chunk_size=8)
    assert float(same.exact_kl.detach().abs().max()) <= 1e-6
    (gk,) = torch.autograd.grad(same.exact_kl.sum(), dev)
    assert float(gk.abs().max()) <= 1e-6
