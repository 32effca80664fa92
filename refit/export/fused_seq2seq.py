"""The fused-attention decoder graph of an encoder-decoder model: T5 (relative position bias), BART, Marian.

The encoder graph is the plain one (:class:`refit.export.wrappers.Seq2SeqEncoder`: encoder hidden states and
the cross-attention K/V ``cross.{i}.key/value``). The decoder graph is :class:`FusedSeq2SeqDecoder`:

- self-attention: ``refit::gqa`` -> ``com.microsoft.GroupQueryAttention`` over one preallocated KV buffer
  per layer, past and present bound to the same memory (as :mod:`refit.export.fused`), at HF's own ``scaling``
  (T5: 1.0, no 1/sqrt(d));
- T5's relative position bias as the op's ``attention_bias``, computed in the graph per row: query
  position = the row's token count before the chunk + s (the ``position_ids`` input), key positions
  ``0..C-1`` (C: the buffer's capacity), HF's own ``_relative_position_bucket`` (unidirectional) and
  the decoder's ``relative_attention_bias`` embedding (the same parameter, so the weight map stays 1:1).
  HF's own bias (``compute_bias(q, k, past_seen_tokens)``) assumes one cache length for every row and is
  dead code here;
- cross-attention: plain attention math over the ``cross.*`` inputs and the encoder mask (the K/V HF
  would project from the encoder output are dead code, the graph holds no cross K/V projection).

Self vs cross is told apart by the attention module's ``is_causal`` (T5: the decoder's
``SelfAttention`` True, ``EncDecAttention`` False). Measured on ORT 1.32's CPU kernel (a standalone
one-node model, B=2, N=2, D=8, rows of 5 and 2 tokens in a buffer of 8): ``attention_bias`` is
accepted with GroupQueryAttention and ``query_seqlens``, of shape (B, N, S, total), (1, N, S, total)
or (B, 1, S, total), indexed by absolute key position, max |diff| 8e-7 to a NumPy reference; its last
dim must equal ``total_sequence_length`` ("attention_bias dimension 3 must be equal to
total_sequence_length") and ``total_sequence_length`` may be the buffer capacity C, so the graph builds
the bias over C positions and the engine passes ``total_sequence_length = C``. The kernel wants
``head_size % 8 == 0``.

BART and Marian: no bias; their decoders embed absolute positions from one cache length shared by every
row (``embed_positions(input, cache_length)``) and their forward takes no position ids, while compact
rows of different lengths (idle finished rows) need each row's own. For the call, a forward hook makes
``decoder.embed_positions`` (an ``nn.Embedding``: BART's learned table with its offset of 2, Marian's
sinusoidal one) return the embeddings of the ``position_ids`` input per row; the rest (embedding scale,
layer norms, ``final_logits_bias``) is HF's forward. Parity 2.3e-07 on the export gate (tiny BART and Marian).
"""

from __future__ import annotations

import contextlib

import torch

from refit.core.errors import RefitError
from refit.export.fused import ACTIVE, active_state, gqa_attention, no_mask, translation_table

ATTN_S2S = "refit_gqa_seq2seq"  # the transformers attention implementation of the fused seq2seq decoder


