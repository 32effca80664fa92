"""Mixture-of-experts layers in the engine graphs: every expert in the graph, each expert's rows only.

transformers 5 stores a MoE layer's experts as fused 3-D parameters (Mixtral, Qwen2/3-MoE:
``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)) and runs them through an
``experts_implementation`` (``@use_experts_implementation``): ``eager`` loops over the experts hit
(a data-dependent Python loop, which torch.export cannot trace), ``grouped_mm`` ends in
``transformers.grouped_mm_fallback`` / ``aten._grouped_mm`` (no ONNX translation in torch), and
``batched_mm`` gathers one (2I, H) weight matrix per (token, expert) pair: (S, 2I, H) floats, 470 MB
per token at Mixtral-8x7B's widths, so a 64-row decode step would gather 60 GB.

What is done here (the choice, and why). The exporter switches the traced copy's experts to
:data:`EXPERTS_IMPL`, a grouped forward in the style of transformers' ``grouped_mm``: the (token,
expert) pairs are sorted by expert, each expert's contiguous block of rows goes through
``refit::expert_linear`` (a torch custom op, opaque to torch.export, with a PyTorch reference
implementation), the activation, gating, routing weights and the return to token order stay in
traced PyTorch. :func:`translation_table` lowers the op to standard ONNX: per expert ``e`` a
``Slice`` of its rows and one ``Gemm(rows, Gather(W, e), transB=1)`` that reads the weight in HF's
own layout (no ``Transpose`` for the exporter to fold into a re-laid-out copy), then one ``Concat``.
So

- each 3-D expert tensor is one engine initializer, stored as HF stores it: the weight map holds
  it with ``identity`` (no new transform; :func:`refit.export.weight_map.check_one_to_one` unchanged) and
  a push writes it as is; ONNX Runtime folds the constant ``Gather`` per expert when the session
  opens, so no step copies an expert's weight;
- the work is sparse: an expert with no rows is a 0-row ``Gemm``; nothing is computed for the
  ``E - k`` experts a token does not use (a dense "every expert, masked" forward costs E/k times
  the FLOPs: 4x for Mixtral, 16x for Qwen3-30B-A3B), nothing like ``batched_mm``'s gathers.

Parity and speed, measured (``python -m refit.bench.moe --compare``, Qwen3-30B-A3B widths, 1 layer, 16 experts,
top-8, ONNX Runtime CPU, 2 shared cores, median of 5): this lowering 1203 ms (prefill 4x64) and 229 ms
(16 rows x 1 token); a dense "every expert, masked" forward 3396 ms and 1621 ms, i.e. 2.8x and 7.1x
slower, with the same parity (max |dlogit| vs PyTorch 4.4e-6 / 4.2e-6: both are fp32 re-orderings of
HF's sums).

What is refused, in one line, before anything is written (:func:`moe_refusal`): experts that are
not the ``@use_experts_implementation`` kind, interleaved gate/up, a post-expert norm, a custom
gate, and expert tensors small enough (<= 8192 values) for the ONNX optimiser's constant folding
to slice them per expert (the map could not express the slices).
"""

from __future__ import annotations

import torch

EXPERTS_IMPL = "refit_grouped"  # the transformers experts implementation registered here
_FOLD_LIMIT = 8192  # onnxscript's DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT: smaller inputs are folded


