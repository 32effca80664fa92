"""TensorRT: CPU-side engine-folder checks, the build/refit/backend plumbing, and the GPU tests.

Three layers, split by cost:

1. CPU, always: :mod:`refit.rollout.tensorrt.check` (its ``check_graph`` and ``check_weights`` checks) on the
   tiny engines and on planted faults (an op the parser lacks, an anonymous or uncovered dimension, a missing or
   doubled weight mapping), and the one-line failures where TensorRT is absent.
2. CPU, always: ``build_engines`` and ``TrtEngine`` driven through the host *stand-in* of the
   ``tensorrt`` module (tests/tensorrt_standin.py): plans, profiles, refit by name.
3. ``tensorrt``/``gpu`` markers: the same build and refit tests on real TensorRT plans; they
   skip with the reason where TensorRT or a CUDA device is absent.

Parity of generate/score with the PyTorch reference, stand-in and real TensorRT, fp32 and fp16,
is the matrix in tests/test_parity.py; the refit tests here compare with the reference too. The int8
Q/DQ folder (``--backend tensorrt --quantize int8``) is built and refitted at the end (its graph and its
ONNX Runtime parity: tests/test_quantize.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import refit.rollout.tensorrt.build as tb
from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.rollout.tensorrt.check import check_engine_folder
from refit.rollout.tensorrt.check_graph import check_ops, check_profiles
from refit.rollout.tensorrt.check_weights import check_weight_map
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams

from conftest import ARCHS, ATOL, quantized_reference
from tensorrt_standin import TRT_REASON, use_stand_in

GPU_ONLY = [pytest.mark.tensorrt, pytest.mark.gpu]


@pytest.fixture(scope="session")
def engine_dirs(plain_engine_dirs):
    """TensorRT builds from the standard-op graph (the fused graph's contrib op is ONNX Runtime's): the engine
    folders here are the plain-attention exports."""
    return plain_engine_dirs


def _raw(d: Path) -> dict:
    """The manifest JSON of ``d`` as a plain dict, to plant a fault in (then ``Manifest.from_dict``)."""
    return json.loads((d / "manifest.json").read_text())


def _edit_manifest(d: Path, fn) -> dict:
    m = _raw(d)
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return m


# ================================================================ 1. CPU checks of the engine folder

@pytest.mark.parametrize("arch", ARCHS)
def test_check_engine_folder_passes_on_tiny_engines(engine_dirs, arch):
    assert check_engine_folder(engine_dirs[arch]) == []


def test_trt_check_cli(engine_dirs, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "refit.rollout.tensorrt.check", str(engine_dirs["tiny-t5"])],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "ok" in ok.stdout.splitlines()[-1], ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-m", "refit.rollout.tensorrt.check", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "problem" in bad.stdout.splitlines()[-1]


def _tiny_model(nodes, functions=(), opset=18, extra_inputs=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x, *extra_inputs], [y])
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(f.domain, 1) for f in functions]
    return helper.make_model(graph, opset_imports=imports, functions=list(functions))


def test_check_ops_catches_planted_unsupported_op(tmp_path):
    p = tmp_path / "g.onnx"
    onnx.save(_tiny_model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Unique", ["r"], ["y"])]), p)
    assert check_ops(p, 18) == ["Unique"]
    onnx.save(_tiny_model([helper.make_node("Relu", ["x"], ["y"])]), p)
    assert check_ops(p, 18) == []
    assert check_ops(p, 21) == ["opset 21 (the parser supports 9..20)"]


def test_check_ops_looks_inside_subgraphs_functions_and_domains(tmp_path):
    then_g = helper.make_graph([helper.make_node("Unique", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    p = tmp_path / "if.onnx"
    onnx.save(_tiny_model([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
                          extra_inputs=[cond]), p)
    assert check_ops(p, 18) == ["Unique"]
    fn = helper.make_function("local", "Body", ["a"], ["b"], [helper.make_node("STFT", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 18)])
    onnx.save(_tiny_model([helper.make_node("Body", ["x"], ["y"], domain="local")], functions=[fn]), p)
    assert check_ops(p, 18) == ["STFT"]  # the function body was inlined and checked
    onnx.save(_tiny_model([helper.make_node("FusedMatMul", ["x", "x"], ["y"], domain="com.microsoft")]), p)
    assert check_ops(p, 18) == ["com.microsoft:FusedMatMul"]
    onnx.save(_tiny_model([helper.make_node("Gelu", ["x"], ["y"])], opset=18), p)  # Gelu exists from opset 20
    assert check_ops(p, 18) == ["Gelu"]


def _set_dim(onnx_path: Path, inp: str, axis: int, name: str | None) -> None:
    """Rename (or anonymise, name=None) one input dimension; weights stay external, untouched."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    dim = next(i for i in model.graph.input if i.name == inp).type.tensor_type.shape.dim[axis]
    dim.Clear()
    if name is not None:
        dim.dim_param = name
    onnx.save(model, str(onnx_path))


