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


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama", "tiny-t5", "tiny-bart", "tiny-marian"])
def test_learner_attention_equals_eager(model_dirs, arch):
    """The learner's models load with SDPA attention (refit.core.hf_folder.LEARNER_ATTN; a family transformers runs
    only eagerly would load eagerly): at left-padded prompts of different lengths (decoder-only) or right-padded encoder
    inputs, the response log-probs and every parameter's gradient those of the eager model (the exporter's), and
    no NaN from the rows whose padding positions attend to nothing."""
    from refit.core.hf_folder import LEARNER_ATTN, load_model
    from refit.learner.losses.chunked import token_stats
    from refit.learner.run.policy import response_forward

    s2s = arch in ("tiny-t5", "tiny-bart", "tiny-marian")
    models = {a: load_model(model_dirs[arch], attn=a) for a in ("eager", LEARNER_ATTN)}
    assert models[LEARNER_ATTN].config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(0)
    vocab = models["eager"].config.vocab_size
    b, tp, tr = 5, 9, 7
    prompt, mask = torch.randint(5, vocab, (b, tp), generator=g), torch.ones(b, tp, dtype=torch.long)
    for i, n in enumerate([0, 3, 8, 1, 5]):  # padding columns per row, on the family's side
        cols = slice(tp - n, tp) if s2s else slice(0, n)
        prompt[i, cols], mask[i, cols] = 0, 0
    resp = torch.randint(5, vocab, (b, tr), generator=g)
    out = {}
    for a, m in models.items():
        st = token_stats(response_forward(m, prompt, mask, resp, s2s).logits, resp)
        st.logprobs.sum().backward()
        out[a] = (st.logprobs.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    (lp_e, g_e), (lp_s, g_s) = out["eager"], out[LEARNER_ATTN]
    assert torch.isfinite(lp_s).all() and torch.isfinite(g_s).all()
    assert (lp_s - lp_e).abs().max() < 1e-5
    assert float((g_s - g_e).norm() / g_e.norm()) < 1e-4


@pytest.mark.parametrize("geometry", ["GPT-2 small", "Qwen2.5 0.5B"])
def test_learner_attention_at_published_geometries(geometry):
    """SDPA against eager at published widths (GPT-2 small: 12 heads of 64; Qwen2.5-0.5B: 14 query heads over 2 KV
    heads of 64, rope theta 1e6; 2 layers each), left-padded prompts: log-probs to 2e-5, gradients to 1e-4. One model,
    its attention switched (``set_attn_implementation``), its embedding frozen: a 152k x 896 table and its gradient
    twice would leave this test process ~2 GB larger for the tests after it (a forked child's peak counts it)."""
    from transformers import AutoModelForCausalLM

    from refit.learner.builtin.published import published_config
    from refit.learner.losses.chunked import token_stats
    from refit.learner.run.policy import response_forward

    cfg = published_config(geometry, 2)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    m.get_input_embeddings().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    prompt, mask = torch.randint(5, cfg.vocab_size, (3, 12), generator=g), torch.ones(3, 12, dtype=torch.long)
    mask[0, :7], mask[2, :2] = 0, 0
    resp = torch.randint(5, cfg.vocab_size, (3, 10), generator=g)
    out = {}
    for attn in ("eager", "sdpa"):
        m.set_attn_implementation(attn)
        m.zero_grad(set_to_none=True)
        st = token_stats(response_forward(m, prompt, mask, resp, False).logits, resp)
        st.logprobs.sum().backward()
        out[attn] = (st.logprobs.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        assert m.config._attn_implementation == attn
    assert torch.isfinite(out["sdpa"][1]).all() and out["sdpa"][1].numel() > 1e6
    assert (out["sdpa"][0] - out["eager"][0]).abs().max() < 2e-5
    assert float((out["sdpa"][1] - out["eager"][1]).norm() / out["eager"][1].norm()) < 1e-4
