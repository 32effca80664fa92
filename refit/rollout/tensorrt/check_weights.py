"""The weight checks of an engine folder: what a refit will write, checked on the ONNX graphs and the manifest.

- :func:`check_weight_map`: every external (refittable) initializer is fed by exactly one weight-map entry, and
  every entry names an initializer of the right shape and dtype; on a quantized folder (``--backend tensorrt
  --quantize int8``) an entry of a quantized weight feeds its int8 twin and its scale (the ``quantization``
  record), each once;
- :func:`check_qdq`: the Q/DQ graph: every ``DequantizeLinear`` reads an int8 constant (a twin of the record) and a
  float scale of one value per output column on ``axis=1``, no zero point, and feeds the weight input of a
  MatMul / Gemm (``transB=0``); every twin has one;
- :func:`check_foldable`: no mapped weight (Q/DQ twins aside) is read by a constant-only op TensorRT may fold.

HF shapes come from the source checkpoint's safetensors headers (:func:`checkpoint_shapes`).
:mod:`refit.rollout.tensorrt.check` runs these with the graph checks on a folder.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from refit.core.manifest import Manifest
from refit.export.graph import foldable_weights
from refit.export.quantize import QDQ
from refit.rollout.tensorrt.build import mapped_trt_names, quantized_twins
from refit.rollout.tensorrt.check_graph import graph_name, load_graph

_ONNX_ELEM = {"fp32": 1, "fp16": 10, "bf16": 16}  # onnx.TensorProto enums of the manifest dtype
_INT8 = 3  # onnx.TensorProto.INT8


# --------------------------------------------------------------------------------- weight map

def checkpoint_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]] | None:
    """HF tensor shapes from the source checkpoint's safetensors headers (no data read), or None."""
    src = manifest.source_model
    files = sorted(Path(src).glob("*.safetensors")) if src and Path(src).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    for alias, canon in manifest.tied.items():  # a tied tensor may be stored once
        if canon not in shapes and alias in shapes:
            shapes[canon] = shapes[alias]
    return shapes


def _engine_shape(hf_shape: tuple[int, ...], transform: str) -> tuple[int, ...] | None:
    if transform in ("identity", "affine"):  # affine: elementwise scale * w + shift, same shape
        return tuple(hf_shape)
    if transform == "transpose" and len(hf_shape) == 2:
        return tuple(reversed(hf_shape))
    return None