def test_check_profiles_catches_anonymous_and_undeclared_dims(engine_dirs, fresh_copy):
    d = fresh_copy(engine_dirs["tiny-gpt2"], "g")
    m = Manifest.read(d)
    _set_dim(d / "decoder.onnx", "input_ids", 1, None)
    assert any("input_ids[1]: anonymous dynamic dimension" in p for p in check_profiles(m, d / "decoder.onnx"))
    _set_dim(d / "decoder.onnx", "input_ids", 1, "tokens")
    probs = check_profiles(m, d / "decoder.onnx")
    assert any("'tokens' is not in manifest dynamic_dims" in p for p in probs), probs
    assert any("tokens" in p for p in check_engine_folder(d))


def test_check_profiles_catches_uncovered_dims(engine_dirs, fresh_copy):
    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    path = d / "decoder.onnx"
    m = _raw(d)
    del m["profiles"]["decoder"]["decode"]["attention_mask"]
    assert check_profiles(Manifest.from_dict(m), path) == ["decoder/decode: input attention_mask has no min/opt/max"]
    m = _raw(d)
    m["profiles"]["decoder"]["prefill"]["input_ids"]["opt"][1] = 10_000  # opt above max
    assert any("prefill.input_ids[1] (seq): needs 0 <= min <= opt <= max" in p
               for p in check_profiles(Manifest.from_dict(m), path))
    m = _raw(d)
    m["profiles"]["decoder"]["decode"]["past.0.key"]["max"][1] += 1  # a static axis (heads) with a range
    assert any("past.0.key[1]: static dim" in p for p in check_profiles(Manifest.from_dict(m), path))
    m = _raw(d)
    m["profiles"]["decoder"]["decode"]["past.1.value"]["max"][0] = 3  # one "batch" dim, two ranges
    assert any("dim 'batch'" in p for p in check_profiles(Manifest.from_dict(m), path))
    _edit_manifest(d, lambda mm: mm["profiles"]["decoder"]["decode"].pop("position_ids"))
    assert any("position_ids has no min/opt/max" in p for p in check_engine_folder(d))


def test_check_weight_map_catches_missing_and_duplicated_mappings(engine_dirs, fresh_copy):
    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    path = d / "decoder.onnx"
    m = Manifest.read(d)
    hf = "model.layers.0.self_attn.q_proj.weight"
    target = m.weight_map[hf][0].engine
    assert check_weight_map(m, path) == []
    missing = _raw(d)
    del missing["weight_map"][hf]
    assert check_weight_map(Manifest.from_dict(missing), path) == [
        f"decoder: external initializer {target} is the target of 0 weight-map entries (want 1)"]
    dup = _raw(d)
    dup["weight_map"]["model.layers.1.self_attn.q_proj.weight"].append(dict(dup["weight_map"][hf][0]))
    assert any(f"{target} is the target of 2 weight-map entries" in p
               for p in check_weight_map(Manifest.from_dict(dup), path))
    flipped = _raw(d)
    flipped["weight_map"]["model.layers.0.mlp.down_proj.weight"][0]["transform"] = "identity"
    assert any("down_proj.weight" in p and "after identity" in p
               for p in check_weight_map(Manifest.from_dict(flipped), path))
    ghost = _raw(d)
    ghost["weight_map"][hf][0]["engine"] = "no_such_tensor"
    assert any("no_such_tensor: no such initializer" in p for p in check_weight_map(Manifest.from_dict(ghost), path))
    _edit_manifest(d, lambda mm: mm["weight_map"].pop(hf))
    assert any("target of 0 weight-map entries" in p for p in check_engine_folder(d))


