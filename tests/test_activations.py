"""The learner's fused tanh GELU (refit/learner/run/activations.py) against transformers' own chain: the same values
and gradients to fp32 rounding, on GPT-2 small's published geometry (2 of its 12 layers) the same logits and
log-probs, nothing saved changed, and the chain kept where a model is traced for export."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.activations import FastGELUActivation, NewGELUActivation

from refit.learner.run.activations import FusedFastGELU, FusedNewGELU, fuse_activations


def _by_hand(x: torch.Tensor) -> torch.Tensor:
    """The published tanh approximation (Hendrycks & Gimpel 2016, eq. 2) in float64."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("chain,fused", [(NewGELUActivation, FusedNewGELU), (FastGELUActivation, FusedFastGELU)])
def test_fused_gelu_equals_the_chain_and_the_formula(chain, fused):
    x = torch.cat([torch.linspace(-12, 12, 4001), 4 * torch.randn(20000, generator=torch.Generator().manual_seed(0))])
    ref = _by_hand(x)
    a, b = chain()(x), fused()(x)
    assert (b.double() - ref).abs().max() < 1e-6 and (a.double() - ref).abs().max() < 1e-6
    assert (a - b).abs().max() < 1e-6
    xa, xb, x64 = x.clone().requires_grad_(True), x.clone().requires_grad_(True), x.double().requires_grad_(True)
    chain()(xa).sum().backward()
    fused()(xb).sum().backward()
    _by_hand(x64).sum().backward()  # the derivative in float64
    assert (xb.grad.double() - x64.grad).abs().max() < 2e-6 and (xa.grad.double() - x64.grad).abs().max() < 2e-6


def test_gpt2_small_geometry_same_logits_and_state(tmp_path):
    """GPT-2 small (768 wide, 12 heads, vocab 50257, gelu_new; 2 layers): every layer's activation swapped, the
    logits and token log-probs of a batch those of the unswapped model, the state dict and saved config unchanged;
    a traced forward (export) still records the chain."""
    from transformers import AutoModelForCausalLM

    from refit.learner.builtin.published import published_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(published_config("GPT-2 small", 2)).eval()
    ids = torch.randint(0, 50257, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_activations(model) == 2
    assert all(type(blk.mlp.act) is FusedNewGELU for blk in model.transformer.h)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    lp = lambda lg: torch.log_softmax(lg, -1)[:, :-1].gather(-1, ids[:, 1:, None])  # noqa: E731
    assert (lp(after) - lp(before)).abs().max() < 1e-5
    assert set(model.state_dict()) == set(keys)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    model.save_pretrained(tmp_path)
    assert '"activation_function": "gelu_new"' in (tmp_path / "config.json").read_text()
    traced = torch.jit.trace(model.transformer.h[0].mlp, torch.randn(1, 4, 768))
    graph = str(traced.inlined_graph)
    assert "aten::tanh" in graph and "aten::gelu" not in graph  # the exporter's graph: the chain, as before