def check_weight_map(manifest: Manifest, onnx_path: str | Path, graph: str | None = None,
                     hf_shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Problems with the HF -> engine weight map of one graph (empty list: 1:1 and shape-true).

    Every external initializer (what refit rewrites) must be the target of exactly one map
    entry; every entry must name an initializer of this graph, in the manifest dtype, whose
    shape is the HF tensor's after the entry's transform. HF shapes come from ``hf_shapes`` or
    the source checkpoint's safetensors headers; without either, entries of one HF tensor are
    only checked against each other.
    """
    import onnx

    graph = graph_name(manifest, onnx_path, graph)
    model = load_graph(onnx_path)
    inits = {t.name: t for t in model.graph.initializer}
    external = {n for n, t in inits.items() if t.data_location == onnx.TensorProto.EXTERNAL}
    if hf_shapes is None:
        hf_shapes = checkpoint_shapes(manifest) or {}
    want_type = _ONNX_ELEM.get(manifest.dtype)
    twins = quantized_twins(manifest, graph)
    problems, owners = [], Counter()
    for hf_name, targets in manifest.weight_map.items():
        implied = set()
        for t in targets:
            if t.graph != graph:
                continue
            where = f"{graph}: {hf_name} -> {t.engine}"
            tw = twins.get(t.engine)
            if tw is not None:  # the int8 twin and its scale are what a push writes (refit/export/quantize.py)
                owners[tw.weight] += 1
                owners[tw.scale] += 1
                twin_shape, twin_problems = _check_twin(where, tw, inits, external)
                problems += twin_problems
                if not tw.keep_float:
                    if t.engine in inits:
                        problems.append(f"{where}: quantized, yet the fp32 initializer is still in the graph")
                    if twin_shape is None:
                        continue
                    shape = twin_shape if tw.layout == "kn" else tuple(reversed(twin_shape))  # the fp32 layout
                    problems += _check_shape(where, hf_name, t.transform, shape, hf_shapes)
                    implied.add(tuple(reversed(shape)) if t.transform == "transpose" else shape)
                    continue
            owners[t.engine] += 1
            init = inits.get(t.engine)
            if init is None:
                problems.append(f"{where}: no such initializer in the graph")
                continue
            if t.engine not in external:
                problems.append(f"{where}: initializer is inline, not external data (refit cannot replace it)")
            want = _ONNX_ELEM.get(t.stored_dtype) if t.stored_dtype else want_type  # a target kept in its own dtype
            if want is not None and init.data_type != want:
                problems.append(f"{where}: dtype {onnx.TensorProto.DataType.Name(init.data_type)}, manifest says "
                                f"{t.stored_dtype or manifest.dtype}")
            shape = tuple(init.dims)
            if t.transform not in ("identity", "transpose", "affine"):
                problems.append(f"{where}: unknown transform {t.transform!r}")
                continue
            implied.add(tuple(reversed(shape)) if t.transform == "transpose" else shape)
            problems += _check_shape(where, hf_name, t.transform, shape, hf_shapes)
        if len(implied) > 1:
            problems.append(f"{graph}: {hf_name} maps to initializers of incompatible shapes {sorted(implied)}")
    for name in sorted(external):
        n = owners.get(name, 0)
        if n != 1:
            problems.append(f"{graph}: external initializer {name} is the target of {n} weight-map entries (want 1)")
    problems += [f"{graph}: weight-map target {n} is listed {c} times" for n, c in owners.items()
                 if c > 1 and n not in external]
    return problems


def _check_shape(where: str, hf_name: str, transform: str, shape: tuple, hf_shapes: dict) -> list[str]:
    if hf_name not in hf_shapes:
        return []
    exp = _engine_shape(hf_shapes[hf_name], transform)
    if exp == shape:
        return []
    return [f"{where}: shape {list(shape)}, HF {list(hf_shapes[hf_name])} after {transform} gives "
            f"{list(exp) if exp else 'nothing'}"]


def _check_twin(where: str, tw, inits: dict, external: set) -> tuple[tuple | None, list[str]]:
    """(the int8 twin's (K, N) shape or None, problems): an external int8 2-D initializer and an external float32
    scale of N values."""
    problems = []
    q, s = inits.get(tw.weight), inits.get(tw.scale)
    if q is None or s is None:
        missing = [n for n, i in ((tw.weight, q), (tw.scale, s)) if i is None]
        return None, [f"{where}: quantized twin {missing} not in the graph"]
    for n in (tw.weight, tw.scale):
        if n not in external:
            problems.append(f"{where}: {n} is inline, not external data (refit cannot replace it)")
    if q.data_type != _INT8 or len(q.dims) != 2:
        problems.append(f"{where}: twin {tw.weight} must be a 2-D int8 initializer, got type {q.data_type} dims "
                        f"{list(q.dims)}")
        return None, problems
    if s.data_type != 1 or tuple(s.dims) != (q.dims[1],):
        problems.append(f"{where}: scale {tw.scale} must be float32 [{q.dims[1]}] (one per output column), got "
                        f"type {s.data_type} dims {list(s.dims)}")
    return tuple(q.dims), problems


def check_qdq(manifest: Manifest, onnx_path: str | Path, graph: str | None = None) -> list[str]:
    """Problems with a quantized graph's Q/DQ structure (empty list: none, or not quantized).

    A folder quantized for ONNX Runtime (MatMulInteger) is one TensorRT cannot build. In the Q/DQ scheme every
    ``DequantizeLinear`` must read an int8 initializer that is one twin of the quantization record, with a float
    scale initializer of ``dims[axis]`` values on ``axis=1`` (per output column of the (K, N) twin) and no zero
    point; its output must be the weight input (B) of MatMul / Gemm nodes only (Gemm ``transB=0``: the twin is
    (K, N)); and every twin of the record must have exactly one such node."""
    q = manifest.quantization
    if q is None:
        return []
    graph = graph_name(manifest, onnx_path, graph)
    if q.scheme != QDQ:
        return [f"{graph}: quantized for ONNX Runtime ({q.scheme}: MatMulInteger); TensorRT builds the {QDQ} "
                "scheme (export with --backend tensorrt --quantize int8)"]
    model = load_graph(onnx_path)
    inits = {t.name: t for t in model.graph.initializer}
    twins = {tw.weight: tw for tw in q.weights.get(graph, {}).values()}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for i, x in enumerate(node.input):
            readers.setdefault(x, []).append((node, i))
    problems, seen = [], Counter()
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        where = f"{graph}: DequantizeLinear {node.name or node.output[0]}"
        w, scale = node.input[0], (node.input[1] if len(node.input) > 1 else "")
        seen[w] += 1
        tw = twins.get(w)
        if tw is None:
            problems.append(f"{where}: reads {w}, which is no quantized weight of the record (a push would miss it)")
            continue
        if scale != tw.scale:
            problems.append(f"{where}: scale {scale!r}, the record says {tw.scale}")
        if len(node.input) > 2 and node.input[2]:
            problems.append(f"{where}: has a zero point; the scheme is symmetric (TensorRT wants none or zero)")
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        qi, si = inits.get(w), inits.get(scale)
        if qi is None or qi.data_type != _INT8:
            problems.append(f"{where}: input {w} is not an int8 initializer")
        elif si is None or si.data_type != 1 or tuple(si.dims) != (qi.dims[axis],) or axis != 1:
            problems.append(f"{where}: scale {scale} must be a float32 initializer of {qi.dims[1]} values on "
                            f"axis 1 (per output column), got axis {axis}, "
                            f"{'none' if si is None else list(si.dims)}")
        for reader, i in readers.get(node.output[0], []):
            trans_b = next((a.i for a in reader.attribute if a.name == "transB"), 0)
            if reader.op_type not in ("MatMul", "Gemm") or i != 1 or trans_b:
                problems.append(f"{where}: feeds {reader.op_type} input {i}; want the weight (B) of a MatMul/Gemm "
                                "(transB=0)")
        if not readers.get(node.output[0]):
            problems.append(f"{where}: its output is read by nothing")
    for w in twins:
        if seen[w] != 1:
            problems.append(f"{graph}: quantized weight {w} is read by {seen[w]} DequantizeLinear nodes (want 1)")
    return problems


def check_foldable(manifest: Manifest, onnx_path: str | Path, graph: str) -> list[str]:
    """Mapped weights a constant-only op reads (:func:`refit.export.graph.foldable_weights`), other than the Q/DQ
    twins and scales (TensorRT's pre-quantized weight form; the build's refittable check guards those)."""
    twins = {n for tw in quantized_twins(manifest, graph).values() for n in (tw.weight, tw.scale)}
    found = foldable_weights(load_graph(onnx_path), set(mapped_trt_names(manifest, graph)) - twins)
    return [f"{graph}: weight {n} is read by a constant-only {op} (TensorRT may fold it: refit could not reach it)"
            for n, op in found.items()]
