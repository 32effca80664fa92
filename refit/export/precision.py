"""Reduced-precision engines (``--dtype fp16|bf16``): what ONNX Runtime's CPU provider runs of them, the CPU
twin of a bf16 graph, and the graph-side checks of a reduced-precision export.

What runs where (ONNX Runtime 1.32, ``onnxruntime.capi._pybind_state.get_all_opkernel_def()``):

- fp16: the CPU provider has fp16 kernels for few compute ops (no MatMul, Add, Softmax...); its graph
  transformer ``InsertCastTransformer`` wraps each such node in Casts, so the fp16 graph runs as it is,
  each op computed in fp32 between fp16 tensors (every activation and the KV cache rounded to fp16, the
  weights fp16). A GPU provider runs fp16 kernels (fp16 or fp32 accumulation, the kernel's choice).
- bf16: the CPU provider has bf16 kernels only for data movement (Cast, Gather, Reshape, Concat...) and no
  Cast insertion, so a session over a bf16 graph fails at its first compute node. The exporter then gates
  the graph through :func:`cpu_twin`: the same nodes and the same bf16 weights, every node without a bf16
  CPU kernel wrapped in Casts exactly as ONNX Runtime does for fp16 (fp32 compute, bf16 tensors between
  ops), the graph's inputs and outputs cast at the boundary (bf16 <-> fp32 is exact for the values that
  cross it: token logits, bf16 K/V fed back). What only a GPU provider (CUDA, TensorRT) can confirm: its
  bf16 kernels (fused, with their own accumulation) and its speed.

:func:`graph_dtype_problems` is the graph side that needs no runtime: the ONNX checker, the dtype of every
graph input and output and of every mapped weight (a folded ``stored_dtype`` target in its own).
"""

from __future__ import annotations

import functools
from pathlib import Path

ONNX_ELEM = {"fp32": 1, "fp16": 10, "bf16": 16}  # onnx.TensorProto enums
_FLOAT_ELEMS = {1, 10, 11, 16}  # float, float16, double, bfloat16
_KV_PREFIXES = ("past.", "present.", "cross.")


