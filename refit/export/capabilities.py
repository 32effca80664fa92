"""What the exporter needs from a checkpoint, decided from its config and a probe, not its model type.

Any ``AutoModelForCausalLM`` or ``AutoModelForSeq2SeqLM`` checkpoint is accepted when its forward
keeps attention keys and values in the transformers ``Cache`` interface; the graphs are traced
through HF's own forward, so the family's details (learned positions stored from an offset,
sinusoidal or partially rotary positions, scaled embeddings, ``final_logits_bias``, grouped KV
heads, sliding windows) are computed by HF's code and only recorded here. What the engines need
to be told is measured on the loaded model:

- the KV cache geometry (layers, KV heads, head size) from one cached forward (:func:`probe_cache`);
- decoder-only: that ``position_ids`` reach the model, so a left-padded prompt scores as it
  would alone (:func:`probe_padding`); encoder-decoder: that the encoder's output does not move
  with padding on the tokenizer's native side (right for T5, BART, Marian; the seed thread's
  negative KL came from forcing left padding there);
- encoder-decoder: ``decoder_start_token_id`` (Marian starts from the pad id, BART from eos).

A model that lacks one is refused by :func:`detect` in one line naming the missing capability,
before the exporter writes anything. The parity gate (:mod:`refit.rollout.parity`) stays the judge of
what the engine computes.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from refit.core.contract import decoder_start_id
from refit.core.errors import RefitError
from refit.core.hf_compat import cache_kw, cache_of
from refit.core.manifest_sections import Capabilities
from refit.core.padding import pad_batch, position_ids_from_mask

PROBE_TOL = 1e-4  # max |logit| / |hidden| difference a padding probe allows (fp32)
_PROBE_IDS = [5, 6, 7]  # any ids >= 4 (past the special tokens) of any vocabulary


def refuse(path, what: str) -> RefitError:
    return RefitError(f"cannot export {path}: {what}")


def _accepts(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params


# ----------------------------------------------------------------------------- static facts


def _position_kind(model, cfg) -> tuple[str, int, float | None]:
    """(kind, offset, rotary fraction) from the modules HF built for this config."""
    names = {type(m).__name__.lower() for m in model.modules()}
    if any("rotary" in n for n in names):
        rope = getattr(cfg, "rope_parameters", None) or {}
        frac = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        return "rotary", 0, float(frac)
    if any("sinusoidal" in n for n in names):
        return "sinusoidal", 0, None
    learned = [m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Embedding) and ("position" in n or n.endswith("wpe"))]
    if learned:
        return "learned", int(getattr(learned[0], "offset", 0)), None
    if getattr(cfg, "relative_attention_num_buckets", None):
        return "relative", 0, None
    return "none", 0, None


def _embed_scale(model) -> float:
    """The factor HF multiplies token embeddings by (BART-family ``embed_scale``), 1.0 when none."""
    for m in model.modules():
        scale = getattr(m, "embed_scale", None)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return float(scale)
    return 1.0


def _tied(model) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


def _has_logits_bias(model) -> bool:
    return "final_logits_bias" in model.state_dict()


def _n_heads(cfg) -> int:
    """Query heads of the decoder (BART-family configs name them apart from the encoder's)."""
    text = cfg.get_text_config()
    for key in ("decoder_attention_heads", "num_heads", "num_attention_heads"):
        if isinstance(getattr(text, key, None), int):
            return getattr(text, key)
    return 0


# ----------------------------------------------------------------------------- probes


def _kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """[(keys, values)] of a transformers Cache whose layers hold (B, H, T, D) tensors, else None."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    out = []
    for layer in layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4 and v.dim() == 4):
            return None
        out.append((k, v))
    return out


def _cached_forward(model, kind: str, start_id: int | None, cache):
    """One forward over 3 tokens with ``cache`` (None: the model builds its own) -> (output, self, cross)."""
    ids = torch.tensor([_PROBE_IDS])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    if cache is not None:
        kw.update(cache_kw(cache))
    if kind == "decoder":
        if _accepts(model.forward, "position_ids"):
            kw["position_ids"] = torch.arange(3)[None]
        out = model(**kw)
        return out, cache_of(out), None
    out = model(decoder_input_ids=torch.tensor([[start_id]]), **kw)
    c = cache_of(out)
    return out, getattr(c, "self_attention_cache", c), getattr(c, "cross_attention_cache", None)


def _same_heads(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[1] == b.shape[1] and a.shape[3] == b.shape[3]


@torch.no_grad()
def probe_cache(model, kind: str, start_id: int | None, path) -> dict:
    """Cached forwards over 3 tokens: the cache geometry, or a refusal naming what is missing.

    First with the cache the model builds itself (does it keep attention K/V at all?), then with
    the plain ``DynamicCache`` / ``EncoderDecoderCache`` the graph wrappers build.
    """
    from transformers import DynamicCache, EncoderDecoderCache

    try:
        _, own, _ = _cached_forward(model, kind, start_id, None)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is one refusal line
        raise refuse(path, f"its cached forward fails ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                           "missing capability: KV cache") from None
    if _kv_layers(own) is None:
        raise refuse(path, f"{type(model).__name__} keeps no per-layer attention keys/values in its cache "
                           f"({type(own).__name__}); missing capability: attention KV cache")
    plain = DynamicCache() if kind == "decoder" else EncoderDecoderCache(DynamicCache(), DynamicCache())
    try:
        out, self_cache, cross_cache = _cached_forward(model, kind, start_id, plain)
    except Exception as e:  # noqa: BLE001
        raise refuse(path, f"its forward fails with a plain transformers DynamicCache ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160]}); missing capability: Cache interface") from None
    layers = _kv_layers(self_cache)
    k = layers[0][0]
    if not all(_same_heads(kk, k) for kk, _ in layers):
        raise refuse(path, "its cache layers differ in heads or head size; missing capability: uniform KV cache")
    geo = {"n_layers": len(layers), "n_kv_heads": k.shape[1], "head_dim": k.shape[3]}
    if kind == "decoder":
        return {**geo, "hidden_size": model.get_input_embeddings().weight.shape[1]}
    cross = _kv_layers(cross_cache)
    if cross is None or len(cross) != len(layers) or not _same_heads(cross[0][0], k):
        raise refuse(path, "its cross-attention cache does not match its self-attention cache in layers, heads "
                           "or head size; missing capability: uniform encoder-decoder cache")
    return {**geo, "hidden_size": out.encoder_last_hidden_state.shape[-1]}


@torch.no_grad()
def probe_padding(model, kind: str, side: str, pad_id: int, path) -> None:
    """Refuse unless padding (decoder-only: left, positions from the mask; encoder: ``side``) is invisible."""
    ids, mask = (torch.from_numpy(a) for a in pad_batch([_PROBE_IDS, _PROBE_IDS + [8, 9]], pad_id,
                                                        "left" if kind == "decoder" else side))
    alone = torch.tensor([_PROBE_IDS])
    if kind == "decoder":
        padded = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[0, -1]
        ref = model(input_ids=alone, attention_mask=torch.ones_like(alone),
                    position_ids=torch.arange(3)[None]).logits[0, -1]
        what = "a left-padded prompt scores differently from the same prompt alone (positions from the mask)"
    else:
        enc = model.get_encoder()
        real = mask[0].bool()
        padded = enc(input_ids=ids, attention_mask=mask).last_hidden_state[0, real]
        ref = enc(input_ids=alone, attention_mask=torch.ones_like(alone)).last_hidden_state[0]
        what = f"its encoder output changes with {side}-padding (the tokenizer's padding side)"
    diff = float((padded.float() - ref.float()).abs().max())
    if not diff <= PROBE_TOL:
        raise refuse(path, f"{what}: max diff {diff:.2e} > {PROBE_TOL:g}; missing capability: padding-invariant "
                           "prompts")


def _decoder_start(model, path) -> int:
    start = decoder_start_id(model)
    if start is None:
        raise refuse(path, "an encoder-decoder config without decoder_start_token_id (in config.json or "
                           "generation_config.json); missing capability: decoder start token")
    return start


@contextlib.contextmanager
def _quiet_transformers():
    """The probes' 3-token forwards may log (e.g. a slow-kernel fallback); a refusal stays one line."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def detect(model, kind: str, padding_side: str, pad_id: int, path) -> Capabilities:
    """Capabilities of a loaded model (eval mode), or a one-line refusal naming the missing one."""
    cfg = model.config
    start = _decoder_start(model, path) if kind == "seq2seq" else None
    with _quiet_transformers():
        geo = probe_cache(model, kind, start, path)
        if kind == "decoder" and not _accepts(model.forward, "position_ids"):
            raise refuse(path, f"{type(model).__name__}.forward takes no position_ids, so a left-padded prompt "
                               "would be shifted; missing capability: position_ids")
        probe_padding(model, kind, padding_side, pad_id, path)
    positions, offset, frac = _position_kind(model, cfg)
    text = cfg.get_text_config()
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    return Capabilities(
        kind=kind, positions=positions, position_offset=offset, rotary_fraction=frac,
        embed_scale=_embed_scale(model), tied_head=_tied(model), final_logits_bias=_has_logits_bias(model),
        n_heads=_n_heads(cfg) or geo["n_kv_heads"], n_kv_heads=geo["n_kv_heads"], head_dim=geo["head_dim"],
        n_layers=geo["n_layers"], hidden_size=geo["hidden_size"], sliding_window=window,
        logits_to_keep=_accepts(model.forward, "logits_to_keep"), padding_side=padding_side,
        decoder_start_id=start,
    )