def test_refit_names_are_the_onnx_initializer_names(engine_dirs):
    for arch in ARCHS:
        m = Manifest.read(engine_dirs[arch])
        for g, spec in m.graphs.items():
            model = onnx.load(str(engine_dirs[arch] / spec.file), load_external_data=False)
            external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
            assert set(tb.mapped_trt_names(m, g)) == external, (arch, g)
            n_targets = sum(len(v) for v in tb.refit_targets(m, g).values())
            assert n_targets == len(external)


# ================================================================ 1b. one-line failures without TensorRT

@pytest.mark.skipif(TRT_REASON is None, reason="TensorRT and a GPU are present: nothing to refuse")
def test_require_tensorrt_raises_one_line():
    with pytest.raises(RefitError) as e:
        tb.require_tensorrt()
    msg = str(e.value)
    assert "\n" not in msg and "pip install refit[gpu]" in msg and "NVIDIA" in msg
    with pytest.raises(RefitError):
        tb.build_engines("/nonexistent")  # refuses before touching anything
    from refit.rollout.tensorrt.engine import TrtEngine

    assert "tensorrt" not in sys.modules, "importing the backend module must not import tensorrt"
    with pytest.raises(RefitError, match="TensorRT"):
        TrtEngine("/nonexistent")


@pytest.mark.skipif(TRT_REASON is None, reason="TensorRT and a GPU are present: export would succeed")
def test_export_backend_tensorrt_fails_fast_and_leaves_nothing(model_dirs, tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "refit", "export", str(model_dirs["tiny-gpt2"]), "-o", str(out),
                        "--backend", "tensorrt"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "TensorRT" in lines[0] and "pip install refit[gpu]" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert time.perf_counter() - t0 < 60, "should fail before exporting anything"


# ================================================================ 2. build_engines on the stand-in

def test_build_engines_records_plans_and_profiles(engine_dirs, fresh_copy, monkeypatch):
    use_stand_in(monkeypatch)
    d = fresh_copy(engine_dirs["tiny-t5"], "t5")
    logs = []
    recs = tb.build_engines(d, workspace_gb=0.5, log=logs.append)
    m = Manifest.read(d)
    assert m.tensorrt == recs and set(recs) == {"encoder", "decoder"}
    assert recs["decoder"].profiles == ("prefill", "decode") and recs["encoder"].profiles == ("encode",)
    for g, rec in recs.items():
        assert (d / rec.plan).is_file() and rec.trt_version == "10.0.0-stand-in"
        assert set(tb.mapped_trt_names(m, g)) <= set(rec.refittable_weights) and rec.not_refittable == ()
        assert rec.precision == "weak+FP32 (TF32 off)"
    assert check_engine_folder(d) == []
    assert not [p for p in d.iterdir() if p.name.startswith(".")], "temporary plan files left behind"
    tb.build_engines(d, log=logs.append)
    assert "up to date" in logs[-1]


def test_build_engines_refuses_constant_folded_weights(engine_dirs, fresh_copy, monkeypatch):
    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    m = Manifest.read(d)
    folded = m.weight_map["model.layers.0.self_attn.q_proj.weight"][0].engine
    use_stand_in(monkeypatch, fold={folded})
    with pytest.raises(RefitError, match=f"constant-folded 1 mapped weights of decoder.*{folded}"):
        tb.build_engines(d, log=lambda *_: None)
    assert Manifest.read(d).tensorrt is None and not list(d.glob("*plan*")) and not list(d.glob(".*"))
    recs = tb.build_engines(d, strict=False, log=lambda *_: None)
    assert recs["decoder"].not_refittable == (folded,)
    assert any("not refittable" in p for p in check_engine_folder(d))


# ================================================================ 2+3. backend parity and refit

@pytest.fixture(scope="module", params=["stand-in", pytest.param("tensorrt", marks=GPU_ONLY)])
def trt_env(request, engine_dirs, trt_folders):
    """Engine folders with plans, built by the stand-in (device cpu) or by real TensorRT (cuda); shared
    with the parity matrix through ``trt_folders``."""
    folders = trt_folders(request.param)
    dirs = {arch: folders.get(f"{arch}-fp32", engine_dirs[arch]) for arch in ARCHS}
    key = "tensorrt-stand-in" if request.param == "stand-in" else "tensorrt"
    return SimpleNamespace(kind=request.param, folders=folders, dirs=dirs, fake=folders.fake, atol=ATOL[key]["fp32"])


def test_built_engines_are_refittable(trt_env):
    for arch, d in trt_env.dirs.items():
        m = Manifest.read(d)
        for g, rec in m.tensorrt.items():
            assert rec.profiles == tuple(m.profiles[g]) and (d / rec.plan).stat().st_size > 0
            assert rec.not_refittable == () and set(tb.mapped_trt_names(m, g)) <= set(rec.refittable_weights)
        assert check_engine_folder(d) == [], arch


PROMPTS = [[5, 17, 33, 8], [9, 4], [12, 60, 61, 70, 71, 3]]
GREEDY = SamplingParams(max_new_tokens=6, greedy=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_steps_use_their_profiles(engine_dirs, trt_folders, arch):
    """Prefill on profile 0, one-token decode steps on profile 1; score()'s 3-token chunks fit neither and
    go one token at a time through decode (their values: the parity matrix's tensorrt-stand-in rows)."""
    folders = trt_folders("stand-in")
    eng = folders.open(folders.get(f"{arch}-fp32", engine_dirs[arch]))
    folders.fake.calls.clear()
    a = eng.generate(PROMPTS, GREEDY)
    assert [c for c in folders.fake.calls if c[0] == "profile"][:1] == [("profile", 1)], "first decode step"
    folders.fake.calls.clear()
    eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, chunk_size=3)
    assert ("profile", 0) in folders.fake.calls and ("profile", 1) in folders.fake.calls
    eng.close()


@pytest.mark.parametrize("kind", ["stand-in", pytest.param("tensorrt", marks=GPU_ONLY)])
def test_fp16_engine_refits_from_fp32_tensors(kind, fp16_engine_dir, model_dirs, trt_folders):
    """An fp16 export: FP16 builder flag, fp16 K/V buffers, fp32 HF tensors refitted as fp16; after the
    push the engine scores like the PyTorch reference holding the same tensors."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    folders = trt_folders(kind)
    d = folders.get("tiny-llama-fp16", fp16_engine_dir)
    assert Manifest.read(d).tensorrt["decoder"].precision in ("weak+FP16", "strongly-typed (graph dtypes)")
    trt_eng, ref = folders.open(d), create_engine("torch", model_dirs["tiny-llama"])
    a = ref.generate(PROMPTS, GREEDY)

    def scores(eng):
        return eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask).logprobs

    before = scores(trt_eng)
    g = torch.Generator().manual_seed(5)
    params, _ = canonical_params(load_model(model_dirs["tiny-llama"]))
    # fp32 tensors in; 0.05, not more: larger weights grow the activations and fp16's error with them
    push = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    trt_eng.update_weights(push)
    ref.update_weights(push)
    after = scores(trt_eng)
    assert (after - before).abs().max() > 1e-2, "refit changed nothing"
    tol = ATOL["tensorrt-stand-in" if kind == "stand-in" else "tensorrt"]["fp16"]
    torch.testing.assert_close(after, scores(ref), atol=tol, rtol=0)
    trt_eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_refit_changes_output_and_restores_it(trt_env, model_dirs, arch):
    """The TensorRT refit sample's check: fake weights change the answer, the real ones bring it back."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    trt_eng, ref = trt_env.folders.open(trt_env.dirs[arch]), create_engine("torch", model_dirs[arch])
    params, _ = canonical_params(load_model(model_dirs[arch]))
    real = {n: p.detach().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(3)
    fake = {n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in real.items()}
    base = trt_eng.generate(PROMPTS, GREEDY)
    trt_eng.update_weights(fake)
    ref.update_weights(fake)
    moved, want = trt_eng.generate(PROMPTS, GREEDY), ref.generate(PROMPTS, GREEDY)
    assert (moved.rollout_plain_logprobs - base.rollout_plain_logprobs).abs().max() > 1e-2, "refit changed nothing"
    torch.testing.assert_close(moved.response_ids, want.response_ids, atol=0, rtol=0)
    torch.testing.assert_close(moved.rollout_plain_logprobs, want.rollout_plain_logprobs, atol=trt_env.atol, rtol=0)
    trt_eng.update_weights(real)
    back = trt_eng.generate(PROMPTS, GREEDY)
    assert trt_eng.weights_version == 2 and back.weights_version == 2
    torch.testing.assert_close(back.response_ids, base.response_ids, atol=0, rtol=0)
    torch.testing.assert_close(back.rollout_plain_logprobs, base.rollout_plain_logprobs, atol=trt_env.atol, rtol=0)
    trt_eng.close()


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_lora_policy_refits_its_merged_layers(trt_env, model_dirs, arch, tmp_path):
    """A LoRA run on TensorRT pushes ``W + s B A`` of the targeted layers (a partial refit, the rest of the plans
    untouched; refit.learner.run.sync.push_tensors): the engine then scores as PEFT's model does, the probe
    passes, and it caught the stale engine before the push."""
    from refit.core.hf_folder import load_model
    from refit.learner.run.config import LoraSection
    from refit.learner.run.sync import Contract, WeightSync, push_tensors
    from refit.learner.run.lora import apply_lora

    model = apply_lora(load_model(model_dirs[arch]), LoraSection(r=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    trt_eng = trt_env.folders.open(trt_env.dirs[arch])
    probe = trt_eng.generate(PROMPTS, GREEDY)
    sync = WeightSync(trt_eng, probe, Contract(temperature=1.0, probe_tol=trt_env.atol), tmp_path)
    with pytest.raises(RefitError, match="parity probe failed"):
        sync.check_now(model)
    pushed = push_tensors(model, trt_eng)
    assert pushed and all(n.endswith(".weight") and "lora" not in n for n in pushed)
    trt_eng.update_weights(pushed)
    assert sync.check_now(model) <= trt_env.atol
    trt_eng.close()


def test_update_weights_rejects_bad_pushes(trt_env, model_dirs):
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    trt_eng = trt_env.folders.open(trt_env.dirs["tiny-gpt2"])
    params, _ = canonical_params(load_model(model_dirs["tiny-gpt2"]))
    with pytest.raises(RefitError, match="not engine weights"):
        trt_eng.update_weights({"no.such.weight": torch.zeros(3)})
    name = "transformer.h.0.attn.c_attn.weight"
    with pytest.raises(RefitError, match="expects"):
        trt_eng.update_weights({name: params[name].detach()[:, :5]})
    assert trt_eng.weights_version == 0
    trt_eng.update_weights({"lm_head.weight": params["transformer.wte.weight"].detach()})  # a tied alias
    assert trt_eng.weights_version == 1


def test_partial_push_supplies_fused_weights_or_fails_loudly(engine_dirs, fresh_copy, model_dirs, monkeypatch):
    """Weights TensorRT fused with a pushed one come from the held buffers (set once, refitted with every push); a
    partner the map does not feed -> a loud error before anything is refitted."""
    from refit.rollout.tensorrt.engine import TrtEngine

    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    m = Manifest.read(d)
    q, k = (m.weight_map[f"model.layers.0.self_attn.{x}_proj.weight"][0].engine for x in "qk")
    fake = use_stand_in(monkeypatch, fuse=[{q, k}])
    tb.build_engines(d, log=lambda *_: None)
    eng = TrtEngine(d, device="cpu")
    params = dict(_canonical(model_dirs["tiny-llama"]))
    push = {"model.layers.0.self_attn.q_proj.weight": params["model.layers.0.self_attn.q_proj.weight"] * 2}
    eng.update_weights(push)
    assert fake.calls[-1][0] == "refit" and {q, k} <= set(fake.calls[-1][1]) and eng.weights_version == 1
    torch.testing.assert_close(eng.weights["decoder"][q], push["model.layers.0.self_attn.q_proj.weight"].t(), atol=0,
                               rtol=0)
    fake.fuse.append({q, "an.unmapped.constant"})
    with pytest.raises(RefitError, match="incomplete.*an.unmapped.constant"):
        eng.update_weights(push)
    assert eng.weights_version == 1 and fake.calls[-1][0] == "refit"


def _canonical(model_dir):
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    params, _ = canonical_params(load_model(model_dir))
    return {n: p.detach() for n, p in params.items()}


# ================================================================ int8 through Q/DQ (--backend tensorrt --quantize int8)

@pytest.mark.parametrize("kind", ["stand-in", pytest.param("tensorrt", marks=GPU_ONLY)])
@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_qdq_engine_builds_strongly_typed_and_refits_int8(kind, arch, qdq_engine_dirs, model_dirs, trt_folders):
    """The Q/DQ folder builds as a strongly typed, refittable network whose refit names are the int8 twins and
    their scales; it scores like the dequantized reference; a push of perturbed fp32 tensors is re-quantized and
    refitted (both names), changes the output and matches the reference holding the same tensors. On the stand-in
    (ONNX Runtime under the TrtEngine code paths) this checks our side; on real TensorRT also that TensorRT keeps
    the int8 weights and scales refittable and computes what the graph says."""
    folders = trt_folders(kind)
    d = folders.get(f"{arch}-qdq", qdq_engine_dirs[arch])
    m = Manifest.read(d)
    rec = m.tensorrt["decoder"]
    assert rec.precision == "strongly-typed Q/DQ (int8 weights, fp32 matmuls, TF32 off)" and rec.not_refittable == ()
    twins = m.quantization.weights["decoder"]
    names = set(tb.mapped_trt_names(m, "decoder"))
    assert {t.weight for t in twins.values()} | {t.scale for t in twins.values()} <= names <= set(rec.refittable_weights)
    assert not {k for k, t in twins.items() if not t.keep_float} & names, "a dropped fp32 weight is no refit name"
    assert check_engine_folder(d) == []
    tol = 1e-5 if kind == "stand-in" else ATOL["tensorrt"]["fp32"]
    trt_eng = folders.open(d)
    ref, model = quantized_reference(model_dirs[arch], m)
    a = ref.generate(PROMPTS, GREEDY)

    def scores(eng):
        return eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask).logprobs

    before = scores(trt_eng)
    torch.testing.assert_close(before, scores(ref), atol=tol, rtol=0)
    g = torch.Generator().manual_seed(2)
    params = dict(model.named_parameters())
    push = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    twin = next(iter(twins.values()))
    held = trt_eng.weights["decoder"][twin.weight].clone()
    trt_eng.update_weights(push)
    if folders.fake is not None:
        refitted = folders.fake.calls[-1]
        assert refitted[0] == "refit" and {twin.weight, twin.scale} <= set(refitted[1])
    assert trt_eng.weights["decoder"][twin.weight].dtype == torch.int8
    assert not torch.equal(trt_eng.weights["decoder"][twin.weight].cpu(), held.cpu()), "twin not re-quantized"
    after = scores(trt_eng)
    assert (after - before).abs().max() > 1e-2, "refit changed nothing"
    ref2, _ = quantized_reference(model_dirs[arch], m, push)
    torch.testing.assert_close(after, scores(ref2), atol=tol, rtol=0)
    trt_eng.update_weights({n: p.detach() for n, p in params.items()})
    torch.testing.assert_close(scores(trt_eng), before, atol=tol, rtol=0)
    trt_eng.close()


def test_build_engines_refuses_onnxruntime_int8_folder(qdq_engine_dirs, fresh_copy, monkeypatch):
    """A folder quantized for ONNX Runtime (MatMulInteger) is refused in one line, before anything is built."""
    d = fresh_copy(qdq_engine_dirs["tiny-llama"], "l")
    _edit_manifest(d, lambda m: m["quantization"].__setitem__("scheme", "int8"))
    use_stand_in(monkeypatch)
    with pytest.raises(RefitError, match="quantized for ONNX Runtime .*--backend tensorrt --quantize int8"):
        tb.build_engines(d, log=lambda *_: None)
    assert not list(d.glob("*.plan"))
    assert any("quantized for ONNX Runtime" in p for p in check_engine_folder(d))
