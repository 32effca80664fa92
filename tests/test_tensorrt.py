"""TensorRT: CPU-side engine-folder checks, the build/refit/backend plumbing, and the GPU tests.

Three layers, split by cost (STYLE.md):

1. CPU, always: :mod:`export.trt_check` on the tiny engines and on planted faults (an op the
   parser lacks, an anonymous or uncovered dimension, a missing or doubled weight mapping), and
   the one-line failures where TensorRT is absent.
2. CPU, always: ``build_engines`` and ``TrtEngine`` driven through a *stand-in* ``tensorrt``
   module (:func:`make_stand_in`) that implements the TensorRT 10 calls they make on top of
   ONNX Runtime with host buffers. It checks our side of the contract (profiles recorded and
   chosen, shapes inside the chosen profile, I/O by address, refit by name with missing-weight
   handling) -- not TensorRT's numerics or its API, which only the GPU layer can.
3. ``tensorrt``/``gpu`` markers: the same parity and refit tests on real TensorRT plans; they
   skip with the reason where TensorRT or a CUDA device is absent.
"""

from __future__ import annotations

import ctypes
import enum
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from onnx import TensorProto, helper

import export.tensorrt_build as tb
from export.errors import RefitError
from export.manifest import Manifest, TrtDevice
from export.trt_check import check_engine_folder, check_ops, check_profiles, check_weight_map

