"""Trace the export wrappers to ONNX and map the traced graphs' weights back to HF names by content.

:func:`graph_specs` names each graph's wrapper, example inputs, I/O names and dynamic dims; :func:`trace_and_map`
fingerprints the model in place (:func:`refit.export.weight_map.fingerprint_`), traces every graph with
``torch.onnx.export(dynamo=True)`` and builds the HF -> engine weight map from the fingerprints
(:mod:`refit.export.weight_map`). What it returns holds no reference to the model's tensors: the caller
(:func:`refit.export.onnx_export.export_onnx`) loads the real weights again to write them.
"""

from __future__ import annotations

import torch

from refit.core.errors import RefitError
from refit.export.capabilities import Capabilities
from refit.export.fused import fused_spec
from refit.export.fused_seq2seq import fused_seq2seq_spec
from refit.export.lora import add_adapter_branches, lora_record, resolve_targets
from refit.export.moe import translation_table as moe_translation, use_grouped_experts
from refit.export.rewrite import gemm_for_transposed_weights, initializer_views, placeholder_proto
from refit.export.weight_map import (build_weight_map, canonical_params, check_one_to_one, fingerprint_, graph_buffers,
                                     weight_derived_values, weight_digests)
from refit.export.wrappers import DecoderWithPast, Seq2SeqDecoderWithPast, Seq2SeqEncoder

OPSET = 18


