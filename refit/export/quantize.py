"""int8 rollout engines (``refit export --quantize int8``): the fp32 graph's weight matmuls rewritten to run in
int8 on ONNX Runtime's CPU provider, re-quantized from the learner's fp32 tensors on every push.

Scheme (one, named ``"int8"``): weights per output column, symmetric, ``q = round(w / s)`` in [-127, 127]
with ``s = max|w[:, n]| / 127``; activations per row (per token), symmetric, ``a = round(x / t) + 128``
(uint8, zero point 128) with ``t = max|x[row]| / 127``; ``MatMulInteger`` multiplies them exactly in int32,
then ``y = float(acc) * t * s`` (+ the bias). Every other op (attention, norms, softmax) stays fp32.

Why this op, by measurement (the 49 weight matmuls of one GPT-2-small decode step at batch 32, one
ONNX Runtime 1.32 session per variant, 2 threads, interleaved rounds, best of 5, same run; this CPU has
AVX-512 VNNI and AMX-int8; scripts/int8_matmul_ops.py, numbers in docs/int8.md):

    fp32 MatMul 434 ms | MatMulInteger, per-tensor activations (quantize_dynamic's pattern) 82 ms (5.3x)
    | DynamicQuantizeMatMul 90 ms (4.8x) | MatMulInteger, per-row activations (this scheme) 120 ms (3.6x)
    | MatMulNBits bits=8 block 128 accuracy_level=4 235 ms (1.8x; blocks 32/64: 1.3-1.4x)

``MatMulInteger`` goes to MLAS's quantized GEMM (AMX / VNNI kernels); ``MatMulNBits``' int8-compute path
is several times slower here. The per-tensor activation scale of ``quantize_dynamic`` (``DynamicQuantizeLinear``)
is faster still but couples the rows of a batch: a row's logits would depend on which rows share its batch
(in-flight batching refills slots; idle slots feed padding through the MLP), so a row's tokens would stop
being a function of (seed, prompt, sample, weights). The per-row scale costs a few elementwise ops per
distinct matmul input (shared by the matmuls that read it) and keeps rows independent.

Exactness. The integer product is exact, so a PyTorch forward that quantizes the same weights and the same
activations the same way (:func:`refit.core.int8.int8_linear`, :func:`~refit.core.int8.reference_model`) computes what the engine computes up
to fp32 rounding elsewhere; the parity gate compares the engine with it, and records the engine's log-prob
gap to the fp32 model in the manifest (``quantization.gap_vs_fp32``), a property of the engine, not a failure.
One thing is not exact: rounding an activation to its int8 code is a step function, so where ONNX Runtime's
and PyTorch's fp32 (LayerNorm, attention, ...) differ in the last bits, an activation just at a half-step
takes the neighbouring code in one of them, and the step travels through the later layers and the KV cache.
Tiny models never hit it (measured 2e-7); GPT-2 small (random weights, the gate's 4 prompts) did: 5.0e-2
max |dlogprob| engine vs reference, the same as the reference against *itself* with its matmul inputs
perturbed by 1e-7 relative (5.8e-2), while the whole int8-vs-fp32 gap was 9.0e-2 (mean 4.0e-3 vs 1.4e-2);
the demo's policy (2 layers, 128 wide) once gave 1.13e-3 on its push probe (4 x 6 tokens) where fp32 gives 3e-5.
So the gate measures that rounding floor first (:func:`refit.core.int8.rounding_floor`: the reference against itself,
inputs perturbed by ``FLOOR_JITTER``, three seeds) and allows twice it (at least :data:`GATE_TOL_MIN`), on
the max and on the mean. The learner's push probe does the same on its own batch
(``refit.learner.run.sync.WeightSync.check_now``, the contract's ``int8_manifest`` set): within the probe tolerance, passed; else
the floor is measured on the probe batch and the engine must be within twice it. A push that changes the
output by less than the floor cannot be told from rounding; a push not taken after one PPO step is caught
(tests/test_quantize.py).

Weight map. The manifest's ``weight_map`` is unchanged (HF name -> fp32 engine name); ``quantization.weights``
names each fp32 engine weight's int8 twin. :func:`quantize_push` turns a mapped push into the twins (the
fp32 weight itself is dropped unless another node, a tied embedding's ``Gather``, still reads it).

The TensorRT scheme (``"int8-qdq"``, ``refit export --backend tensorrt --quantize int8``): weight-only int8 through
explicit quantization. Each quantized weight is the same int8 twin (:func:`refit.core.int8.quantize_weight`, stored (K, N)) feeding
``DequantizeLinear(axis=1)`` with its per-output-column scale, into the MatMul / Gemm (a ``transB=1`` Gemm becomes
``transB=0``: the twin is (K, N)); activations stay fp32. It is standard ONNX, so ONNX Runtime's CPU provider runs
the very graph TensorRT parses, and the gate compares it with :class:`refit.core.int8.QDQLinear` (an fp32 matmul by the
dequantized weight ``q * scale``): no activation rounding, so no rounding floor, fp32 parity's 1e-4 tolerance.
A push re-quantizes with the same :func:`quantize_push`; TensorRT refits the int8 weight and its scale by their
ONNX names (refit/rollout/tensorrt/engine.py). docs/int8.md says what ran where.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.core.int8 import QDQ, TINY, matmul_modules, quantize_weight
from refit.core.integrity import sha256_files as _sha256_files
from refit.core.manifest import Manifest
from refit.core.manifest_sections import Quantization, QuantizedWeight
from refit.export.graph import write_graph as _write_graph

SCHEMES = ("none", "int8")  # ExportOptions.quantize (both backends)
QDQ_GATE_TOL = 1e-4  # the Q/DQ gate's max |logprob diff| (fp32 parity's: the arithmetic is fp32 on both sides)
GATE_TOL_MIN = 1e-3  # the int8 gate's least tolerance on max |logprob diff| (the fp32 probe's default)


# ----------------------------------------------------------------------------- the arithmetic (torch)


def kn(w: torch.Tensor, layout: str) -> torch.Tensor:
    """A mapped fp32 engine tensor as (K, N): ``nk`` (a Gemm with transB=1 stores it (N, K)) is transposed."""
    return w.t() if layout == "nk" else w


def quantize_push(mapped: dict[str, dict[str, torch.Tensor]], quant: Quantization | None) -> dict:
    """``{graph: {fp32 engine name: tensor}}`` (a mapped push) -> the same with each quantized weight replaced by
    its int8 twin and scale (and kept too where ``keep_float``). Unquantized names pass through."""
    if quant is None:
        return mapped
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g, new in mapped.items():
        twins, dst = quant.weights.get(g, {}), out.setdefault(g, {})
        for name, t in new.items():
            tw = twins.get(name)
            if tw is None or tw.keep_float:
                dst[name] = t
            if tw is not None:
                dst[tw.weight], dst[tw.scale] = quantize_weight(kn(t, tw.layout))
    return out


def scheme_for(backend: str) -> str:
    """The Quantization.scheme ``--quantize int8`` makes for an export backend ("onnxruntime" | "tensorrt")."""
    return QDQ if backend == "tensorrt" else "int8"


# ----------------------------------------------------------------------------- the graph rewrite


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return a.f if a.type == a.FLOAT else a.i
    return default


def _weight_use(node, inits: dict, names: set[str]) -> tuple[str, str, str | None] | None:
    """(weight, layout, bias or None) when ``node`` is a plain MatMul / Gemm by one of ``names``, else None."""
    if node.op_type == "MatMul" and node.input[1] in names and len(inits[node.input[1]].dims) == 2:
        return node.input[1], "kn", None
    if (node.op_type == "Gemm" and node.input[1] in names and _attr(node, "transA", 0) == 0
            and _attr(node, "alpha", 1.0) == 1.0 and _attr(node, "beta", 1.0) == 1.0):
        return node.input[1], "nk" if _attr(node, "transB", 0) else "kn", (node.input[2] if len(node.input) > 2
                                                                        and node.input[2] else None)
    return None


def _rewrite_weight_uses(proto, weights: dict[str, torch.Tensor], names: set[str], emit,
                         extra_inits=()) -> tuple[dict[str, QuantizedWeight], dict, int]:
    """The walk both schemes share, in place: each MatMul / Gemm by a weight ``w`` in ``names`` (fp32 engine
    names, tensors in ``weights``) gets ``w``'s int8 twin (K, N) and scale (N,) (made once per weight) and is
    replaced by ``emit(node, twin, w, bias, first)`` (a list of nodes; ``first``: the twin's first reader).
    A weight that another node still reads as float keeps its float initializer (``keep_float``); the twins
    are placeholders (:func:`refit.export.graph.write_graph` writes their bytes as external data).
    Returns ({fp32 name: twin}, {twin initializer: tensor}, weight matmuls left fp32)."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    twins: dict[str, QuantizedWeight] = {}
    arrays: dict[str, torch.Tensor] = {}
    used_float: set[str] = set()
    left = 0
    new_nodes = []
    for node in g.node:
        use = _weight_use(node, inits, names)
        if use is None:
            new_nodes.append(node)
            used_float.update(node.input)
            if node.op_type in ("MatMul", "Gemm") and any(i in inits and len(inits[i].dims) == 2 for i in node.input):
                left += 1
            continue
        w, layout, bias = use
        tw, first = twins.get(w), w not in twins
        if first:
            tw = twins[w] = QuantizedWeight(weight=f"{w}.int8", scale=f"{w}.int8_scale", layout=layout,
                                            keep_float=False)
            arrays[tw.weight], arrays[tw.scale] = quantize_weight(kn(weights[w], layout))
        elif tw.layout != layout:
            raise RefitError(f"quantize: weight {w} is multiplied in two layouts; not supported")
        new_nodes += emit(node, tw, w, bias, first)
    del g.node[:]
    g.node.extend(new_nodes)
    for w, tw in list(twins.items()):
        if w in used_float:
            twins[w] = QuantizedWeight(tw.weight, tw.scale, tw.layout, keep_float=True)
    keep = [t for t in g.initializer if t.name not in twins or twins[t.name].keep_float]
    del g.initializer[:]
    g.initializer.extend(keep + list(extra_inits))
    for tw in twins.values():
        for n in (tw.weight, tw.scale):
            g.initializer.append(_placeholder(n))
    return twins, arrays, left


def rewrite_graph(proto, weights: dict[str, torch.Tensor],
                  names: set[str]) -> tuple[dict[str, QuantizedWeight], dict, int]:
    """Rewrite every MatMul / Gemm by a weight in ``names`` (fp32 engine names, tensors in ``weights``) of ``proto``
    to the int8 scheme, in place. Returns ({fp32 name: twin}, {twin initializer: tensor}, weight matmuls left fp32).

    Per distinct input the row quantization runs once (Q, K, V projections share it)."""
    from onnx import TensorProto, helper, numpy_helper

    consts = [numpy_helper.from_array(np.array(127, np.float32), "int8_c127"),
              numpy_helper.from_array(np.array(128, np.float32), "int8_c128"),
              numpy_helper.from_array(np.array(128, np.uint8), "int8_zp"),
              numpy_helper.from_array(np.array(TINY, np.float32), "int8_tiny"),
              numpy_helper.from_array(np.array([-1], np.int64), "int8_last")]
    rowq: dict[str, tuple[str, str]] = {}  # activation name -> (uint8 codes, row scale)

    def emit(node, tw, w, bias, first):
        x, p = node.input[0], f"{node.name or node.output[0]}_i8"
        nodes = []
        if x not in rowq:
            q = f"{x}_i8"
            nodes += [helper.make_node("Abs", [x], [f"{q}_abs"], name=f"{q}_abs"),
                      helper.make_node("ReduceMax", [f"{q}_abs", "int8_last"], [f"{q}_max"], name=f"{q}_max",
                                       keepdims=1),
                      helper.make_node("Max", [f"{q}_max", "int8_tiny"], [f"{q}_amax"], name=f"{q}_amax"),
                      helper.make_node("Div", [f"{q}_amax", "int8_c127"], [f"{q}_t"], name=f"{q}_t"),
                      helper.make_node("Div", [x, f"{q}_t"], [f"{q}_d"], name=f"{q}_d"),
                      helper.make_node("Round", [f"{q}_d"], [f"{q}_r"], name=f"{q}_r"),
                      helper.make_node("Add", [f"{q}_r", "int8_c128"], [f"{q}_u"], name=f"{q}_u"),
                      helper.make_node("Cast", [f"{q}_u"], [f"{q}_codes"], name=f"{q}_codes", to=TensorProto.UINT8)]
            rowq[x] = (f"{q}_codes", f"{q}_t")
        codes, t = rowq[x]
        out = node.output[0]
        y = f"{p}_y" if bias else out
        nodes += [helper.make_node("MatMulInteger", [codes, tw.weight, "int8_zp"], [f"{p}_acc"], name=f"{p}_mm"),
                  helper.make_node("Cast", [f"{p}_acc"], [f"{p}_f"], name=f"{p}_f", to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"{p}_f", t], [f"{p}_ft"], name=f"{p}_ft"),
                  helper.make_node("Mul", [f"{p}_ft", tw.scale], [y], name=f"{p}_fs")]
        if bias:
            nodes.append(helper.make_node("Add", [y, bias], [out], name=f"{p}_bias"))
        return nodes

    return _rewrite_weight_uses(proto, weights, names, emit, consts)


