"""CPU-side checks that an engine folder will build as a refittable TensorRT engine.

These run in CI without TensorRT or a GPU, on the ONNX graphs and ``manifest.json`` alone, and
catch what would otherwise only fail on an NVIDIA machine (or, worse, silently leave weights
stale after a refit):

- :func:`check_ops`: every op (subgraphs and local functions included) is one TensorRT's ONNX
  parser supports at the graph's opset;
- :func:`check_profiles`: every dynamic input dimension is named, declared in the manifest's
  ``dynamic_dims``, and covered by every shape profile of the graph;
- :func:`check_weight_map`: every external (refittable) initializer is fed by exactly one
  weight-map entry, and every entry names an initializer of the right shape and dtype; on a
  quantized folder (``--backend tensorrt --quantize int8``) an entry of a quantized weight feeds
  its int8 twin and its scale (the ``quantization`` record), each once;
- :func:`check_qdq`: the Q/DQ graph: every ``DequantizeLinear`` reads an int8 constant (a twin of
  the record) and a float scale of one value per output column on ``axis=1``, no zero point, and
  feeds the weight input of a MatMul / Gemm (``transB=0``); every twin has one;
- :func:`check_foldable`: no mapped weight (Q/DQ twins aside) is read by a constant-only op TensorRT may fold.

``python -m refit.rollout.tensorrt.check ENGINE_DIR`` runs them all and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.manifest_sections import ShapeRange
from refit.export.graph import foldable_weights
from refit.export.quantize import QDQ
from refit.rollout.tensorrt.build import mapped_trt_names, quantized_twins

# Ops TensorRT's ONNX parser converts ("Y" rows of the support matrix), TensorRT 10.0/10.1:
# https://github.com/onnx/onnx-tensorrt/blob/10.1-GA/docs/operators.md (commit 96e7811).
# The same page: "TensorRT 10.0 supports operators in the inclusive range of opset 9 to opset 20".
# Only the default ONNX domain; custom domains (com.microsoft, ...) need plugins and are rejected.
TRT_SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast
CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum
DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike
Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU HardSigmoid HardSwish
Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu
Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN
RoiAlign Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign
Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())
TRT_OPSET_RANGE = (9, 20)
TRT_OPS_SOURCE = "onnx-tensorrt 10.1-GA docs/operators.md"

_ONNX_ELEM = {"fp32": 1, "fp16": 10, "bf16": 16}  # onnx.TensorProto enums of the manifest dtype
_INT8 = 3  # onnx.TensorProto.INT8


def load_graph(onnx_path: str | Path):
    """The ModelProto without its external weights (shapes and names only: fast on big models)."""
    import onnx

    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - a missing/corrupt graph becomes one line
        raise RefitError(f"cannot read ONNX graph {onnx_path}: {str(e).splitlines()[0][:200]}") from None


# ---------------------------------------------------------------------------------------- ops

def _op_available(op: str, opset: int) -> bool:
    """``op`` is in the parser's matrix and exists (not deprecated) in ONNX at ``opset``."""
    import onnx.defs

    if op not in TRT_SUPPORTED_OPS:
        return False
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        # Not defined at this opset (e.g. Gelu before 20), or an old experimental op onnx dropped.
        return not onnx.defs.has(op)
    return not schema.deprecated


def _iter_nodes(graph):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), depth first."""
    import onnx

    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_nodes(g)


def _restriction(node) -> str | None:
    """Per-op limits from the matrix's "Restrictions" column that these graphs could hit."""
    if node.op_type == "LayerNormalization" and any(o for o in node.output[1:]):
        return "LayerNormalization[Mean/InvStdDev outputs]"  # "Only the first output Y is supported"
    return None


def check_ops(onnx_path: str | Path, opset: int | None = None) -> list[str]:
    """Op types in ``onnx_path`` that TensorRT's ONNX parser cannot convert at ``opset``.

    Recurses into subgraphs; local functions (the dynamo exporter can emit them) are inlined
    first, as the parser sees their bodies. ``opset`` defaults to the graph's own default-domain
    import. Returns sorted ``"OpType"`` / ``"domain:OpType"`` strings (plus an ``"opset N ..."``
    entry when the opset is outside the parser's range); empty means all supported.
    """
    import onnx.inliner

    model = load_graph(onnx_path)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    if opset is None:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    bad: set[str] = set()
    lo, hi = TRT_OPSET_RANGE
    if not lo <= opset <= hi:
        bad.add(f"opset {opset} (the parser supports {lo}..{hi})")
    for node in _iter_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            bad.add(f"{node.domain}:{node.op_type}")
        elif not _op_available(node.op_type, opset):
            bad.add(node.op_type)
        elif (r := _restriction(node)) is not None:
            bad.add(r)
    return sorted(bad)


