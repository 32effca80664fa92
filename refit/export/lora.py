"""LoRA-ready engines: the base exported once, each targeted linear layer given an adapter branch whose two
matrices are graph inputs.

For a target layer ``m`` (weight ``W``, multiplied in the graph by a ``MatMul`` or ``Gemm``), the graph computes

    y = x W^T (+ b)  +  (x A) B        A = lora.<m>.A (K, r),  B = lora.<m>.B (r, N)

where a push binds ``A = lora_A^T`` and ``B = scaling * lora_B^T`` of PEFT's adapter (``lora_A`` (r, K), ``lora_B``
(N, r), ``scaling = alpha / r``): PEFT's ``base_layer(x) + lora_B(lora_A(x)) * scaling``, the scale folded into B.
Both inputs have empty defaults (r = 0, an initializer of the same name: ONNX Runtime's overridable initializers),
so a run that binds nothing computes ``x W^T + 0`` and is the base exactly, bit for bit: the PPO reference is the
same sessions with the adapter unbound (one copy of the base). The rank is a dynamic dimension: one export serves
any r. Nothing about the base changes: its weights, the weight map and an int8 rewrite (refit/export/quantize.py
quantizes the matmuls by mapped weights, never these) are as without LoRA.

Why graph inputs bound per run and not ``onnxruntime.LoraAdapter``: both bind the same kind of inputs (ORT's
adapters are overridable initializers too), but an ``LoraAdapter`` is read from its own file format
(``AdapterFormat``) once per push and activated through ``RunOptions``; bound ``OrtValue`` s over the engine's own
numpy buffers take a push as an in-place copy of the adapter's bytes, with nothing to serialise
(docs/lora.md has the measurement).

Which layers: PEFT decides (``target_modules`` as PEFT spells it, ``all-linear`` included), by injecting an adapter
into a copy of the model built on the meta device (no memory), so the engine and the learner's ``PeftModel`` name
the same layers.
"""

from __future__ import annotations

import torch

from refit.core.contract import peft_lora_model
from refit.core.errors import RefitError
from refit.core.manifest_sections import Lora, LoraTarget, lora_inputs

RANK_DIM = "lora_rank"  # the dynamic dimension of every adapter input


def resolve_targets(model: torch.nn.Module, target_modules) -> dict[str, tuple[int, int]]:
    """{HF module name: (in_features, out_features)} of the layers PEFT puts an adapter on for ``target_modules``;
    RefitError (one line) when they match nothing or name a layer PEFT cannot adapt."""
    from peft.tuners.lora import LoraLayer

    with torch.device("meta"):
        shell = type(model)._from_config(model.config)
    peft_model = peft_lora_model(shell, target_modules)
    inner = peft_model.base_model.model
    out = {name: (m.in_features, m.out_features) for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    if not out:
        raise RefitError(f"lora: target_modules {list(target_modules)} match no linear layer of this model")
    return out


def _attr(node, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return a.i
    return default


def add_adapter_branches(proto, graph: str, targets: dict[str, tuple[int, int]], engine_of: dict[str, str]) -> list[str]:
    """Give each target whose weight this graph multiplies its adapter branch, in place; the targets done.

    ``engine_of``: {HF module name: the engine initializer of its ``weight`` in this graph}. The weight's one
    ``MatMul`` (x, W^T) or ``Gemm`` (x, W, transA 0) reader gets ``Add(y, MatMul(MatMul(x, A), B))`` after it.
    A weight read by no such node, or by several, is one RefitError line (its adapter could not be applied)."""
    from onnx import TensorProto, helper

    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list] = {}
    for node in g.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
            readers.setdefault(node.input[1], []).append(node)
    done, inserts = [], {}
    for module, weight in engine_of.items():
        if module not in targets:
            continue
        nodes = readers.get(weight, [])
        if len(nodes) != 1 or (nodes[0].op_type == "Gemm" and _attr(nodes[0], "transA", 0) != 0):
            raise RefitError(f"lora: layer {module}'s weight ({graph}:{weight}) is read by {len(nodes)} matmul "
                             "node(s) of the exported graph, not one plain MatMul/Gemm; it cannot take an adapter")
        node, (k, n) = nodes[0], targets[module]
        elem = inits[weight].data_type if weight in inits else TensorProto.FLOAT
        a_in, b_in = lora_inputs(module)
        g.input.extend([helper.make_tensor_value_info(a_in, elem, [k, RANK_DIM]),
                        helper.make_tensor_value_info(b_in, elem, [RANK_DIM, n])])
        g.initializer.extend([helper.make_tensor(a_in, elem, [k, 0], []), helper.make_tensor(b_in, elem, [0, n], [])])
        y = node.output[0]
        base = f"{a_in[:-2]}.base_out"
        node.output[0] = base
        inserts[id(node)] = [
            helper.make_node("MatMul", [node.input[0], a_in], [f"{a_in[:-2]}.xa"], name=f"{a_in[:-2]}.mm_a"),
            helper.make_node("MatMul", [f"{a_in[:-2]}.xa", b_in], [f"{a_in[:-2]}.delta"], name=f"{a_in[:-2]}.mm_b"),
            helper.make_node("Add", [base, f"{a_in[:-2]}.delta"], [y], name=f"{a_in[:-2]}.add")]
        done.append(module)
    if inserts:
        new = []
        for node in g.node:
            new.append(node)
            new.extend(inserts.get(id(node), []))
        del g.node[:]
        g.node.extend(new)
    return done


def lora_record(target_modules, targets: dict[str, tuple[int, int]], placed: dict[str, list[str]]) -> Lora:
    """The manifest's :class:`Lora` record; RefitError when a target got no branch in any graph."""
    missing = sorted(m for m in targets if not placed.get(m))
    if missing:
        raise RefitError(f"lora: {len(missing)} target layers have no weight in the exported graphs, e.g. {missing[:3]}")
    return Lora(target_modules=tuple(target_modules),
                targets={m: LoraTarget(graphs=tuple(placed[m]), in_features=k, out_features=n)
                         for m, (k, n) in targets.items()})