ARCHS = ["tiny-gpt2", "tiny-llama", "tiny-t5"]
TRT_REASON = tb.tensorrt_unavailable_reason()


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
    ok = subprocess.run([sys.executable, "-m", "export.trt_check", str(engine_dirs["tiny-t5"])],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "ok" in ok.stdout.splitlines()[-1], ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-m", "export.trt_check", str(tmp_path / "missing")],
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
    from rollout.trt_backend import TrtEngine

    assert "tensorrt" not in sys.modules, "importing the backend module must not import tensorrt"
    with pytest.raises(RefitError, match="TensorRT"):
        TrtEngine("/nonexistent")


@pytest.mark.skipif(TRT_REASON is None, reason="TensorRT and a GPU are present: export would succeed")
def test_export_backend_tensorrt_fails_fast_and_leaves_nothing(model_dirs, tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "learner.cli", "export", str(model_dirs["tiny-gpt2"]), "-o", str(out),
                        "--backend", "tensorrt"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "TensorRT" in lines[0] and "pip install refit[gpu]" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert time.perf_counter() - t0 < 60, "should fail before exporting anything"


# ================================================================ 2. a host-side TensorRT stand-in

class _DataType(enum.Enum):
    FLOAT, HALF, INT8, INT32, BOOL, UINT8, BF16, INT64 = range(8)


_ONNX_DT = {1: _DataType.FLOAT, 10: _DataType.HALF, 7: _DataType.INT64, 6: _DataType.INT32, 9: _DataType.BOOL}
_NP_DT = {_DataType.FLOAT: np.float32, _DataType.HALF: np.float16, _DataType.INT64: np.int64,
          _DataType.INT32: np.int32, _DataType.BOOL: np.bool_}


def _read(ptr: int, shape, dt) -> np.ndarray:
    """A copy of the host buffer at ``ptr`` (what TensorRT reads from a tensor address)."""
    n = int(np.prod(shape)) * np.dtype(dt).itemsize
    if n == 0:
        return np.zeros(shape, dt)
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dt).reshape(shape).copy()


class _Logger:
    WARNING, INFO, ERROR = "W", "I", "E"

    def __init__(self, severity="W"):
        pass


class _Weights:
    def __init__(self, dtype, ptr=0, count=0):
        self.dtype, self.ptr, self.size = dtype, ptr, count


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        self.shapes[name] = [list(lo), list(opt), list(hi)]


class _Config:
    def __init__(self):
        self.flags, self.profiles = set(), []

    def set_memory_pool_limit(self, pool, size):
        assert pool == "WORKSPACE" and size > 0

    def set_flag(self, f):
        self.flags.add(f)

    def clear_flag(self, f):
        self.flags.discard(f)

    def add_optimization_profile(self, p):
        self.profiles.append(p.shapes)
        return len(self.profiles) - 1


class _Builder:
    def __init__(self, logger):
        pass

    def create_network(self, flags):
        return SimpleNamespace(onnx=None)

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        assert "REFIT" in config.flags
        inputs = [i.name for i in onnx.load(network.onnx, load_external_data=False).graph.input]
        if not config.profiles or any(set(p) != set(inputs) for p in config.profiles):
            return None  # TensorRT refuses a dynamic input without a profile shape
        return json.dumps({"onnx": network.onnx, "profiles": config.profiles}).encode()


class _OnnxParser:
    num_errors = 0

    def __init__(self, network, logger):
        self.network = network

    def parse_from_file(self, path):
        self.network.onnx = path
        return True


class _Engine:
    """A "plan": the ONNX graph run by ONNX Runtime with the engine's current weights."""

    def __init__(self, state, plan: dict):
        self.state, self.path, self.profiles = state, plan["onnx"], plan["profiles"]
        model = onnx.load(self.path, load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
        full = onnx.load(self.path)  # with the external bytes: the values the plan is "built" with
        self.weights = {t.name: onnx.numpy_helper.to_array(t) for t in full.graph.initializer if t.name in external}
        self.io = {v.name: ("INPUT", _ONNX_DT[v.type.tensor_type.elem_type]) for v in model.graph.input
                   if v.name not in inits}
        self.io.update({v.name: ("OUTPUT", _ONNX_DT[v.type.tensor_type.elem_type]) for v in model.graph.output})
        self.names = list(self.io)
        self.num_io_tensors, self.num_optimization_profiles = len(self.names), len(self.profiles)
        self.refittable = sorted(set(self.weights) - set(state.fold))
        self.session = None

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, n):
        return self.io[n][0]

    def get_tensor_dtype(self, n):
        return self.io[n][1]

    def run(self, feeds):
        from export.graph import open_session

        if self.session is None:
            self.session = open_session(self.path, self.weights)[0]
        outs = [o.name for o in self.session.get_outputs()]
        return dict(zip(outs, self.session.run(outs, feeds)))

    def create_execution_context(self):
        return _Context(self)


class _Context:
    """Checks what TensorRT checks: each input shape inside the current profile's [min, max]."""

    def __init__(self, engine):
        self.e, self.profile, self.shapes, self.addr, self.result = engine, 0, {}, {}, None

    def set_optimization_profile_async(self, i, stream):
        self.e.state.calls.append(("profile", i))
        self.profile = i
        return True

    def set_input_shape(self, n, shape):
        lo, _, hi = self.e.profiles[self.profile][n]
        self.shapes[n], self.result = tuple(shape), None
        return len(shape) == len(lo) and all(a <= d <= b for d, a, b in zip(shape, lo, hi))

    def set_tensor_address(self, n, ptr):
        self.addr[n] = ptr

    def _compute(self):
        if self.result is None:
            feeds = {n: _read(self.addr[n], s, _NP_DT[self.e.io[n][1]]) for n, s in self.shapes.items()}
            self.result = self.e.run(feeds)
        return self.result

    def get_tensor_shape(self, n):
        return self.shapes[n] if self.e.io[n][0] == "INPUT" else self._compute()[n].shape

    def execute_async_v3(self, stream):
        for n, arr in self._compute().items():
            arr = np.ascontiguousarray(arr)
            ctypes.memmove(self.addr[n], arr.ctypes.data, arr.nbytes)
        self.result = None
        return True


class _Refitter:
    """Refit by name; weights in a ``fuse`` group are reported missing unless all are set."""

    def __init__(self, engine, logger):
        self.e, self.pending = engine, {}

    def get_all_weights(self):
        return list(self.e.refittable)

    def get_weights_prototype(self, n):
        w = self.e.weights[n]
        return _Weights({np.float32: _DataType.FLOAT, np.float16: _DataType.HALF}[w.dtype.type], 0, w.size)

    def set_named_weights(self, n, w, location="HOST"):
        assert location == "HOST", "host buffers only in the stand-in"
        if n not in self.e.refittable or w.size != self.e.weights[n].size:
            return False
        self.pending[n] = _read(w.ptr, self.e.weights[n].shape, _NP_DT[w.dtype])
        return True

    def get_missing_weights(self):
        return sorted({m for g in self.e.state.fuse if g & set(self.pending) for m in g} - set(self.pending))

    def refit_cuda_engine_async(self, stream):
        if self.get_missing_weights():
            return False
        self.e.state.calls.append(("refit", sorted(self.pending)))
        self.e.weights.update(self.pending)
        self.e.session, self.pending = None, {}
        return True


def make_stand_in(fold: set[str] = frozenset(), fuse: list[set[str]] = ()):
    """A ``tensorrt``-shaped namespace whose plans run on ONNX Runtime with host buffers.

    ``fold``: weight names the "builder" makes non-refittable (constant-folded). ``fuse``: groups
    of weights the refitter reports missing unless all are set together. ``calls`` records
    profile switches and refits.
    """
    ns = SimpleNamespace
    trt = ns(__version__="10.0.0-stand-in", HOST_EXECUTION=True, DataType=_DataType, fold=set(fold),
             fuse=[set(g) for g in fuse], calls=[], Logger=_Logger, Weights=_Weights, Builder=_Builder,
             OnnxParser=_OnnxParser, Refitter=_Refitter,
             BuilderFlag=ns(FP16="FP16", BF16="BF16", REFIT="REFIT", TF32="TF32"),
             NetworkDefinitionCreationFlag=ns(STRONGLY_TYPED=0), MemoryPoolType=ns(WORKSPACE="WORKSPACE"),
             TensorIOMode=ns(INPUT="INPUT", OUTPUT="OUTPUT"), TensorLocation=ns(DEVICE="DEVICE", HOST="HOST"))
    trt.Runtime = lambda logger: ns(deserialize_cuda_engine=lambda plan: _Engine(trt, json.loads(bytes(plan))))
    return trt


def _use_stand_in(monkeypatch, **kw):
    fake = make_stand_in(**kw)
    monkeypatch.setattr(tb, "require_tensorrt", lambda: fake)
    monkeypatch.setattr(tb, "_device", lambda: TrtDevice(name="stand-in", compute_capability="0.0"))
    return fake


def test_build_engines_records_plans_and_profiles(engine_dirs, fresh_copy, monkeypatch):
    _use_stand_in(monkeypatch)
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
    _use_stand_in(monkeypatch, fold={folded})
    with pytest.raises(RefitError, match=f"constant-folded 1 mapped weights of decoder.*{folded}"):
        tb.build_engines(d, log=lambda *_: None)
    assert Manifest.read(d).tensorrt is None and not list(d.glob("*plan*")) and not list(d.glob(".*"))
    recs = tb.build_engines(d, strict=False, log=lambda *_: None)
    assert recs["decoder"].not_refittable == (folded,)
    assert any("not refittable" in p for p in check_engine_folder(d))


# ================================================================ 2+3. backend parity and refit

@pytest.fixture(scope="module", params=["stand-in", pytest.param("tensorrt", marks=[pytest.mark.tensorrt,
                                                                                     pytest.mark.gpu])])
def trt_env(request, engine_dirs, tmp_path_factory):
    """Engine folders with plans: built by the stand-in (device cpu) or by real TensorRT (cuda).

    The stand-in is patched in only while building here and while opening an engine in
    :func:`_engines`, so no other test of the module ever sees it.
    """
    fake = None
    if request.param == "tensorrt" and TRT_REASON is not None:
        pytest.skip(TRT_REASON)
    root = tmp_path_factory.mktemp(f"trt-{request.param}")
    dirs = {}
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "stand-in":
            fake = _use_stand_in(mp)
        for arch in ARCHS:
            dirs[arch] = root / arch
            shutil.copytree(engine_dirs[arch], dirs[arch])
            tb.build_engines(dirs[arch], workspace_gb=1.0, log=lambda *_: None)
    return SimpleNamespace(kind=request.param, dirs=dirs, device="cpu" if fake else "cuda", fake=fake,
                           atol=1e-5 if fake else 1e-3)


def test_built_engines_are_refittable(trt_env):
    for arch, d in trt_env.dirs.items():
        m = Manifest.read(d)
        for g, rec in m.tensorrt.items():
            assert rec.profiles == tuple(m.profiles[g]) and (d / rec.plan).stat().st_size > 0
            assert rec.not_refittable == () and set(tb.mapped_trt_names(m, g)) <= set(rec.refittable_weights)
        assert check_engine_folder(d) == [], arch


def _engines(env, arch):
    from rollout.engine import create_engine

    with pytest.MonkeyPatch.context() as mp:
        if env.fake is not None:
            mp.setattr(tb, "require_tensorrt", lambda: env.fake)
        trt_eng = create_engine("tensorrt", env.dirs[arch], device=env.device)
    return trt_eng, create_engine("onnxruntime", env.dirs[arch])


PROMPTS = [[5, 17, 33, 8], [9, 4], [12, 60, 61, 70, 71, 3]]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_onnxruntime(trt_env, arch):
    from rollout.types import SamplingParams

    trt_eng, ort_eng = _engines(trt_env, arch)
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    a, b = trt_eng.generate(PROMPTS, sp), ort_eng.generate(PROMPTS, sp)
    torch.testing.assert_close(a.response_ids, b.response_ids, atol=0, rtol=0)
    torch.testing.assert_close(a.rollout_plain_logprobs, b.rollout_plain_logprobs, atol=trt_env.atol, rtol=0)
    # score() feeds 3-token chunks through the cache: no profile takes them, so one token at a time
    s_t = trt_eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, chunk_size=3)
    s_o = ort_eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, chunk_size=3)
    torch.testing.assert_close(s_t.logprobs, s_o.logprobs, atol=trt_env.atol, rtol=0)
    if trt_env.fake is not None:  # prefill ran on profile 0, decode steps switched to profile 1
        assert ("profile", 1) in trt_env.fake.calls and ("profile", 0) in trt_env.fake.calls
    trt_eng.close()


