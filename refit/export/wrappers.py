"""Thin torch modules with fixed, flat I/O that ``torch.onnx.export`` turns into engine graphs.

HF models in transformers 5.x take ``Cache`` objects, not tuples; these wrappers take the KV
cache as flat tensors named ``past.{i}.key`` / ``past.{i}.value`` (shape (B, H_kv, P, D)),
build the cache object inside the traced region and return ``present.{i}.*`` (B, H_kv, P+T, D).

Padding and positions are explicit inputs, never inferred in the graph:
- decoder-only: ``attention_mask`` (B, P+T) covers past and new tokens (left padding), and
  ``position_ids`` (B, T) come from the mask (:func:`refit.core.padding.position_ids_from_mask`).
  ``logits_index`` (K,) int64 picks the positions (along T) whose logits are computed, HF's
  ``logits_to_keep`` as a 1-D tensor: prefill asks for the last prompt position only (the
  (B, T, V) lm_head of a whole prompt costs as much as ~T decode steps), decode for [0], and
  ``score()`` for every position of its chunk.
- encoder-decoder: the encoder gets ``input_ids``/``attention_mask`` (B, S) padded on the
  model's native side (right for T5, BART, Marian); it also returns the decoder's
  cross-attention K/V (``cross.{i}.key``/``value``, (B, H, S, D)) so the decoder never
  recomputes them. They are taken from HF's own cache after one decoder step over the encoder
  output, so no family's attention module is named here (the step's other outputs are dead code
  the exporter drops).

Every cache is built without the config: plain full layers, so a sliding-window model (Mistral)
keeps every position and HF's sliding mask does the windowing, and the present K/V is always
(B, H_kv, P+T, D), whatever the layer type.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache

from refit.core.hf_compat import cache_kw, cache_of


def _fill(cache: DynamicCache, flat: tuple[torch.Tensor, ...]) -> DynamicCache:
    for i in range(len(flat) // 2):
        cache.update(flat[2 * i], flat[2 * i + 1], i)
    return cache


def _flatten(cache: DynamicCache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    return out


class DecoderWithPast(torch.nn.Module):
    """(input_ids, attention_mask, position_ids, logits_index, *past) -> (logits (B, K, V), *present).

    ``keep_arg``: the model's forward takes ``logits_to_keep`` (only K rows reach the lm_head);
    otherwise the rows are picked from the full logits.
    """

    def __init__(self, model: torch.nn.Module, keep_arg: bool = True):
        super().__init__()
        self.model, self.keep_arg = model, keep_arg

    def forward(self, input_ids, attention_mask, position_ids, logits_index, *past):
        cache = _fill(DynamicCache(), past)
        kw = {"logits_to_keep": logits_index} if self.keep_arg else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **cache_kw(cache), **kw)
        logits = out.logits if self.keep_arg else out.logits.index_select(1, logits_index)
        return (logits, *_flatten(cache_of(out)))


class Seq2SeqEncoder(torch.nn.Module):
    """(input_ids, attention_mask) -> (encoder_hidden_states, *cross) for encoder-decoder models."""

    def __init__(self, model: torch.nn.Module, start_id: int):
        super().__init__()
        self.model, self.start_id = model, start_id

    def forward(self, input_ids, attention_mask):
        hidden = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full_like(input_ids[:, :1], self.start_id)
        # one decoder step fills the cross-attention cache with K/V projected from `hidden`
        self.model(encoder_outputs=(hidden,), attention_mask=attention_mask, decoder_input_ids=start,
                   cache=cache, use_cache=True)
        return (hidden, *_flatten(cache.cross_attention_cache))


class Seq2SeqDecoderWithPast(torch.nn.Module):
    """(decoder_input_ids, encoder_attention_mask, *cross, *past) -> (logits, *present).

    The cross-attention cache is pre-filled from the encoder's outputs and marked as computed,
    so the decoder graph holds no cross K/V projection. ``encoder_hidden_states`` is only used
    by HF for its shape here; a zero tensor of the right shape is built from the cross keys.
    """

    def __init__(self, model: torch.nn.Module, n_layers: int, hidden_size: int):
        super().__init__()
        self.model, self.n_layers, self.hidden_size = model, n_layers, hidden_size

    def forward(self, decoder_input_ids, encoder_attention_mask, *flat):
        n = 2 * self.n_layers
        cross, past = flat[:n], flat[n:]
        cache = EncoderDecoderCache(_fill(DynamicCache(), past), _fill(DynamicCache(), cross))
        for i in range(self.n_layers):
            cache.is_updated[i] = True
        b, _, s, _ = cross[0].shape
        enc_hidden = cross[0].new_zeros(b, s, self.hidden_size)
        out = self.model(
            encoder_outputs=(enc_hidden,), attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids, use_cache=True, **cache_kw(cache),
        )
        return (out.logits, *_flatten(cache_of(out).self_attention_cache))