@functools.cache
def cpu_kernel_ops(dtype: str) -> frozenset[tuple[str, str]]:
    """{(domain, op)} with a CPU provider kernel that takes ``dtype`` tensors (any input or output)."""
    from onnxruntime.capi import _pybind_state as C

    want = {"fp32": "tensor(float)", "fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}[dtype]
    out = set()
    for k in C.get_all_opkernel_def():
        if k.provider == "CPUExecutionProvider" and any(want in v for v in k.type_constraints.values()):
            out.add((k.domain or "", k.op_name))
    return frozenset(out)


def _value_types(model) -> dict[str, int]:
    """{value name: onnx elem type} of the graph's inputs, outputs, initializers and inferred values."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    for n in g.node:  # Constant nodes: their value's type
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type
    return types


def cpu_gaps(model, dtype: str) -> list[str]:
    """Op types of ``model`` (a ModelProto) that carry ``dtype`` tensors and have no CPU kernel for it."""
    elem = ONNX_ELEM[dtype]
    types = _value_types(model)
    have = cpu_kernel_ops(dtype)
    gaps = set()
    for n in model.graph.node:
        if n.op_type == "Constant" or (n.domain or "", n.op_type) in have:
            continue
        if any(types.get(v) == elem for v in [*n.input, *n.output] if v):
            gaps.add(n.op_type)
    return sorted(gaps)


def cpu_twin(model, dtype: str = "bf16"):
    """A copy of ``model`` that ONNX Runtime's CPU provider runs: each node without a ``dtype`` CPU kernel
    computes in fp32 between Casts (its ``dtype`` inputs cast up, its ``dtype`` outputs cast back down), and
    the graph's ``dtype`` inputs and outputs are fp32 at the boundary (a Cast right after / before).

    Initializers (the weights) are untouched: the twin reads the same bf16 bytes, inline or external.
    """
    import onnx
    from onnx import helper

    elem, f32 = ONNX_ELEM[dtype], onnx.TensorProto.FLOAT
    types = _value_types(model)
    have = cpu_kernel_ops(dtype)
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    g = twin.graph
    nodes, inside = [], {}
    for v in g.input:  # an fp32 input, cast to dtype at once; consumers read the cast value
        if v.type.tensor_type.elem_type == elem:
            inside[v.name] = f"{v.name}__{dtype}"
            nodes.append(helper.make_node("Cast", [v.name], [inside[v.name]], to=elem, name=v.name + "__in"))
            types[inside[v.name]] = elem
            v.type.tensor_type.elem_type = f32
    g_nodes = []
    for n0 in g.node:
        n = onnx.NodeProto()
        n.CopyFrom(n0)
        for i, name in enumerate(n.input):
            if name in inside:
                n.input[i] = inside[name]
        g_nodes.append(n)
    for n in g_nodes:
        if n.op_type == "Constant" or (n.domain or "", n.op_type) in have or \
                not any(types.get(x) == elem for x in [*n.input, *n.output] if x):
            nodes.append(n)
            continue
        for i, name in enumerate(n.input):
            if name and types.get(name) == elem:
                up = f"{name}__up_{n.name or id(n)}_{i}"
                nodes.append(helper.make_node("Cast", [name], [up], to=f32, name=up))
                n.input[i] = up
        downs = []
        for i, name in enumerate(n.output):
            if name and types.get(name) == elem:
                tmp = f"{name}__f32out"
                downs.append(helper.make_node("Cast", [tmp], [name], to=elem, name=tmp))
                n.output[i] = tmp
        nodes.append(n)
        nodes.extend(downs)
    outs = []
    for v in g.output:
        if v.type.tensor_type.elem_type == elem:
            src = v.name + "__out_" + dtype
            for n in nodes:
                for i, name in enumerate(n.output):
                    if name == v.name:
                        n.output[i] = src
                for i, name in enumerate(n.input):
                    if name == v.name:
                        n.input[i] = src
            outs.append(helper.make_node("Cast", [src], [v.name], to=f32, name=v.name + "__out"))
            v.type.tensor_type.elem_type = f32
    del g.node[:]
    g.node.extend(nodes + outs)
    del g.value_info[:]
    return twin


def graph_dtype_problems(graph_path: str | Path, dtype: str, weight_targets: dict[str, str | None]) -> list[str]:
    """Problems with one exported graph's precision (empty: none), checked on the file alone.

    The ONNX checker passes (external data included); every float graph input and output (logits, K/V)
    is ``dtype``; every initializer in ``weight_targets`` ({engine name: stored_dtype or None}) is
    ``stored_dtype`` or else ``dtype``, stored as external data (what a push replaces).
    """
    import onnx

    graph_path = Path(graph_path)
    problems = []
    try:
        onnx.checker.check_model(str(graph_path))
    except Exception as e:  # noqa: BLE001 - the checker's complaint becomes one line
        problems.append(f"{graph_path.name}: onnx.checker: {str(e).splitlines()[0][:200]}")
    model = onnx.load(str(graph_path), load_external_data=False)
    name = onnx.TensorProto.DataType.Name
    for v in [*model.graph.input, *model.graph.output]:
        t = v.type.tensor_type.elem_type
        if t in _FLOAT_ELEMS and t != ONNX_ELEM[dtype]:
            problems.append(f"{graph_path.name}: {v.name} is {name(t)}, the engine is {dtype}")
    inits = {t.name: t for t in model.graph.initializer}
    for engine, stored in weight_targets.items():
        t = inits.get(engine)
        want = stored or dtype
        if t is None:
            problems.append(f"{graph_path.name}: mapped weight {engine} is not an initializer")
        elif t.data_type != ONNX_ELEM[want]:
            problems.append(f"{graph_path.name}: weight {engine} is {name(t.data_type)}, the map says {want}")
        elif t.data_location != onnx.TensorProto.EXTERNAL:
            problems.append(f"{graph_path.name}: weight {engine} is inline, not external data")
    return problems


def engine_run_on_cpu(folder: Path, graphs: dict, dtype: str) -> tuple[dict[str, str] | None, str]:
    """How the parity gate runs ``graphs`` ({graph: GraphSpec} in ``folder``) on the CPU provider:
    (None: the files as they are, or {graph: CPU twin file written into ``folder``}; the manifest's words).

    fp32 and fp16 run as they are (fp16: ONNX Runtime casts around the ops it lacks); bf16 through
    :func:`cpu_twin`, the twins written beside the graphs (reading the same external weight data) for the
    caller to remove once the gate has run.
    """
    import onnx

    if dtype == "fp32":
        return None, "CPUExecutionProvider"
    gaps, files = set(), {}
    for g, spec in graphs.items():
        model = onnx.load(str(folder / spec.file), load_external_data=False)
        gaps.update(cpu_gaps(model, dtype))
        if dtype == "bf16":
            files[g] = f"{g}.cpu-twin.onnx"
            onnx.save_model(cpu_twin(model, dtype), str(folder / files[g]))
    ops = ", ".join(sorted(gaps)) or "none"
    if dtype == "fp16":
        return None, (f"CPUExecutionProvider, the fp16 graph as is: ops without an fp16 CPU kernel ({ops}) "
                      "computed in fp32 between fp16 tensors (ONNX Runtime's InsertCastTransformer)")
    return files, (f"CPU twin of the bf16 graph (refit/export/precision.py): the CPU provider has no bf16 kernel for "
                   f"{ops}; those ops computed in fp32 between bf16 tensors, inputs/outputs cast to fp32 at the "
                   "boundary. Running the bf16 engine itself needs a GPU provider (CUDA or TensorRT); its bf16 "
                   "kernels are not checked here")
