"""The graph-level TensorRT checks, on an ONNX graph and the manifest alone (no TensorRT, no GPU).

- :func:`check_ops`: every op (subgraphs and local functions included) is one TensorRT's ONNX parser supports at
  the graph's opset (the support matrix of :data:`TRT_OPS_SOURCE`);
- :func:`check_profiles`: every dynamic input dimension is named, declared in the manifest's ``dynamic_dims``, and
  covered by every shape profile of the graph.

:func:`load_graph` (a graph without its weights) and :func:`graph_name` serve these and the weight checks
(:mod:`refit.rollout.tensorrt.check_weights`); :mod:`refit.rollout.tensorrt.check` runs them all on a folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.manifest_sections import ShapeRange

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


def load_graph(onnx_path: str | Path):
    """The ModelProto without its external weights (shapes and names only: fast on big models)."""
    import onnx

    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - a missing/corrupt graph becomes one line
        raise RefitError(f"cannot read ONNX graph {onnx_path}: {str(e).splitlines()[0][:200]}") from None


def graph_name(manifest: Manifest, onnx_path: str | Path, graph: str | None) -> str:
    """``graph`` if given, else the manifest graph whose file is ``onnx_path``."""
    if graph is not None:
        return graph
    name = Path(onnx_path).name
    for g, spec in manifest.graphs.items():
        if spec.file == name:
            return g
    raise RefitError(f"{name} is not a graph of this manifest (graphs: {', '.join(manifest.graphs)})")


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
    graph = graph_name(manifest, onnx_path, graph)
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
