"""A host-side stand-in for the ``tensorrt`` module, and engine folders with plans for the tests.

:func:`make_stand_in` implements the TensorRT 10 calls that :mod:`refit.rollout.tensorrt.build`,
:mod:`refit.rollout.tensorrt.engine` and :mod:`refit.rollout.tensorrt.runner` make, on top of ONNX Runtime with host buffers. It checks our side of
the contract (profiles recorded and chosen, shapes inside the chosen profile, I/O by address,
refit by name with missing-weight handling) -- not TensorRT's numerics or its API, which only the
GPU tests can. :class:`TrtFolders` builds plans (stand-in or real TensorRT) into copies of the
session's engine folders on first use, so the parity matrix and the TensorRT tests share them.
"""

from __future__ import annotations

import ctypes
import enum
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from onnx import TensorProto

import refit.rollout.tensorrt.build as tb
from refit.core.manifest_sections import TrtDevice

TRT_REASON = tb.tensorrt_unavailable_reason()  # None where real TensorRT and a GPU are usable


class _DataType(enum.Enum):
    FLOAT, HALF, INT8, INT32, BOOL, UINT8, BF16, INT64 = range(8)


_ONNX_DT = {1: _DataType.FLOAT, 10: _DataType.HALF, 7: _DataType.INT64, 6: _DataType.INT32, 9: _DataType.BOOL,
            3: _DataType.INT8, 16: _DataType.BF16}
# bf16: numpy has none; its bytes are read as ml_dtypes.bfloat16 (what onnx.numpy_helper gives a bf16 initializer)
_NP_DT = {_DataType.FLOAT: np.float32, _DataType.HALF: np.float16, _DataType.INT64: np.int64,
          _DataType.INT32: np.int32, _DataType.BOOL: np.bool_, _DataType.INT8: np.int8, _DataType.BF16: ml_dtypes.bfloat16}
ALIGN = 256  # IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment." (NvInferRuntime.h)


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
        self.flags, self.profiles = {"TF32"}, []  # kTF32: "Enabled by default" (NvInfer.h, BuilderFlag)

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
        return SimpleNamespace(onnx=None, flags=flags)

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        assert "REFIT" in config.flags
        graph = onnx.load(network.onnx, load_external_data=False).graph
        if any(n.op_type == "DequantizeLinear" for n in graph.node):  # explicit quantization: strongly typed,
            assert network.flags & 1, "a Q/DQ network must be strongly typed"  # no precision flags (TRT 10 guide)
            assert not config.flags & {"FP16", "BF16", "INT8"}, config.flags
        inputs = [i.name for i in graph.input]
        if not config.profiles or any(set(p) != set(inputs) for p in config.profiles):
            return None  # TensorRT refuses a dynamic input without a profile shape
        return json.dumps({"onnx": network.onnx, "profiles": config.profiles, "flags": sorted(config.flags),
                           "strongly_typed": bool(network.flags & 1)}).encode()


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
        self.flags, self.strongly_typed = set(plan["flags"]), plan["strongly_typed"]
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
        from refit.export.graph import open_session

        if self.session is None:  # a Q/DQ graph as its ops say (refit/rollout/ort_backend.py: no MatMulNBits fusion)
            qdq = any(isinstance(w, np.ndarray) and w.dtype == np.int8 for w in self.weights.values())
            self.session = open_session(self.path, self.weights, opt_level="basic" if qdq else "all")[0]
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
        """Refuses (False, and forgets the name's address) a pointer without TensorRT's 256-byte alignment."""
        self.e.state.addresses.append(ptr)
        if ptr % ALIGN:
            self.addr.pop(n, None)
            return False
        self.addr[n] = ptr
        return True

    def _compute(self):
        if self.result is None:
            feeds = {n: _read(self.addr[n], s, _NP_DT[self.e.io[n][1]]) for n, s in self.shapes.items()}
            self.result = self.e.run(feeds)
        return self.result

    def _bound(self) -> bool:
        return all(n in self.addr for n in self.shapes) and all(n in self.addr for n, (m, _) in self.e.io.items()
                                                                 if m == "OUTPUT")

    def get_tensor_shape(self, n):
        return self.shapes[n] if self.e.io[n][0] == "INPUT" else self._compute()[n].shape

    def execute_async_v3(self, stream):
        if not self._bound():  # TensorRT: "each input must have a non-null address"
            return False
        for n, arr in self._compute().items():
            arr = np.ascontiguousarray(arr)
            ctypes.memmove(self.addr[n], arr.ctypes.data, arr.nbytes)
        self.result = None
        return True