# ----------------------------------------------------------------------------------- profiles

def _graph_name(manifest: Manifest, onnx_path: str | Path, graph: str | None) -> str:
    if graph is not None:
        return graph
    name = Path(onnx_path).name
    for g, spec in manifest.graphs.items():
        if spec.file == name:
            return g
    raise RefitError(f"{name} is not a graph of this manifest (graphs: {', '.join(manifest.graphs)})")


def _input_dims(model) -> dict[str, list]:
    """{input: [int | str | None per axis]} (None: anonymous dim); initializers are not inputs."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            out[vi.name] = None
            continue
        out[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    return out


def _check_axis(where: str, axis_dim, rng: tuple[int, int, int]) -> list[str]:
    lo, opt, hi = rng
    if isinstance(axis_dim, int):
        return [] if lo == opt == hi == axis_dim else [f"{where}: static dim {axis_dim} but profile gives {lo}/{opt}/{hi}"]
    if not 0 <= lo <= opt <= hi:
        return [f"{where} ({axis_dim}): needs 0 <= min <= opt <= max, got {lo}/{opt}/{hi}"]
    return []


def check_profiles(manifest: Manifest, onnx_path: str | Path, graph: str | None = None) -> list[str]:
    """Problems with the shape profiles of one graph (empty list: every profile covers every input).

    Each graph input's dynamic dims must be named (TensorRT profiles and the manifest talk about
    them by name) and declared in the manifest's ``dynamic_dims``; each profile must give every
    input a min/opt/max of the graph's rank with ``min <= opt <= max`` on dynamic axes and the
    graph's value on static ones, and one named dim must get one range across all inputs.
    """
    graph = _graph_name(manifest, onnx_path, graph)
    dims = _input_dims(load_graph(onnx_path))
    declared = set(manifest.dynamic_dims)
    problems = []
    listed = manifest.graphs[graph].inputs if graph in manifest.graphs else None
    if listed is not None and list(listed) != list(dims):
        problems.append(f"{graph}: manifest inputs {listed} differ from the graph's {list(dims)}")
    for name, shape in dims.items():
        if shape is None:
            problems.append(f"{graph}.{name}: no shape in the graph (rank unknown)")
            continue
        for ax, d in enumerate(shape):
            if d is None:
                problems.append(f"{graph}.{name}[{ax}]: anonymous dynamic dimension (give it a name)")
            elif isinstance(d, str) and d not in declared:
                problems.append(f"{graph}.{name}[{ax}]: dimension {d!r} is not in manifest dynamic_dims")
    profiles = manifest.profiles.get(graph)
    if not profiles:
        return problems + [f"{graph}: no shape profiles in the manifest"]
    for pname, prof in profiles.items():
        problems += _check_profile(f"{graph}/{pname}", prof, dims)
    return problems


def _check_profile(where: str, prof: Mapping[str, ShapeRange], dims: dict[str, list | None]) -> list[str]:
    problems = [f"{where}: {x!r} is not an input of the graph" for x in prof if x not in dims]
    ranges: dict[str, tuple] = {}  # named dim -> (min, opt, max) first seen, with its input
    for name, shape in dims.items():
        if shape is None:
            continue
        spec = prof.get(name)
        if spec is None:
            problems.append(f"{where}: input {name} has no min/opt/max")
            continue
        mins, opts, maxs = spec.min, spec.opt, spec.max
        if not len(mins) == len(opts) == len(maxs) == len(shape):
            problems.append(f"{where}.{name}: profile rank {len(mins)}/{len(opts)}/{len(maxs)}, graph rank {len(shape)}")
            continue
        for ax, d in enumerate(shape):
            rng = (mins[ax], opts[ax], maxs[ax])
            problems += _check_axis(f"{where}.{name}[{ax}]", d, rng)
            if isinstance(d, str):
                first = ranges.setdefault(d, (rng, name))
                if first[0] != rng:
                    problems.append(f"{where}: dim {d!r} is {list(rng)} on {name} but {list(first[0])} on {first[1]}")
    return problems


# --------------------------------------------------------------------------------- weight map

def _hf_shapes(manifest: Manifest) -> dict[str, tuple[int, ...]] | None:
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

    graph = _graph_name(manifest, onnx_path, graph)
    model = load_graph(onnx_path)
    inits = {t.name: t for t in model.graph.initializer}
    external = {n for n, t in inits.items() if t.data_location == onnx.TensorProto.EXTERNAL}
    if hf_shapes is None:
        hf_shapes = _hf_shapes(manifest) or {}
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
            if tw is not None:  # the int8 twin and its scale are what a push writes (export/quantize.py)
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
    graph = _graph_name(manifest, onnx_path, graph)
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


# ------------------------------------------------------------------------------------- folder

def check_engine_folder(engine_dir: str | Path) -> list[str]:
    """Every problem found in ``engine_dir`` by the checks above; an empty list means ready to build.

    The manifest's own consistency (:meth:`refit.core.manifest.Manifest.problems`: graphs, weight map
    into existing graphs, profiles covering every input, plans matching the profiles) comes first;
    the graph-level checks run only on a consistent manifest.
    """
    engine_dir = Path(engine_dir)
    try:
        manifest = Manifest.read(engine_dir, check=False)
    except RefitError as e:
        return [str(e)]
    problems = [f"manifest: {p}" for p in manifest.problems()]
    if problems:
        return problems
    hf_shapes = _hf_shapes(manifest)
    for graph, spec in manifest.graphs.items():
        path = engine_dir / spec.file
        if not path.exists():
            problems.append(f"{graph}: graph file {spec.file} is missing")
            continue
        if spec.data and not (engine_dir / spec.data).exists():
            problems.append(f"{graph}: weight file {spec.data} is missing")
        try:
            unsupported = check_ops(path, manifest.opset)
            problems += [f"{graph}: not supported by TensorRT's ONNX parser ({TRT_OPS_SOURCE}): {op}"
                         for op in unsupported]
            problems += check_profiles(manifest, path, graph)
            problems += check_weight_map(manifest, path, graph, hf_shapes)
            problems += check_qdq(manifest, path, graph)
            problems += check_foldable(manifest, path, graph)
        except RefitError as e:
            problems.append(f"{graph}: {e}")
    return problems + _check_plans(engine_dir, manifest)


def _check_plans(engine_dir: Path, manifest: Manifest) -> list[str]:
    """If TensorRT engines were built: plan files present, every mapped weight refittable."""
    problems = []
    for graph, rec in (manifest.tensorrt or {}).items():
        if not (engine_dir / rec.plan).is_file():
            problems.append(f"{graph}: TensorRT plan {rec.plan} is missing")
        if rec.not_refittable:
            problems.append(f"{graph}: {len(rec.not_refittable)} mapped weights are not refittable in the "
                            f"TensorRT engine, e.g. {list(rec.not_refittable[:3])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.rollout.tensorrt.check",
                                description="Check, without TensorRT, that an engine folder will build as a refittable "
                                            "TensorRT engine: supported ops, named and covered shape profiles, 1:1 weight map.")
    p.add_argument("engine_dir", help="engine folder written by `refit export`")
    a = p.parse_args(argv)
    problems = check_engine_folder(a.engine_dir)
    if problems:
        print("\n".join(f"  - {line}" for line in problems))
        print(f"trt_check: {a.engine_dir}: {len(problems)} problem(s)")
        return 1
    m = Manifest.read(a.engine_dir)
    q, n_w = m.quantization, sum(len(v) for v in m.weight_map.values())
    quant = f", {sum(len(v) for v in q.weights.values())} int8 weights through DequantizeLinear ({q.scheme})" if q else ""
    print(f"trt_check: {a.engine_dir}: ok ({len(m.graphs)} graph(s), {sum(len(v) for v in m.profiles.values())} "
          f"profile(s), {n_w} mapped weights{quant}, ops per {TRT_OPS_SOURCE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
