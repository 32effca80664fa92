"""Issue 45: the TensorRT / onnxruntime-CUDA path checked on the CPU before its first GPU run.

Each test here failed on the code before the fix it covers (the commit message and docs/gpu-status.md say which):
tensor addresses TensorRT's 256-byte rule refuses, a push that does not wait for the learner's stream, TF32 left on
in a strongly typed fp32 build, a stored-dtype weight rounded through fp16, a Refitter made per push, the held
weights, the ``gpu`` extra, the providers, and mapped weights TensorRT could constant-fold. The stand-in
(tests/tensorrt_standin.py) plays TensorRT on the host; the GPU probe is scripts/gpu_probe.py.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

import refit.rollout.tensorrt.build as tb
import refit.rollout.tensorrt.engine as te
import refit.rollout.tensorrt.runner as runner
from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams

from conftest import ARCHS
from tensorrt_standin import ALIGN, _Context, _DataType, _ONNX_DT, _NP_DT, make_stand_in, use_stand_in

GREEDY = SamplingParams(max_new_tokens=5, greedy=True)


@pytest.fixture(scope="module")
def llama(engine_dirs, trt_folders):
    """The stand-in's tiny-llama fp32 folder (shared with tests/test_tensorrt.py through ``trt_folders``)."""
    folders = trt_folders("stand-in")
    return SimpleNamespace(folders=folders, dir=folders.get("tiny-llama-fp32", engine_dirs["tiny-llama"]))


@pytest.fixture(scope="module")
def engine_dirs(plain_engine_dirs):
    return plain_engine_dirs


def _params(model_dir):
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    params, _ = canonical_params(load_model(model_dir))
    return {n: p.detach().clone() for n, p in params.items()}


# ----------------------------------------------------------------------------- 1. tensor addresses

def test_aligned_copies_only_what_is_off_the_boundary():
    base = torch.arange(600, dtype=torch.int64)
    view = runner.aligned_empty((600,), torch.int64, "cpu").copy_(base)[1:]  # 8 bytes past a 256-byte boundary
    assert view.data_ptr() % ALIGN == 8
    fixed = runner.aligned(view)
    assert fixed.data_ptr() % ALIGN == 0 and torch.equal(fixed, base[1:])
    assert runner.aligned(fixed) is fixed
    assert runner.aligned_empty((0, 3), torch.float16, "cpu").data_ptr() % ALIGN == 0


def test_batch1_generate_binds_only_aligned_addresses(llama, model_dirs):
    """At batch 1 the decode step's position ids are ``position_ids_from_mask(mask)[:, -1:]``, a contiguous view
    (T-1)*8 bytes into its row; the stand-in refuses it as TensorRT's setTensorAddress does."""
    fake = llama.folders.fake
    eng, ref = llama.folders.open(llama.dir), create_engine("torch", model_dirs["tiny-llama"])
    fake.addresses.clear()
    for prompt in ([5, 17, 33], [9, 4, 12, 60, 61]):
        got, want = eng.generate([prompt], GREEDY), ref.generate([prompt], GREEDY)
        torch.testing.assert_close(got.response_ids, want.response_ids, atol=0, rtol=0)
    assert fake.addresses and all(a % ALIGN == 0 for a in fake.addresses)
    eng.close()


def test_a_refused_address_is_one_line_not_a_silent_run(llama, monkeypatch):
    eng = llama.folders.open(llama.dir)

    def refuse(self, n, ptr):  # a TensorRT that keeps the pointer but says no: the old code ran on regardless
        self.addr[n] = ptr
        return False

    monkeypatch.setattr(_Context, "set_tensor_address", refuse)
    with pytest.raises(RefitError, match=r"set_tensor_address\(input_ids\) refused .*256-byte"):
        eng.generate([[5, 17, 33]], GREEDY)
    eng.close()


# ------------------------------------------------------------------------ 2. push after the learner's stream

def test_push_waits_for_the_learner_stream_before_reading(llama, model_dirs, monkeypatch):
    eng = llama.folders.open(llama.dir)
    events, learner = [], object()
    monkeypatch.setattr(te, "producer_streams", lambda tensors: [learner])
    monkeypatch.setattr(runner.HostStream, "wait_stream", lambda self, s: events.append(("wait", s)), raising=False)
    real = te.apply_transform
    monkeypatch.setattr(te, "apply_transform", lambda t, tgt: events.append(("read", None)) or real(t, tgt))
    eng.update_weights(_params(model_dirs["tiny-llama"]))
    assert events[0] == ("wait", learner) and ("read", None) in events, events[:3]
    eng.close()


# --------------------------------------------------------------------------------------- 3. TF32 off