class _Refitter:
    """Refit by name; weights in a ``fuse`` group are reported missing unless all are set. As TensorRT's, a set
    weight stays set (its memory is read at each refit) until unset."""

    def __init__(self, engine, logger):
        self.e, self.pending, self.weights_validation = engine, {}, True
        engine.state.refitters.append(self)

    def get_all_weights(self):
        return list(self.e.refittable)

    def get_weights_prototype(self, n):
        self.e.state.prototypes += 1
        return _Weights(self._dtype(n), 0, self.e.weights[n].size)

    def _dtype(self, n):
        return {np.dtype(v): k for k, v in _NP_DT.items()}[self.e.weights[n].dtype]

    def set_named_weights(self, n, w, location="HOST"):
        assert location == "HOST", "host buffers only in the stand-in"
        if n not in self.e.refittable or w.size != self.e.weights[n].size or w.dtype != self._dtype(n):
            return False
        self.pending[n] = (w.ptr, _NP_DT[w.dtype])
        return True

    def unset_named_weights(self, n):
        return self.pending.pop(n, None) is not None

    def get_missing_weights(self):
        return sorted({m for g in self.e.state.fuse if g & set(self.pending) for m in g} - set(self.pending))

    def refit_cuda_engine_async(self, stream):
        if self.get_missing_weights():
            return False
        self.e.state.calls.append(("refit", sorted(self.pending), self.weights_validation))
        self.e.weights.update({n: _read(p, self.e.weights[n].shape, dt) for n, (p, dt) in self.pending.items()})
        self.e.session = None
        return True


def make_stand_in(fold: set[str] = frozenset(), fuse: list[set[str]] = ()):
    """A ``tensorrt``-shaped namespace whose plans run on ONNX Runtime with host buffers.

    ``fold``: weight names the "builder" makes non-refittable (constant-folded). ``fuse``: groups
    of weights the refitter reports missing unless all are set together. ``calls`` records
    profile switches and refits (``("refit", names, weights_validation)``); ``addresses`` every tensor address
    bound; ``refitters`` every Refitter made; ``prototypes`` the prototype look-ups.
    """
    ns = SimpleNamespace
    trt = ns(__version__="10.0.0-stand-in", HOST_EXECUTION=True, DataType=_DataType, fold=set(fold),
             fuse=[set(g) for g in fuse], calls=[], addresses=[], refitters=[], prototypes=0, Logger=_Logger, Weights=_Weights, Builder=_Builder,
             OnnxParser=_OnnxParser, Refitter=_Refitter,
             BuilderFlag=ns(FP16="FP16", BF16="BF16", REFIT="REFIT", TF32="TF32"),
             NetworkDefinitionCreationFlag=ns(STRONGLY_TYPED=0), MemoryPoolType=ns(WORKSPACE="WORKSPACE"),
             TensorIOMode=ns(INPUT="INPUT", OUTPUT="OUTPUT"), TensorLocation=ns(DEVICE="DEVICE", HOST="HOST"))
    trt.Runtime = lambda logger: ns(deserialize_cuda_engine=lambda plan: _Engine(trt, json.loads(bytes(plan))))
    return trt


def use_stand_in(monkeypatch, fake=None, **kw):
    """Patch ``fake`` (or a new :func:`make_stand_in`) in as the ``tensorrt`` module; returns it."""
    fake = fake or make_stand_in(**kw)
    monkeypatch.setattr(tb, "require_tensorrt", lambda: fake)
    monkeypatch.setattr(tb, "_device", lambda: TrtDevice(name="stand-in", compute_capability="0.0"))
    return fake


class TrtFolders:
    """Engine folders with TensorRT plans of one ``kind``: "stand-in" (host, device cpu) or "tensorrt".

    :meth:`get` copies an ONNX engine folder and builds its plans on first use; :meth:`open` opens a
    ``TrtEngine`` on one. The stand-in is patched in only while building and opening, so no other
    test ever sees it; an opened engine keeps its own reference to it.
    """

    def __init__(self, kind: str, root: Path):
        if kind == "tensorrt" and TRT_REASON is not None:
            pytest.skip(TRT_REASON)
        self.kind, self.root, self._dirs = kind, root, {}
        self.fake = make_stand_in() if kind == "stand-in" else None
        self.device = "cpu" if self.fake is not None else "cuda"

    def get(self, name: str, onnx_dir: Path) -> Path:
        if name not in self._dirs:
            d = self.root / name
            shutil.copytree(onnx_dir, d)
            with pytest.MonkeyPatch.context() as mp:
                if self.fake is not None:
                    use_stand_in(mp, self.fake)
                tb.build_engines(d, workspace_gb=1.0, log=lambda *_: None)
            self._dirs[name] = d
        return self._dirs[name]

    def open(self, engine_dir: Path):
        from refit.rollout.engine import create_engine

        with pytest.MonkeyPatch.context() as mp:
            if self.fake is not None:
                mp.setattr(tb, "require_tensorrt", lambda: self.fake)
            return create_engine("tensorrt", engine_dir, device=self.device)
