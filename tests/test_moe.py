"""Mixture-of-experts families (Mixtral, Qwen3-MoE) through export, weight push and PPO.

The experts run in the graph as ``refit::expert_linear`` lowered to one Gemm per expert over the
HF-layout 3-D weights (refit/export/moe.py); the references are HF's own eager expert loop (the grouped
forward) and the PyTorch engine (parity, push, PPO). A forward the exporter cannot translate is
refused in one line, before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.builtin.moe_models import build_moe_model
from refit.export.options import ExportOptions
from refit.rollout.build import build

MOE = ["tiny-mixtral", "tiny-qwen3-moe"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("moe")
    return {n: build_moe_model(n, root / n, tokenizer, seed=0) for n in MOE}


@pytest.fixture(scope="module")
def moe_engines(tmp_path_factory, moe_dirs):
    root = tmp_path_factory.mktemp("moe-engines")
    return {n: build(d, root / n, opts=ExportOptions(max_batch=16, max_len=128), log=lambda *_: None)
            for n, d in moe_dirs.items()}


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.mark.parametrize("name", MOE)
def test_grouped_experts_match_hf_eager_loop(moe_dirs, name):
    """The traced forward (experts grouped, refit::expert_linear) against HF's eager per-expert loop, including
    experts no token picks (one token, top-2 of 4 or 8) and a batch where every expert has rows."""
    from refit.export.moe import use_grouped_experts

    model = _load(moe_dirs[name])
    model.set_experts_implementation("eager")
    grouped = _load(moe_dirs[name])
    use_grouped_experts(grouped)
    for shape in [(1, 1), (3, 11)]:
        ids = torch.randint(4, 300, shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref, out = model(input_ids=ids).logits, grouped(input_ids=ids).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_expert_linear_empty_and_full_groups():
    """The op's reference: rows [ends[e-1], ends[e]) through expert e, in both weight layouts; empty groups."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, generator=g), torch.randn(4, 2, 3, generator=g)  # 4 experts (N=2, K=3)
    ends = torch.tensor([2, 2, 5, 5])  # experts 1 and 3 empty
    want = torch.cat([x[:2] @ w[0].t(), x[2:] @ w[2].t()])
    torch.testing.assert_close(torch.ops.refit.expert_linear(x, w, ends, False), want)
    torch.testing.assert_close(torch.ops.refit.expert_linear(x, w.transpose(1, 2).contiguous(), ends, True), want)


@pytest.mark.parametrize("name", MOE)
def test_export_parity_and_expert_weights_mapped_as_stored(moe_engines, name):
    from refit.core.manifest import Manifest

    m = Manifest.read(moe_engines[name])
    assert m.attention == "fused", m.attention_reason
    assert m.parity.max_abs_logprob_diff <= 1e-4
    experts = {k: v for k, v in m.weight_map.items() if ".experts." in k}
    assert len(experts) == 2 * m.dims.n_layers  # gate_up_proj and down_proj of each layer
    assert all([t.transform for t in v] == ["identity"] for v in experts.values())


def test_plain_attention_export_parity(moe_dirs, tmp_path):
    """The standard-op graph (what TensorRT builds from) with the same experts lowering."""
    from refit.core.manifest import Manifest

    out = build(moe_dirs["tiny-qwen3-moe"], tmp_path / "e", opts=ExportOptions(max_batch=4, max_len=64,
                                                                                  attention="plain"),
                      log=lambda *_: None)
    m = Manifest.read(out)
    assert m.attention == "plain" and m.parity.max_abs_logprob_diff <= 1e-4


@pytest.mark.parametrize("name", MOE)
def test_push_expert_weights(moe_dirs, moe_engines, prompts, name):
    """Perturbed expert and router weights change the engine's output and match PyTorch; restored, the original."""
    from refit.rollout.ort_backend import OrtEngine
    from refit.rollout.torch_backend import TorchEngine
    from test_weight_push import _noisy, _roundtrip

    ort, ref = OrtEngine(moe_engines[name]), TorchEngine(moe_dirs[name])
    params = dict(ref.model.named_parameters())
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
             "model.layers.1.mlp.gate.weight"]
    _roundtrip(ort, ref, prompts, {n: _noisy(params[n], i, scale=0.05) for i, n in enumerate(names)})
    ort.close()


@pytest.mark.parametrize("name", MOE)
def test_ppo_two_steps_kl_zero_then_nonnegative(moe_dirs, moe_engines, tmp_path, name):
    from refit.bench.smokes import ppo_smoke

    r = ppo_smoke({"model_dir": str(moe_dirs[name]), "engine_dir": str(moe_engines[name])}, tmp_path)
    assert r["steps"] == 2
    assert abs(r["kl0"]) <= 1e-6, r
    assert r["min_exact_kl"] >= 0, r


def test_unexportable_forward_refused_in_one_line(moe_dirs, tmp_path, monkeypatch):
    """Without the experts switch, transformers' grouped_mm has no ONNX translation: one RefitError line, and
    nothing is left at the output path."""
    import refit.export.onnx_export as oe

    monkeypatch.setattr(oe, "_moe_check", lambda *a: False)
    out = tmp_path / "e"
    with pytest.raises(RefitError) as e:
        build(moe_dirs["tiny-mixtral"], out, opts=ExportOptions(max_batch=4, max_len=64, attention="plain"),
                    log=lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and "cannot export the decoder graph" in msg and "torch.onnx.export failed" in msg
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [f".{out.name}.lock"]  # only its lock file


def test_moe_with_tiny_expert_tensors_refused_before_writing(tokenizer, tmp_path):
    """Expert tensors the ONNX optimiser would fold into per-expert slices: refused in one line, nothing written."""
    d = build_moe_model("tiny-mixtral", tmp_path / "m", tokenizer, hidden_size=32, intermediate_size=16)
    with pytest.raises(RefitError, match=r"mixture-of-experts layer not supported: .*experts\.\w+ holds <= 8192"):
        build(d, tmp_path / "e", opts=ExportOptions(max_batch=4, max_len=64), log=lambda *_: None)
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral-8x7b-2-experts", "qwen3-30b-a3b-small-vocab"])
def test_published_widths_export_push_ppo(tmp_path, name):
    """refit.bench.moe's stages at Mixtral-8x7B's / Qwen3-30B-A3B's widths (cut as refit.bench.moe.RUNS says), each stage
    in its own process: parity, a push that moves the output and matches PyTorch, 2 PPO steps, 2 distillation steps.
    (Mixtral with 4 experts and Qwen3-MoE at its full vocabulary export and push, but their PPO steps do not fit a
    24 GB box: RUNS.)"""
    from refit.bench.moe import run

    rec = run(name, tmp_path, compare=False)
    assert rec["export"]["parity"] <= 1e-4 and rec["export"]["expert_transforms"] == ["identity"], rec
    assert rec["push"]["moved"] > 1e-3 and rec["push"]["max_abs_diff_vs_torch"] <= 1e-4, rec
    assert abs(rec["ppo"]["kl0"]) <= 1e-6 and rec["ppo"]["min_exact_kl"] >= 0, rec
    assert abs(rec["distill"]["kl0"]) <= 1e-6 and rec["distill"]["steps"] == 2, rec