@pytest.mark.parametrize("kind", ["stand-in", pytest.param("tensorrt", marks=[pytest.mark.tensorrt, pytest.mark.gpu])])
def test_fp16_engine_matches_onnxruntime(kind, model_dirs, tmp_path, monkeypatch):
    """An fp16 export: FP16 builder flag, fp16 K/V buffers, fp32 HF tensors refitted as fp16."""
    from export.checkpoint import load_model
    from export.onnx_export import ExportOptions, export_onnx
    from export.weight_map import canonical_params
    from rollout.engine import create_engine
    from rollout.types import SamplingParams

    if kind == "tensorrt" and TRT_REASON is not None:
        pytest.skip(TRT_REASON)
    if kind == "stand-in":
        _use_stand_in(monkeypatch)
    d = export_onnx(model_dirs["tiny-llama"], tmp_path / "fp16", ExportOptions(dtype="fp16", max_batch=8, max_len=64),
                    log=lambda *_: None)
    recs = tb.build_engines(d, workspace_gb=1.0, log=lambda *_: None)
    assert recs["decoder"].precision in ("weak+FP16", "strongly-typed (graph dtypes)")
    trt_eng = create_engine("tensorrt", d, device="cpu" if kind == "stand-in" else "cuda")
    ort_eng = create_engine("onnxruntime", d)
    a = ort_eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    # fp16 rounding: score() runs ORT in one chunk, the TensorRT engine one token at a time
    atol = 5e-3 if kind == "stand-in" else 5e-2

    def same_scores():
        s_t = trt_eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask)
        s_o = ort_eng.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask)
        torch.testing.assert_close(s_t.logprobs, s_o.logprobs, atol=atol, rtol=0)
        return s_t.logprobs

    before = same_scores()
    g = torch.Generator().manual_seed(5)
    params, _ = canonical_params(load_model(model_dirs["tiny-llama"]))
    push = {n: p.detach() + 0.2 * torch.randn(p.shape, generator=g) for n, p in params.items()}  # fp32 in
    trt_eng.update_weights(push)
    ort_eng.update_weights(push)
    assert (same_scores() - before).abs().max() > 1e-2
    trt_eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_refit_changes_output_and_restores_it(trt_env, model_dirs, arch):
    """The TensorRT refit sample's check: fake weights change the answer, the real ones bring it back."""
    from export.checkpoint import load_model
    from export.weight_map import canonical_params
    from rollout.types import SamplingParams

    trt_eng, ort_eng = _engines(trt_env, arch)
    params, _ = canonical_params(load_model(model_dirs[arch]))
    real = {n: p.detach().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(3)
    fake = {n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in real.items()}
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    base = trt_eng.generate(PROMPTS, sp)
    trt_eng.update_weights(fake)
    ort_eng.update_weights(fake)
    moved, ref = trt_eng.generate(PROMPTS, sp), ort_eng.generate(PROMPTS, sp)
    assert (moved.rollout_plain_logprobs - base.rollout_plain_logprobs).abs().max() > 1e-2, "refit changed nothing"
    torch.testing.assert_close(moved.response_ids, ref.response_ids, atol=0, rtol=0)
    torch.testing.assert_close(moved.rollout_plain_logprobs, ref.rollout_plain_logprobs, atol=trt_env.atol, rtol=0)
    trt_eng.update_weights(real)
    back = trt_eng.generate(PROMPTS, sp)
    assert trt_eng.weights_version == 2 and back.weights_version == 2
    torch.testing.assert_close(back.response_ids, base.response_ids, atol=0, rtol=0)
    torch.testing.assert_close(back.rollout_plain_logprobs, base.rollout_plain_logprobs, atol=trt_env.atol, rtol=0)
    trt_eng.close()


def test_update_weights_rejects_bad_pushes(trt_env, model_dirs):
    from export.checkpoint import load_model
    from export.weight_map import canonical_params

    trt_eng, _ = _engines(trt_env, "tiny-gpt2")
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
    """Weights TensorRT fused with a pushed one come from the held set; none held -> a loud error."""
    from export.checkpoint import load_model
    from export.weight_map import canonical_params
    from rollout.trt_backend import TrtEngine

    d = fresh_copy(engine_dirs["tiny-llama"], "l")
    m = Manifest.read(d)
    q, k = (m.weight_map[f"model.layers.0.self_attn.{x}_proj.weight"][0].engine for x in "qk")
    fake = _use_stand_in(monkeypatch, fuse=[{q, k}])
    tb.build_engines(d, log=lambda *_: None)
    eng = TrtEngine(d, device="cpu")
    params, _ = canonical_params(load_model(model_dirs["tiny-llama"]))
    push = {"model.layers.0.self_attn.q_proj.weight": params["model.layers.0.self_attn.q_proj.weight"].detach() * 2}
    eng.update_weights(push)
    assert fake.calls[-1] == ("refit", sorted([q, k])) and eng.weights_version == 1
    del eng.weights["decoder"][k]
    with pytest.raises(RefitError, match=f"incomplete.*{k}"):
        eng.update_weights(push)
    assert eng.weights_version == 1