@pytest.mark.parametrize("strong", [False, True])
def test_fp32_build_clears_tf32_in_every_mode(engine_dirs, fresh_copy, monkeypatch, strong):
    """TensorRT 11 has no FP16 flag (strong typing only) and TF32 on by default: an fp32 build clears it there too."""
    fake = make_stand_in()
    if strong:
        fake.BuilderFlag = SimpleNamespace(REFIT="REFIT", TF32="TF32")  # TensorRT 11: the precision flags are gone
    use_stand_in(monkeypatch, fake)
    d = fresh_copy(engine_dirs["tiny-gpt2"], "g")
    rec = tb.build_engines(d, log=lambda *_: None)["decoder"]
    plan = json.loads((d / rec.plan).read_bytes())
    assert plan["strongly_typed"] == strong and "TF32" not in plan["flags"], plan["flags"]
    assert rec.precision == ("strongly-typed (graph dtypes, TF32 off)" if strong else "weak+FP32 (TF32 off)")


# --------------------------------------------------------------------------------- 4. stored dtypes

@pytest.fixture(scope="module")
def t5_fp16(tmp_path_factory, model_dirs):
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    out = tmp_path_factory.mktemp("engines-fp16") / "tiny-t5"
    return build(model_dirs["tiny-t5"], out, opts=ExportOptions(dtype="fp16", max_batch=4, max_len=64,
                                                                attention="plain"), log=lambda *_: None)


def test_stored_dtype_push_is_not_rounded_through_fp16(t5_fp16, model_dirs, fresh_copy, monkeypatch):
    """T5's fp32 ``wo`` in an fp16 export: the refitted bytes equal what the export's own mapping makes of the push
    (refit/export/weight_map.py ``engine_weights``), not the push rounded to fp16 and back."""
    from refit.export.weight_map import engine_weights

    d = fresh_copy(t5_fp16, "t5")
    m = Manifest.read(d)
    own = {(t.graph, t.engine) for ts in m.weight_map.values() for t in ts if t.stored_dtype == "fp32"}
    assert own, "the fp16 T5 export keeps no weight in fp32 any more: this test needs another subject"
    use_stand_in(monkeypatch)
    tb.build_engines(d, log=lambda *_: None)
    eng = te.TrtEngine(d, device="cpu")
    g = torch.Generator().manual_seed(7)
    push = {n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in _params(model_dirs["tiny-t5"]).items()}
    eng.update_weights(push)
    want = engine_weights(push, m.weight_map, torch.float16)
    for graph, name in sorted(own):
        refitted = eng.graphs[graph].engine.weights[name]
        assert refitted.dtype == np.float32
        np.testing.assert_array_equal(refitted, want[graph][name].numpy(), err_msg=name)
    eng.close()


def test_bf16_is_in_both_dtype_tables():
    fake = make_stand_in()
    assert _ONNX_DT[16] is _DataType.BF16 and np.dtype(_NP_DT[_DataType.BF16]).itemsize == 2
    assert runner.trt_to_torch(fake)[fake.DataType.BF16] is torch.bfloat16


# ------------------------------------------------------------------ 8/9. one Refitter, held weights or none

def test_pushes_reuse_one_refitter_per_graph(llama, model_dirs):
    fake = llama.folders.fake
    eng = llama.folders.open(llama.dir)
    made, protos = len(fake.refitters), fake.prototypes
    params = _params(model_dirs["tiny-llama"])
    for k in (2.0, 1.0):
        eng.update_weights({n: t * k for n, t in params.items()})
    assert len(fake.refitters) == made and fake.prototypes == protos, "a push made a Refitter or read prototypes"
    refits = [c for c in fake.calls if c[0] == "refit"][-2:]
    assert len(refits) == 2 and all(validation is False for _, _, validation in refits)
    eng.close()


def test_unheld_engine_keeps_no_weights_and_takes_whole_pushes(llama, model_dirs, monkeypatch):
    monkeypatch.setattr(tb, "require_tensorrt", lambda: llama.folders.fake)
    eng = te.TrtEngine(llama.dir, device="cpu", hold_weights=False)
    ref = create_engine("torch", model_dirs["tiny-llama"])
    assert eng.weights is None
    g = torch.Generator().manual_seed(4)
    push = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in _params(model_dirs["tiny-llama"]).items()}
    eng.update_weights(push)
    ref.update_weights(push)
    prompts = [[5, 17, 33, 8], [9, 4]]
    got, want = eng.generate(prompts, GREEDY), ref.generate(prompts, GREEDY)
    torch.testing.assert_close(got.response_ids, want.response_ids, atol=0, rtol=0)
    assert all(not r.refitter.pending for r in eng._refit.values()), "pushed tensors left set"
    with pytest.raises(RefitError, match="holds no copy of its weights.*leaves out"):
        eng.update_weights({"model.layers.0.self_attn.q_proj.weight": push["model.layers.0.self_attn.q_proj.weight"]})
    assert eng.weights_version == 1
    eng.close()


# ------------------------------------------------------------------------- 5/6. packaging, 11. providers