@torch.library.custom_op("refit::expert_linear", mutates_args=())
def expert_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows grouped by expert through their expert's linear map (the reference of the ONNX lowering).

    x (S, K), rows sorted by expert; weight (E, N, K) as HF stores it (``transposed``: (E, K, N));
    ends (E,) int64, cumulative row counts (expert e owns rows [ends[e-1], ends[e])). Returns (S, N).
    """
    out = x.new_empty(x.shape[0], weight.shape[2] if transposed else weight.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            w = weight[e] if transposed else weight[e].t()
            out[start:end] = x[start:end] @ w
        start = end
    return out


@expert_linear.register_fake
def _(x, weight, ends, transposed):
    return x.new_empty(x.shape[0], weight.shape[2] if transposed else weight.shape[1])


def _expert_linear_onnx(x, weight, ends, transposed: bool):
    """``refit::expert_linear`` -> per expert Slice(rows) + Gemm(rows, Gather(weight, e)) + one Concat."""
    from onnxscript import opset18 as op

    n_experts = weight.shape[0]
    if not isinstance(n_experts, int):
        raise ValueError("expert_linear: the number of experts must be static")
    axes = op.Constant(value_ints=[0])
    bounds = op.Split(op.Cast(ends, to=7), axis=0, num_outputs=n_experts) if n_experts > 1 else [op.Cast(ends, to=7)]
    start = op.Constant(value_ints=[0])
    outs = []
    for e in range(n_experts):
        rows = op.Slice(x, start, bounds[e], axes)  # (n_e, K)
        w = op.Gather(weight, op.Constant(value_int=e), axis=0)  # (N, K) as stored; folded by ONNX Runtime
        outs.append(op.Gemm(rows, w, transB=0 if transposed else 1))
        start = bounds[e]
    return op.Concat(*outs, axis=0) if n_experts > 1 else outs[0]


def translation_table() -> dict:
    """For ``torch.onnx.export(custom_translation_table=...)``."""
    return {torch.ops.refit.expert_linear.default: _expert_linear_onnx}


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts forward: hidden (N, H), top_k_index / top_k_weights (N, k) -> (N, H).

    The same sums as HF's eager loop (per (token, expert) pair: gate/up, activation, down, routing
    weight; then the k pairs of a token added), grouped by expert so each expert runs once.
    """
    n, k = top_k_index.shape
    ids = top_k_index.reshape(-1)  # (S,) S = N * k, pair p is token p // k
    order = torch.argsort(ids)  # (S,) pairs grouped by expert
    ends = (ids[:, None] == torch.arange(self.num_experts, device=ids.device)[None]).sum(0).cumsum(0)  # (E,)
    x = hidden_states[torch.div(order, k, rounding_mode="floor")]  # (S, H)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    y = torch.ops.refit.expert_linear(x, up, ends, self.is_transposed)  # (S, 2I) or (S, I)
    if self.has_bias:
        y = y + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[ids[order]]
    y = self._apply_gate(y) if self.has_gate else self.act_fn(y)  # (S, I)
    y = torch.ops.refit.expert_linear(y, self.down_proj, ends, self.is_transposed)  # (S, H)
    if self.has_bias:
        y = y + self.down_proj_bias[ids[order]]
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    y = y[torch.argsort(order)]  # back to pair order
    return y.view(n, k, -1).sum(1).to(hidden_states.dtype)


def register() -> None:
    """Register :func:`grouped_experts_forward` with transformers' ExpertsInterface; idempotent."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, grouped_experts_forward)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every MoE experts block: a module holding a 3-D expert parameter."""
    return [(n, m) for n, m in model.named_modules()
            if any(p.dim() == 3 for p in m.parameters(recurse=False)) and hasattr(m, "num_experts")]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(experts_modules(model))


def moe_refusal(model: torch.nn.Module) -> str | None:
    """None when every experts block can run :data:`EXPERTS_IMPL`, else why not (one line)."""
    from transformers.integrations.moe import _default_apply_gate

    for name, m in experts_modules(model):
        flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
        if not all(hasattr(m, f) for f in flags) or not hasattr(getattr(m, "config", None), "_experts_implementation"):
            return f"{name} ({type(m).__name__}) is not a transformers @use_experts_implementation experts block"
        if not m.is_concatenated:
            return f"{name}: interleaved gate/up expert weights are not supported"
        if m.has_post_expert_norm:
            return f"{name}: a post-expert norm is not supported"
        if m.has_gate and type(m)._apply_gate is not _default_apply_gate:
            return f"{name}: a custom expert gate ({type(m).__name__}._apply_gate) is not supported"
        small = [pn for pn, p in m.named_parameters(recurse=False) if p.dim() == 3 and p.numel() <= _FOLD_LIMIT]
        if small:
            return (f"{name}.{small[0]} holds <= {_FOLD_LIMIT} values: the ONNX optimiser would fold it into one "
                    "slice per expert, which the weight map cannot express")
    return None


def use_grouped_experts(model: torch.nn.Module) -> None:
    """Switch ``model``'s experts to :data:`EXPERTS_IMPL` (the traced copy only; the reference keeps its own)."""
    register()
    model.set_experts_implementation(EXPERTS_IMPL)
    for _, m in experts_modules(model):  # sub-configs (and modules holding their own config) follow
        m.config._experts_implementation = EXPERTS_IMPL
