"""Edits of a traced graph before it is written: its initializers as views, its weights as placeholders, and tied
heads as ``Gemm`` over the stored weight.

:func:`refit.export.onnx_export.export_onnx` maps the traced graphs' weights by content (:func:`initializer_views`, no
copies), writes each graph with every mapped weight a placeholder that :func:`refit.export.graph.write_graph` points at
the real bytes (:func:`placeholder_proto`), and rewrites ``MatMul(A, Transpose(W))`` so that ONNX Runtime never folds a
transposed copy of ``W`` (:func:`gemm_for_transposed_weights`).
"""

from __future__ import annotations

import numpy as np


def gemm_for_transposed_weights(proto) -> int:
    """Rewrite ``MatMul(A, Transpose(W))`` on a 2-D initializer ``W`` as ``Gemm(A_2d, W, transB=1)``.

    The exporter leaves a tied embedding used by the lm_head (GPT-2, T5) as ``Transpose`` of the
    initializer; ONNX Runtime then constant-folds a transposed copy at every session creation
    (for GPT-2 small a 154 MB transpose on every weight push, plus its memory).
    ``Gemm`` with ``transB`` reads ``W`` as stored (MLAS pre-packs either layout), the map keeps
    the initializer unchanged. A of any rank: Reshape to (-1, K) and back to A's leading dims.
    Returns the number of MatMuls rewritten.
    """
    from onnx import helper, numpy_helper

    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    done = 0
    for mm in [n for n in g.node if n.op_type == "MatMul"]:
        tr = producer.get(mm.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits or len(inits[tr.input[0]].dims) != 2:
            continue
        perm = [list(a.ints) for a in tr.attribute if a.name == "perm"]
        if perm and perm[0] != [1, 0]:
            continue
        w = inits[tr.input[0]]
        n_out, k = int(w.dims[0]), int(w.dims[1])
        p = f"{mm.name or mm.output[0]}_gemm"
        g.initializer.extend([numpy_helper.from_array(np.array([-1, k], np.int64), f"{p}_2d"),
                              numpy_helper.from_array(np.array([n_out], np.int64), f"{p}_n")])
        new = [helper.make_node("Reshape", [mm.input[0], f"{p}_2d"], [f"{p}_a"], name=f"{p}_in"),
               helper.make_node("Gemm", [f"{p}_a", w.name], [f"{p}_y"], name=p, transB=1),
               helper.make_node("Shape", [mm.input[0]], [f"{p}_lead"], name=f"{p}_shape", start=0, end=-1),
               helper.make_node("Concat", [f"{p}_lead", f"{p}_n"], [f"{p}_out_shape"], name=f"{p}_cat", axis=0),
               helper.make_node("Reshape", [f"{p}_y", f"{p}_out_shape"], [mm.output[0]], name=f"{p}_out")]
        at = list(g.node).index(mm)
        g.node.remove(mm)
        for i, node in enumerate(new):
            g.node.insert(at + i, node)
        consumers[tr.output[0]] -= 1
        if consumers[tr.output[0]] == 0:
            g.node.remove(tr)
        done += 1
    return done


def initializer_views(model) -> dict[str, np.ndarray]:
    """{name: array} of an ``onnx_ir`` model's initializers: numpy views of the tensors' own memory (the traced
    module's parameters, the optimiser's folded arrays), the dtypes ``onnx.numpy_helper.to_array`` gives; no copies."""
    return {name: v.const_value.numpy() for name, v in model.graph.initializers.items() if v.const_value is not None}


def placeholder_proto(model, weights: set[str]):
    """The ``ModelProto`` of an ``onnx_ir`` model with each initializer in ``weights`` a placeholder: an external-data
    record with its dims and dtype and no bytes (:func:`refit.export.graph.write_graph` points it at the real
    weight's bytes). The rest (shapes, graph constants) inline. Replaces those initializers in ``model`` too, so
    it no longer holds their (fingerprinted) tensors."""
    import onnx_ir as ir

    for name in weights:
        v = model.graph.initializers[name]
        t = v.const_value
        v.const_value = ir.ExternalTensor("placeholder", 0, t.nbytes, t.dtype, shape=t.shape, name=name)
    return ir.serde.serialize_model(model)
