"""Thin torch modules with fixed, flat I/O that ``torch.onnx.export`` turns into engine graphs.

HF models in transformers 5.x take ``Cache`` objects, not tuples; these wrappers take the KV
cache as flat tensors named ``past.{i}.key`` / ``past.{i}.value`` (shape (B, H_kv, P, D)),
build the cache object inside the traced region and return ``present.{i}.*`` (B, H_kv, P+T, D).

Padding and positions are explicit inputs, never inferred in the graph:
- decoder-only: ``attention_mask`` (B, P+T) covers past and new tokens (left padding), and
  ``position_ids`` (B, T) come from the mask (:func:`export.padding.position_ids_from_mask`).
  ``logits_index`` (K,) int64 picks the positions (along T) whose logits are computed, HF's
  ``logits_to_keep`` as a 1-D tensor: prefill asks for the last prompt position only (the
  (B, T, V) lm_head of a whole prompt costs as much as ~T decode steps), decode for [0], and
  ``score()`` for every position of its chunk.
- encoder-decoder: the encoder gets ``input_ids``/``attention_mask`` (B, S) padded on the
  model's native side (right for T5); it also returns the decoder's cross-attention K/V
  (``cross.{i}.key``/``value``, (B, H, S, D)) so the decoder never recomputes them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache


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
    """(input_ids, attention_mask, position_ids, logits_index, *past) -> (logits (B, K, V), *present)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, logits_index, *past):
        cache = _fill(DynamicCache(config=self.model.config), past)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True, logits_to_keep=logits_index,
        )
        return (out.logits, *_flatten(out.past_key_values))


class Seq2SeqEncoder(torch.nn.Module):
    """(input_ids, attention_mask) -> (encoder_hidden_states, *cross) for encoder-decoder models."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        hidden = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        cross = []
        b, s, _ = hidden.shape
        for block in self.model.get_decoder().block:
            attn = block.layer[1].EncDecAttention
            cross.append(attn.k(hidden).view(b, s, attn.n_heads, attn.key_value_proj_dim).transpose(1, 2))
            cross.append(attn.v(hidden).view(b, s, attn.n_heads, attn.key_value_proj_dim).transpose(1, 2))
        return (hidden, *cross)


class Seq2SeqDecoderWithPast(torch.nn.Module):
    """(decoder_input_ids, encoder_attention_mask, *cross, *past) -> (logits, *present).

    The cross-attention cache is pre-filled from the encoder's outputs and marked as computed,
    so the decoder graph holds no cross K/V projection. ``encoder_hidden_states`` is only used
    by HF for its shape here; a zero tensor of the right shape is built from the cross keys.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_decoder_layers

    def forward(self, decoder_input_ids, encoder_attention_mask, *flat):
        n = 2 * self.n_layers
        cross, past = flat[:n], flat[n:]
        cache = EncoderDecoderCache(
            _fill(DynamicCache(config=self.model.config), past), _fill(DynamicCache(config=self.model.config), cross)
        )
        for i in range(self.n_layers):
            cache.is_updated[i] = True
        b, _, s, _ = cross[0].shape
        enc_hidden = cross[0].new_zeros(b, s, self.model.config.d_model)
        out = self.model(
            encoder_outputs=(enc_hidden,), attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids, past_key_values=cache, use_cache=True,
        )
        return (out.logits, *_flatten(out.past_key_values.self_attention_cache))