def _kv_names(prefix: str, n_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def graph_specs(model, caps: Capabilities, attention: str = "plain") -> list[dict]:
    """Per graph: wrapper, example inputs, I/O names, dynamic dims. Dim names are the manifest's."""
    if attention == "fused" and caps.kind == "decoder":
        return [fused_spec(model, caps)]
    D = torch.export.Dim
    batch, seq, past, total, enc, keep = D("batch"), D("seq"), D("past"), D("total"), D("enc_seq"), D("keep")
    L, H, Dh, B = caps.n_layers, caps.n_kv_heads, caps.head_dim, 2
    kv = lambda n: [torch.zeros(B, H, n, Dh, dtype=model.dtype) for _ in range(2 * L)]  # noqa: E731
    if caps.kind == "decoder":
        ids = torch.full((B, 3), 5, dtype=torch.long)
        return [dict(
            name="decoder", module=DecoderWithPast(model, caps.logits_to_keep),
            # logits_index: 2 of the 3 positions (not 1: torch.export specialises size-1 dims)
            args=(ids, torch.ones(B, 7, dtype=torch.long), torch.arange(4, 7).expand(B, 3).contiguous(),
                  torch.tensor([0, 2]), *kv(4)),
            inputs=["input_ids", "attention_mask", "position_ids", "logits_index", *_kv_names("past", L)],
            outputs=["logits", *_kv_names("present", L)],
            dynamic={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
                     "position_ids": {0: batch, 1: seq}, "logits_index": {0: keep},
                     "past": tuple({0: batch, 2: past} for _ in range(2 * L))},
        )]
    ids = torch.full((B, 5), 5, dtype=torch.long)
    encoder = dict(name="encoder", module=Seq2SeqEncoder(model, caps.decoder_start_id),
                   args=(ids, torch.ones(B, 5, dtype=torch.long)),
                   inputs=["input_ids", "attention_mask"], outputs=["encoder_hidden_states", *_kv_names("cross", L)],
                   dynamic={"input_ids": {0: batch, 1: enc}, "attention_mask": {0: batch, 1: enc}})
    if attention == "fused":  # the plain encoder, the fused decoder (refit/export/fused_seq2seq.py)
        return [encoder, fused_seq2seq_spec(model, caps)]
    return [
        encoder,
        dict(name="decoder", module=Seq2SeqDecoderWithPast(model, L, caps.hidden_size),
             args=(torch.full((B, 2), 5, dtype=torch.long), torch.ones(B, 5, dtype=torch.long), *kv(5), *kv(3)),
             inputs=["decoder_input_ids", "encoder_attention_mask", *_kv_names("cross", L), *_kv_names("past", L)],
             outputs=["logits", *_kv_names("present", L)],
             dynamic={"decoder_input_ids": {0: batch, 1: seq}, "encoder_attention_mask": {0: batch, 1: enc},
                      "flat": tuple([{0: batch, 2: enc}] * (2 * L) + [{0: batch, 2: past}] * (2 * L))}),
    ]


def _trace(spec: dict, weights: set[str]):
    """torch.onnx.export of one wrapper: (the optimised ``onnx_ir`` model, provenance).

    The model's initializers are the traced module's own tensors (or the optimiser's folded ones), not copies;
    no ``ModelProto`` with every weight inline is made (:func:`refit.export.rewrite.placeholder_proto` makes one
    without them).

    Exported unoptimised first, so :func:`refit.export.weight_map.weight_derived_values` can see which values
    the weights (content digests ``weights``) reach before constant folding hides it; then optimised
    exactly as ``torch.onnx.export(optimize=True)`` does.
    """
    import warnings

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            prog = torch.onnx.export(
                spec["module"], spec["args"], input_names=spec["inputs"], output_names=spec["outputs"],
                dynamic_shapes=spec["dynamic"], dynamo=True, opset_version=OPSET, verbose=False, optimize=False,
                custom_translation_table={**moe_translation(), **(spec.get("translation") or {})},
            )
        except Exception as e:  # noqa: BLE001 - a forward torch.onnx cannot export is one refusal line
            raise RefitError(f"cannot export the {spec['name']} graph: torch.onnx.export failed on the model's "
                             f"forward ({_first_line(e)})") from None
        provenance = weight_derived_values(prog.model.graph, weights)
        prog.optimize()
    return prog.model, provenance


def _first_line(e: Exception) -> str:
    """``Type: message`` of an exception, its first non-empty line, at most 300 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def trace_and_map(model, caps: Capabilities, attention: str, dtype: torch.dtype, moe: bool,
                   lora: tuple[str, ...] = ()) -> tuple:
    """Fingerprint ``model`` in place (:func:`refit.export.weight_map.fingerprint_`: its real weights are gone),
    trace its graphs and map them by content; with ``lora`` (PEFT target_modules) the targeted layers get their
    adapter branches (refit/export/lora.py). Returns ({graph: (inputs, outputs)}, {graph: ModelProto with the mapped
    weights as placeholders}, weight map, constants, the Lora record or None); nothing returned refers to the
    model's tensors."""
    targets = None
    if lora:
        targets = resolve_targets(model, lora)
    fingerprint_(model)
    if moe:
        use_grouped_experts(model)  # the traced model's experts run as refit::expert_linear (refit/export/moe.py)
    fp_params, tied = canonical_params(model)
    specs = graph_specs(model, caps, attention)
    io = {s["name"]: (tuple(s["inputs"]), tuple(s["outputs"])) for s in specs}
    by_digest = weight_digests(fp_params, dtype)  # once: the trace's provenance and the map both read it
    digests = {d for d, (_, how) in by_digest.items() if how == "identity"}
    traced = {s["name"]: _trace(s, digests) for s in specs}
    del specs
    wmap, constants = build_weight_map(fp_params, {g: initializer_views(m) for g, (m, _) in traced.items()},
                                       dtype, {g: prov for g, (_, prov) in traced.items()},
                                       graph_buffers(model, fp_params), by_digest)
    check_one_to_one(wmap)
    protos, placed = {}, {}
    for g, (m, _) in traced.items():
        protos[g] = placeholder_proto(m, {t.engine for ts in wmap.values() for t in ts if t.graph == g})
        gemm_for_transposed_weights(protos[g])
        if targets:
            weight = lambda mod: tied.get(f"{mod}.weight", f"{mod}.weight")  # noqa: E731 - a tied alias: its owner
            engine_of = {mod: t.engine for mod in targets for t in wmap.get(weight(mod), ()) if t.graph == g}
            for mod in add_adapter_branches(protos[g], g, targets, engine_of):
                placed.setdefault(mod, []).append(g)
    record = None
    if targets:
        record = lora_record(lora, targets, placed)
    _free_storage(fp_params.values())
    return io, protos, wmap, constants, record


def _free_storage(tensors) -> None:
    """Give back the memory of ``tensors`` (the fingerprinted weights, read by now) whoever still refers to them:
    onnxscript's rewrite rules (``SimplePatternMatcher._graph``) keep the last graph they matched, and with it the
    traced module's parameters (measured: 29 of 38 parameters of a 4-layer SmolLM2 alive after the trace returned
    and a gc). Each tensor object is emptied (``.data`` swapped for an empty tensor) rather than its storage
    resized: the weights transformers loads are views of the checkpoint's file mapping, which cannot be resized."""
    with torch.no_grad():
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
