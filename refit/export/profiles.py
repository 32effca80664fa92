"""Shape profiles and named dynamic dimensions of the engine graphs.

Two profiles per decoder graph, as TensorRT needs them (one optimization profile each) and
as the manifest records them: ``prefill`` (the whole prompt, empty cache) and ``decode`` (one
new token per row, a cache of 1..max_len-1). The encoder has one profile.
Each profile is ``{input: ShapeRange(min, opt, max)}`` (:class:`refit.core.manifest_sections.ShapeRange`).
"""

from __future__ import annotations

from refit.core.manifest_sections import Capabilities, Profiles, ShapeRange


def dynamic_dims(caps: Capabilities) -> dict[str, str]:
    """Every named dynamic dimension and what it means."""
    dims = {"batch": "rows in the batch (prompts x samples)", "seq": "new tokens in this call",
            "past": "tokens already in the KV cache"}
    if caps.kind == "decoder":
        dims["total"] = "past + seq: attention_mask length"
        dims["keep"] = "positions of the new tokens whose logits are returned (logits_index length, <= seq)"
    else:
        dims["enc_seq"] = "encoder input length"
    return dims


def _kv(caps: Capabilities, prefix: str, b: int, n: int) -> dict[str, list[int]]:
    return {f"{prefix}.{i}.{k}": [b, caps.n_kv_heads, n, caps.head_dim]
            for i in range(caps.n_layers) for k in ("key", "value")}


def _profile(mins: dict, opts: dict, maxs: dict) -> dict[str, ShapeRange]:
    return {name: ShapeRange(tuple(mins[name]), tuple(opts[name]), tuple(maxs[name])) for name in mins}


def shape_profiles(caps: Capabilities, max_batch: int, max_len: int) -> Profiles:
    """{graph: {profile_name: {input: ShapeRange}}}, profiles in TensorRT's order."""
    ob, ol = max(1, max_batch // 2), max(1, max_len // 2)
    if caps.kind == "decoder":
        def shapes(b, s, p, k):
            d = {"input_ids": [b, s], "attention_mask": [b, p + s], "position_ids": [b, s], "logits_index": [k]}
            d.update(_kv(caps, "past", b, p))
            return d
        # prefill normally keeps 1 position (the last), a full-prompt score up to max_len; decode keeps [0]
        return {"decoder": {
            "prefill": _profile(shapes(1, 1, 0, 1), shapes(ob, ol, 0, 1), shapes(max_batch, max_len, 0, max_len)),
            "decode": _profile(shapes(1, 1, 1, 1), shapes(ob, 1, ol, 1), shapes(max_batch, 1, max_len - 1, 1)),
        }}

    def enc(b, s):
        return {"input_ids": [b, s], "attention_mask": [b, s]}

    def dec(b, s, e, p):
        d = {"decoder_input_ids": [b, s], "encoder_attention_mask": [b, e]}
        d.update(_kv(caps, "cross", b, e))
        d.update(_kv(caps, "past", b, p))
        return d

    return {
        "encoder": {"encode": _profile(enc(1, 1), enc(ob, ol), enc(max_batch, max_len))},
        "decoder": {
            "prefill": _profile(dec(1, 1, 1, 0), dec(ob, 1, ol, 0), dec(max_batch, max_len, max_len, 0)),
            "decode": _profile(dec(1, 1, 1, 1), dec(ob, 1, ol, ol), dec(max_batch, 1, max_len, max_len - 1)),
        },
    }