def rewrite_graph_qdq(proto, weights: dict[str, torch.Tensor],
                      names: set[str]) -> tuple[dict[str, QuantizedWeight], dict, int]:
    """The TensorRT scheme (:data:`QDQ`): every MatMul / Gemm by a weight in ``names`` reads
    ``DequantizeLinear(int8 twin (K, N), scale (N,), axis=1)`` instead, in place; activations untouched.
    Same return as :func:`rewrite_graph`. One DequantizeLinear per weight, placed before its first reader."""
    from onnx import helper

    def emit(node, tw, w, bias, first):
        nodes = [helper.make_node("DequantizeLinear", [tw.weight, tw.scale], [f"{w}.dq"], name=f"{w}.dq",
                                  axis=1)] if first else []
        inputs = list(node.input)
        inputs[1] = f"{w}.dq"
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm":
            attrs["transB"] = 0  # the twin is (K, N) whatever the fp32 weight's layout
        return nodes + [helper.make_node(node.op_type, inputs, list(node.output), name=node.name, **attrs)]

    return _rewrite_weight_uses(proto, weights, names, emit)


def _placeholder(name: str):
    """An empty float32 initializer named ``name`` (a placeholder the graph writer fills)."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.zeros(0, np.float32), name)


# ----------------------------------------------------------------------------- the export step



def quantize_folder(folder: Path, manifest: Manifest, model, real: dict[str, dict[str, torch.Tensor]]) -> Manifest:
    """Rewrite the gated fp32 graphs in ``folder`` to the int8 scheme; the manifest with its quantization record
    (written; its gate figures are filled by the int8 gate, :func:`refit.rollout.parity.int8_parity_gate`, which
    runs the engine against the quantize-dequantize PyTorch forward, :func:`reference_model`).

    ``real``: the fp32 engine weights ({graph: {engine name: tensor}}, dicts or lazy views) the folder's graphs were
    written with."""
    import onnx

    scheme = scheme_for((manifest.options or {}).get("backend", "onnxruntime"))
    rewrite = rewrite_graph_qdq if scheme == QDQ else rewrite_graph
    mods = matmul_modules(model, manifest)
    twins, graphs, n_q, n_left = {}, dict(manifest.graphs), 0, 0
    for g, spec in manifest.graphs.items():
        path = folder / spec.file
        proto = onnx.load(str(path), load_external_data=False)
        n_before = sum(n.op_type in ("MatMul", "Gemm") for n in proto.graph.node)
        tw, arrays, left = rewrite(proto, real.get(g, {}), set(mods.get(g, {})))
        if scheme == QDQ:  # the matmuls now reading a DequantizeLinear output
            dq = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
            n_q += sum(n.op_type in ("MatMul", "Gemm") and n.input[1] in dq for n in proto.graph.node)
        else:  # the matmuls rewritten to MatMulInteger
            n_q += n_before - sum(n.op_type in ("MatMul", "Gemm") for n in proto.graph.node)
        n_left += left
        if tw:
            twins[g] = tw
        _write_graph(proto, ChainMap(arrays, real.get(g, {})), path)  # lazy: one fp32 weight at a time
        graphs[g] = replace(spec, sha256=_sha256_files([path]), weights_sha256=_sha256_files([folder / spec.data]))
    if not n_q:
        raise RefitError("quantize int8: no weight matmul of this model maps to a Linear or Conv1D layer; "
                         "nothing to quantize")
    hashes = replace(manifest.hashes, graphs_sha256={g: v.sha256 for g, v in graphs.items()},
                     engine_weights_sha256={g: v.weights_sha256 for g, v in graphs.items()})
    reference = ("PyTorch uncached forward, quantized Linear/Conv1D layers as refit.core.int8.QDQLinear (fp32 "
                 "matmul by the dequantized int8 weights)" if scheme == QDQ else
                 "PyTorch uncached forward, quantized Linear/Conv1D layers as refit.core.int8.int8_linear")
    quant = Quantization(scheme=scheme, weights=twins, quantized_matmuls=n_q, float_matmuls=n_left,
                         reference=reference,
                         max_abs_logprob_diff=float("nan"), tolerance_logprob=float("nan"), gap_vs_fp32={})
    manifest = replace(manifest, graphs=graphs, hashes=hashes, quantization=quant)
    manifest.write(folder)
    return manifest
