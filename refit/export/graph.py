"""The engine folder's graphs on ONNX Runtime: session creation and weight override.

Weight push (refit) uses ONNX Runtime's ``SessionOptions.add_external_initializers``: every
mapped weight is stored in the graph as *external data*, and a new session over the same
graph file is given the new tensors in their place. The graph is never re-exported. We do
NOT use ``add_initializer`` on a session whose graph already carries the weights: with graph
optimisations on, constant folding through the exporter's transposes can silently keep the
old values (measured on this machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.export.weight_map import byte_view

_TORCH_TO_NP = {"float32": np.float32, "float16": np.float16}


def session_options(threads: int | None = None, opt_level: str = "all", prepack: bool = True):
    """ONNX Runtime session options. ``prepack=False``: no MLAS pre-packing of constant matmul weights; a session
    over a graph's external-data files then maps them from the files (page cache, reclaimable) instead of holding
    packed copies in its own memory. What it costs and where Refit uses it: :class:`refit.rollout.ort_backend.OrtEngine`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    so.graph_optimization_level = levels[opt_level]
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    # No busy-waiting workers between runs: the engine shares its cores with the sampling step,
    # the PyTorch learner and, on a shared box, other jobs: spinning gains a little on an idle box
    # and loses far more beside one busy neighbour process (docs/performance.md).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    return so


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _C_INT_MAX = -1, -3, 2**31 - 1
_heap_kept = False


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (no mmap per large block, no trimming); once per process.

    Opening a session makes ONNX Runtime copy every initializer and pre-pack the MatMul weights
    into fresh allocations (about the model's size again). With glibc's defaults each such block is a
    new mmap, page-faulted in page by page: most of the session open, which every weight push pays.
    The freed blocks of the previous session are reused
    instead. Process-wide: the resident size stays at its peak rather than shrinking after a
    push. Returns False (nothing changed) where the C library is not glibc.
    """
    global _heap_kept
    if _heap_kept:
        return True
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    _heap_kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, _C_INT_MAX)) & bool(libc.mallopt(_M_TRIM_THRESHOLD, _C_INT_MAX))
    return _heap_kept


def installed_distributions() -> set[str]:
    """Names of the installed Python distributions, lower case, ``_``/``.`` as ``-`` (PEP 503)."""
    import importlib.metadata
    import re

    return {re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "").lower()) for d in importlib.metadata.distributions()}


ORT_GPU_HINT = ("pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu (one wheel: the CPU "
                "`onnxruntime` and `onnxruntime-gpu` both install the module `onnxruntime` and cannot be installed "
                "together)")


def default_providers(device: str = "cpu", have: list[str] | None = None, dists: set[str] | None = None) -> list[str]:
    """Execution providers in preference order for ``device`` "cpu" or "cuda" (the two :class:`OrtEngine` runs).

    ``have``: ``onnxruntime.get_available_providers()`` (read when None); ``dists``: installed distributions (read
    when CUDA is missing, to say why: the CPU and GPU wheels installed together leave the CUDA provider out)."""
    if device not in ("cpu", "cuda"):
        raise RefitError(f"onnxruntime: device must be 'cpu' or 'cuda', got {device!r} (TensorRT: --backend tensorrt)")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if have is None:
        import onnxruntime as ort

        have = ort.get_available_providers()
    if "CUDAExecutionProvider" in have:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    dists = installed_distributions() if dists is None else dists
    if {"onnxruntime", "onnxruntime-gpu"} <= dists:
        raise RefitError("onnxruntime has no CUDAExecutionProvider here because both `onnxruntime` and "
                         f"`onnxruntime-gpu` are installed: {ORT_GPU_HINT}")
    raise RefitError(f"onnxruntime has no CUDAExecutionProvider here (available: {', '.join(have)}); on a CUDA "
                     f"machine: {ORT_GPU_HINT}; or use --device cpu")


def ort_value(x):
    """A CPU OrtValue over a numpy array or a CPU torch tensor (bf16 included: numpy has no bf16, so its
    bytes go in as int16 with the ONNX element type BFLOAT16); shares the memory, keep ``x`` alive."""
    import onnxruntime as ort

    if type(x).__module__.startswith("torch"):
        import torch

        x = x.detach().contiguous()
        if x.dtype == torch.bfloat16:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(torch.int16).numpy(), 16)
        x = x.numpy()
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x))


def open_session(graph_path: str | Path, weights: dict[str, np.ndarray] | None = None,
                 threads: int | None = None, providers: list[str] | None = None, opt_level: str = "all",
                 prepack: bool = True):
    """An ``InferenceSession`` over ``graph_path``; ``weights`` replace its external initializers.

    ``weights`` values: numpy arrays or CPU torch tensors (:func:`ort_value`). Returns (session, keepalive). ONNX Runtime copies the supplied buffers into the graph while
    the session opens (``AddExternalInitializers``' documented contract: "the user provided
    buffers can then be deallocated"; measured on 1.32: changing them afterwards changes no
    output), so ``weights`` may change once this returns; ``keepalive`` is the OrtValues.
    """
    import onnxruntime as ort

    so = session_options(threads, opt_level, prepack)
    keep = []
    if weights:
        names = list(weights)
        keep = [ort_value(weights[n]) for n in names]
        so.add_external_initializers(names, keep)
    try:
        sess = ort.InferenceSession(str(graph_path), so, providers=providers or ["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - corrupt/missing graph files become one line
        # ONNX Runtime repeats the path ("Load model from <path> failed:<reason>"); keep the reason
        reason = str(e).splitlines()[0].replace(f"Load model from {graph_path} failed:", "").strip()
        raise RefitError(f"cannot load engine graph {graph_path}: {reason[:300]}") from None
    return sess, keep


ONNX_DTYPE = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int8: 3}  # onnx.TensorProto enums


def write_graph(proto, weights: Mapping[str, torch.Tensor], path: Path) -> None:
    """Put the real weights into ``proto`` and save it with every mapped weight as external data.

    ``weights``: {initializer: tensor}, a dict or a lazy mapping (:class:`refit.export.weight_map.EngineWeightsView`),
    read one tensor at a time and written from the tensor's own memory (no bytes copy); the initializers it names
    may be placeholders (external-data records without data), their dims and dtype are set from the tensor.
    """
    import onnx

    data_name = path.name + ".data"
    offset = 0
    with open(path.parent / data_name, "wb") as f:
        for init in proto.graph.initializer:
            if init.name not in weights:
                continue  # a graph constant (shape, scalar, rotary frequencies): stays inline
            t = weights[init.name]
            raw = byte_view(t)
            pad = (-offset) % 64  # 64-byte alignment lets runtimes map tensors in place
            f.write(b"\0" * pad)
            offset += pad
            f.write(raw.data)
            del init.dims[:]
            init.dims.extend(t.shape)
            init.data_type = ONNX_DTYPE[t.dtype]
            init.ClearField("raw_data")
            for fld in ("float_data", "int32_data", "int64_data", "double_data"):
                init.ClearField(fld)
            del init.external_data[:]
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(raw.nbytes))):
                entry = init.external_data.add()
                entry.key, entry.value = k, v
            init.data_location = onnx.TensorProto.EXTERNAL
            offset += raw.nbytes
            del t, raw
    onnx.save_model(proto, str(path))


def foldable_weights(model, names) -> dict[str, str]:
    """{initializer: first op} for each of ``names`` that a consumer reads with constants only (from the graph alone).

    A node whose inputs are all initializers, ``Constant`` outputs or outputs of such nodes computes a constant: a
    builder may evaluate it once (TensorRT's constant folding) and keep the result, not the initializer, so a refit of
    that initializer would change nothing (TensorRT then drops it from ``Refitter.get_all_weights``). Listed here, by
    the op that reads it: the weights whose path to the first op with a runtime input is constant-only. The Q/DQ
    export's int8 twins and scales are such weights by design (``DequantizeLinear`` of two constants,
    refit/export/quantize.py); a plain export has none. Top-level graph only (the exports have no subgraphs)."""
    const = {t.name for t in model.graph.initializer}
    first: dict[str, str] = {}
    wanted = set(names)
    for node in model.graph.node:  # ONNX nodes are in topological order
        ins = [x for x in node.input if x]
        if node.op_type == "Constant" or (ins and all(x in const for x in ins)):
            const.update(o for o in node.output if o)
            for x in ins:
                if x in wanted:
                    first.setdefault(x, node.op_type)
    return dict(sorted(first.items()))