def test_default_providers_cpu_or_cuda_only_and_says_why_cuda_is_missing():
    from refit.export.graph import default_providers

    with pytest.raises(RefitError, match="must be 'cpu' or 'cuda'"):
        default_providers("tensorrt")
    assert default_providers("cuda", have=["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(RefitError, match="both `onnxruntime` and `onnxruntime-gpu` are installed") as e:
        default_providers("cuda", have=["CPUExecutionProvider"], dists={"onnxruntime", "onnxruntime-gpu"})
    assert "\n" not in str(e.value)
    with pytest.raises(RefitError, match="pip install onnxruntime-gpu"):
        default_providers("cuda", have=["CPUExecutionProvider"], dists={"onnxruntime"})


def test_tensorrt_for_another_cuda_major_than_torch_is_named():
    assert "CUDA 12 but torch for CUDA 13.0" in tb.cuda_major_mismatch("13.0", {"tensorrt-cu12", "torch"})
    assert tb.cuda_major_mismatch("12.8", {"tensorrt-cu12"}) is None
    assert tb.cuda_major_mismatch("13.0", {"tensorrt-cu13-libs"}) is None
    assert tb.cuda_major_mismatch(None, {"tensorrt-cu12"}) is None  # a CPU torch: nothing to match


# ------------------------------------------------------------------------------ 7. weights TensorRT may fold

def _folds(d):
    from refit.export.graph import foldable_weights

    m = Manifest.read(d)
    return {g: foldable_weights(onnx.load(str(d / s.file), load_external_data=False), tb.mapped_trt_names(m, g))
            for g, s in m.graphs.items()}


def test_no_plain_export_feeds_a_weight_to_a_constant_only_op(engine_dirs, fp16_engine_dir, t5_fp16):
    for d in [*(engine_dirs[a] for a in ARCHS), fp16_engine_dir, t5_fp16]:
        assert _folds(d) == {g: {} for g in Manifest.read(d).graphs}, d


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_qdq_twins_are_exactly_the_foldable_weights(qdq_engine_dirs, arch):
    """The int8 twins and scales reach their MatMul through DequantizeLinear of two constants: what TensorRT may
    fold (the build's refittable check then refuses it); nothing else of the Q/DQ graph is foldable."""
    d = qdq_engine_dirs[arch]
    twins = Manifest.read(d).quantization.weights["decoder"].values()
    assert _folds(d)["decoder"] == {n: "DequantizeLinear" for tw in twins for n in (tw.weight, tw.scale)}


def test_check_engine_folder_names_a_planted_foldable_weight(engine_dirs, fresh_copy):
    from refit.rollout.tensorrt.check import check_engine_folder

    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    model = onnx.load(str(d / "decoder.onnx"), load_external_data=False)
    w = Manifest.read(d).weight_map["model.layers.0.mlp.down_proj.weight"][0].engine
    node = next(n for n in model.graph.node if w in n.input)
    node.input[list(node.input).index(w)] = w + "_t"
    model.graph.node.insert(0, onnx.helper.make_node("Identity", [w], [w + "_t"]))  # a constant-only op
    onnx.save(model, str(d / "decoder.onnx"))
    assert any(f"weight {w} is read by a constant-only Identity" in p for p in check_engine_folder(d))


# ------------------------------------------------------------------------------ 12. the built plans' gate

def test_built_plans_are_gated_against_pytorch_or_removed(engine_dirs, fresh_copy, monkeypatch):
    """``refit export --backend tensorrt`` builds through ``build_gated``: the gate runs where plans run on a GPU
    (``gate=None``); here it is asked for on the stand-in: it passes within the tolerance, and a gate that fails
    removes the plans and the manifest's record of them."""
    import refit.rollout.tensorrt.gate as gate

    use_stand_in(monkeypatch)
    d = fresh_copy(engine_dirs["tiny-gpt2"], "g")
    logs = []
    gate.build_gated(d, log=logs.append)
    assert not any("gated" in x for x in logs), "a host stand-in is not gated unless asked"
    gate.build_gated(d, log=logs.append, gate=True, force=True)
    assert "gated against PyTorch" in logs[-1] and Manifest.read(d).tensorrt is not None
    monkeypatch.setitem(gate.PLAN_GATE_TOL, "fp32", -1.0)
    with pytest.raises(RefitError, match="TensorRT plan gate failed"):
        gate.build_gated(d, log=logs.append, gate=True, force=True)
    assert Manifest.read(d).tensorrt is None and not list(d.glob("*.plan"))


def test_jobs_open_tensorrt_engines_without_a_held_copy_unless_lora(monkeypatch, tmp_path):
    """#8: a job pushes the whole model, so its TensorRT engine keeps no device copy of the weights
    (hold_weights=False); a LoRA run's TensorRT pushes refit the merged targeted layers, which need the held
    partners, so it keeps them."""
    import refit.learner.run.engines as je
    from refit.learner.ppo.config import PPOConfig

    seen = []
    monkeypatch.setattr(je, "engine_source", lambda *a, **k: tmp_path)
    monkeypatch.setattr(je, "check_batch_memory", lambda *a, **k: None)
    monkeypatch.setattr(je, "make_engine", lambda cfg, src, out, share, **kw: seen.append(kw))
    for r in (0, 8):
        cfg = PPOConfig.from_flat(model_dir="m", output_dir=str(tmp_path / "run"), backend="tensorrt")
        lora = cfg.lora if not r else dataclasses.replace(cfg.lora, r=r)
        je.engine_for_model(cfg, "m", tmp_path / "e", 4, 64, lora=lora)
    assert seen[0].get("hold_weights") is False and "hold_weights" not in seen[1]