def _cross_attention(query, key, value, enc_mask, scaling):
    """Plain attention of (B, N, S, D) queries over the encoder's (B, H, Se, D) K/V, padding masked out."""
    n = query.shape[1]
    if key.shape[1] != n:
        key, value = key.repeat_interleave(n // key.shape[1], 1), value.repeat_interleave(n // key.shape[1], 1)
    scores = query @ key.transpose(-1, -2) * scaling  # (B, N, S, Se)
    scores = scores.masked_fill(enc_mask[:, None, None, :] == 0, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


def _seq2seq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Decoder self-attention -> GroupQueryAttention with the state's per-row bias; cross -> plain math.

    HF's ``attention_mask`` and ``position_bias`` are ignored: the op masks by lengths, the bias and the
    encoder mask come from the fused call in progress."""
    st = ACTIVE[-1]
    if not module.is_causal:
        i = module.layer_idx
        return _cross_attention(query, st["cross"][2 * i], st["cross"][2 * i + 1], st["enc_mask"],
                                scaling if scaling is not None else query.shape[-1] ** -0.5)
    return gqa_attention(module, query, key, value, None, scaling=scaling)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_S2S, _seq2seq_attention)
    AttentionMaskInterface.register(ATTN_S2S, no_mask)


def _positions_module(model):
    """The decoder's absolute position embedding (BART: learned with an offset of 2; Marian: sinusoidal), or None."""
    emb = getattr(model.get_decoder(), "embed_positions", None)
    return emb if isinstance(emb, torch.nn.Embedding) else None


@contextlib.contextmanager
def _row_positions(emb, position_ids: torch.Tensor):
    """``emb`` returns each row's own positions' embeddings (B, S, H) for the block: HF's decoder asks it for
    positions from one cache length shared by every row (``embed_positions(input, cache_length)``)."""
    if emb is None:
        yield
        return
    offset = getattr(emb, "offset", 0)
    handle = emb.register_forward_hook(lambda mod, args, out: torch.nn.functional.embedding(position_ids + offset,
                                                                                           mod.weight))
    try:
        yield
    finally:
        handle.remove()


def _bias_module(model):
    """The decoder's one attention module holding the relative position bias (T5: block 0's), or None."""
    mods = [m for m in model.get_decoder().modules() if getattr(m, "has_relative_attention_bias", False)]
    return mods[0] if len(mods) == 1 and hasattr(mods[0], "_relative_position_bucket") else None


def relative_bias(attn, position_ids: torch.Tensor, capacity) -> torch.Tensor:
    """(B, N, S, capacity) T5 decoder bias: query at ``position_ids`` (B, S), keys at 0..capacity-1."""
    rel = torch.arange(capacity, device=position_ids.device)[None, None, :] - position_ids[:, :, None]
    bucket = attn._relative_position_bucket(rel, bidirectional=False, num_buckets=attn.relative_attention_num_buckets,
                                            max_distance=attn.relative_attention_max_distance)
    return attn.relative_attention_bias(bucket).permute(0, 3, 1, 2)


@contextlib.contextmanager
def _implementation(config, name: str):
    """The decoder config's attention implementation switched to ``name`` for the block (the encoder's
    config is another object and keeps its own)."""
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


class FusedSeq2SeqDecoder(torch.nn.Module):
    """(input_ids (B,S), position_ids (B,S), seqlens_k (B,), query_seqlens (B,), total_len () = C,
    logits_index (B,K), encoder_attention_mask (B,Se), *cross (B,H,Se,D), *past (B,H,C,D))
    -> (logits (B,K,V), *present (B,H,C,D)).

    HF's own forward (embeddings, norms, FF, output scaling, lm_head) with the attention function
    switched to :data:`ATTN_S2S` on the decoder's config for the duration of a call.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        register()
        self.model, self.rel, self.pos = model, _bias_module(model), _positions_module(model)
        if (self.rel is None) == (self.pos is None):
            raise RefitError(f"{type(model).__name__}: the decoder needs T5's relative_attention_bias or one "
                             "absolute position embedding (BART, Marian) to fuse, not both or neither")
        c = model.config
        self.n_layers, self.hidden = getattr(c, "num_decoder_layers", None) or c.decoder_layers, c.d_model

    def forward(self, input_ids, position_ids, seqlens_k, query_seqlens, total_len, logits_index,
                encoder_attention_mask, *flat):
        n = 2 * self.n_layers
        cross, past = flat[:n], flat[n:]
        state = dict(past=past, present=[None] * n, seqlens_k=seqlens_k, query_seqlens=query_seqlens,
                     total_len=total_len, cross=cross, enc_mask=encoder_attention_mask,
                     bias=None if self.rel is None else relative_bias(self.rel, position_ids, past[0].shape[2]))
        b, _, s, _ = cross[0].shape
        enc_hidden = cross[0].new_zeros(b, s, self.hidden)  # for HF's shapes only: cross K/V are inputs
        with active_state(state), _implementation(self.model.get_decoder().config, ATTN_S2S), \
                _row_positions(self.pos, position_ids):
            logits = self.model(encoder_outputs=(enc_hidden,), attention_mask=encoder_attention_mask,
                                decoder_input_ids=input_ids, use_cache=False).logits
        if any(p is None for p in state["present"]):
            raise RefitError(f"{type(self.model).__name__} does not route its decoder self-attention through "
                             "transformers' AttentionInterface")
        k = logits_index.shape[1]
        picked = logits.gather(1, logits_index[:, :, None].expand(b, k, logits.shape[-1]))  # (B, K, V)
        return (picked, *state["present"])


# ----------------------------------------------------------------------------- export


def seq2seq_refusal(model) -> str | None:
    """None when :class:`FusedSeq2SeqDecoder` applies to this encoder-decoder model, else why not (one line)."""
    dec = model.get_decoder()
    if (_bias_module(model) is None) == (_positions_module(model) is None):
        return (f"{type(model).__name__}: the fused decoder needs T5's relative_attention_bias or one absolute "
                "position embedding (an nn.Embedding at decoder.embed_positions), not both or neither")
    attn = [m for m in dec.modules() if hasattr(m, "is_causal") and type(m).__name__.endswith("Attention")]
    if not attn or any(getattr(m, "layer_idx", None) is None for m in attn):
        return "a decoder attention module does not know its layer index (layer_idx)"
    return None


def fused_seq2seq_spec(model, caps) -> dict:
    """The fused decoder graph spec (as :func:`refit.export.trace.graph_specs` returns)."""
    D = torch.export.Dim
    batch, seq, cap, keep, enc = D("batch"), D("seq"), D("cap"), D("keep"), D("enc_seq")
    L, H, Dh, B = caps.n_layers, caps.n_kv_heads, caps.head_dim, 2
    kv = lambda p: [f"{p}.{i}.{k}" for i in range(L) for k in ("key", "value")]  # noqa: E731
    args = (torch.full((B, 3), 5, dtype=torch.long), torch.arange(3).expand(B, 3).contiguous(),
            torch.tensor([2, 1], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32),
            torch.tensor(8, dtype=torch.int32), torch.tensor([[2, 1], [1, 0]]), torch.ones(B, 5, dtype=torch.long),
            *[torch.zeros(B, H, 5, Dh, dtype=model.dtype) for _ in range(2 * L)],
            *[torch.zeros(B, H, 8, Dh, dtype=model.dtype) for _ in range(2 * L)])
    past = kv("past")
    return dict(
        name="decoder", module=FusedSeq2SeqDecoder(model), args=args,
        inputs=["input_ids", "position_ids", "seqlens_k", "query_seqlens", "total_sequence_length", "logits_index",
                "encoder_attention_mask", *kv("cross"), *past],
        outputs=["logits", *[n.replace("past", "present", 1) for n in past]],
        dynamic={"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}, "seqlens_k": {0: batch},
                 "query_seqlens": {0: batch}, "total_len": None, "logits_index": {0: batch, 1: keep},
                 "encoder_attention_mask": {0: batch, 1: enc},
                 "flat": tuple([{0: batch, 2: enc}] * (2 * L) + [{0: batch, 2: cap}] * (2 * L))},
        translation=translation_table())
