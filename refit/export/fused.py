"""Fused-attention decoder graphs: ONNX Runtime's ``com.microsoft.GroupQueryAttention`` over one
preallocated KV buffer per layer, past and present sharing memory.

The plain graph (:mod:`refit.export.wrappers`) takes the cache as ``past`` (B, H_kv, P, D) and returns
``present`` (B, H_kv, P+T, D): every decode step concatenates, i.e. copies, the whole cache.
Here, as in onnxruntime-genai's ``past_present_share_buffer``, ``past.{i}.key`` is a buffer of the
engine's capacity ``C`` (B, H_kv, C, D) and the engine binds ``present.{i}.key`` to the same
memory: the op writes the new positions in place and copies nothing.

Layout (the op's contract, ORT >= 1.32 CPU): each row's tokens sit at buffer positions
``[0, T_b)`` with ``T_b = seqlens_k[b] + 1``; a step's chunk (B, S) is right-padded, its first
``query_seqlens[b]`` rows valid (0 = an idle row whose cache is left unchanged). Rows are thus
*compact*, not left-padded: position ids are the row's own token count, which equals the plain
graph's ``cumsum(attention_mask) - 1`` on a left-padded prompt, so the log-prob contract holds
unchanged. The caller keeps ``T_b`` per row; no attention mask is an input.

How it is exported: a transformers attention function (``AttentionInterface``) calls the torch
custom op ``refit::gqa`` (a reference implementation in PyTorch, used by the tests), and the
dynamo exporter's ``custom_translation_table`` lowers that op to the contrib op. The rest of the
model (embeddings, learned or rotary positions, MLP, lm_head) is HF's own code, so the weight
map is built by content exactly as for the plain graph and stays 1:1.

Encoder-decoder models: T5's decoder has its own wrapper, :mod:`refit.export.fused_seq2seq` (the same op and
buffers, T5's relative position bias as the op's ``attention_bias`` computed from each row's positions,
``scale`` 1, the cross-attention plain over the encoder graph's K/V); HF's T5 computes that bias from its
own cache length, one for all rows, which compact rows with idle finished rows cannot use. BART and
Marian use the same wrapper with their absolute position embedding asked for each row's own positions.
"""

from __future__ import annotations

import contextlib

import torch

from refit.core.manifest_sections import ShapeRange
from refit.export.profiles import shape_profiles

ATTN_NAME = "refit_gqa"  # the transformers attention implementation registered here

ACTIVE: list[dict] = []  # the fused call in progress: its buffers, lengths and the presents it collects


@torch.library.custom_op("refit::gqa", mutates_args=())
def gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
        past_value: torch.Tensor, seqlens_k: torch.Tensor, total_len: torch.Tensor, query_seqlens: torch.Tensor,
        attention_bias: torch.Tensor | None, num_heads: int, kv_num_heads: int, scale: float,
        local_window: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupQueryAttention's contract in PyTorch (the reference the ONNX graph is tested against).

    query (B, S, N*D), key/value (B, S, H_kv*D), past_key/value (B, H_kv, C, D); seqlens_k and
    query_seqlens (B,) int32; total_len () int32 (an upper bound of seqlens_k + 1, unused here).
    Row b: T = seqlens_k[b] + 1 tokens after the step, Q = query_seqlens[b] of them new, written at
    [T - Q, T); query row s < Q attends causally to buffer positions [0, T - Q + s]. ``attention_bias``
    (B or 1, N or 1, S, total_len) or None is added to the scaled scores, indexed by absolute key
    position (its last dim must equal total_len, as the ORT kernel checks). ``local_window`` >= 1 (the
    op's ``local_window_size``): a query at position p sees keys [p - local_window + 1, p] only, a
    sliding window of local_window tokens (-1: none; measured on ORT 1.32 CPU against this function:
    the window counts the query's own token, HF Mistral's ``sliding_window``). ``softcap`` > 0 (the op's
    ``softcap``; Gemma-2's ``attn_logit_softcapping``): scaled scores become ``softcap * tanh(scores / softcap)``
    before the bias and the mask (0: none). Returns (output (B, S, N*D), present_key, present_value); output
    rows >= Q are 0.
    """
    b, s, _ = query.shape
    d = past_key.shape[3]
    q = query.view(b, s, num_heads, d).transpose(1, 2)  # (B, N, S, D)
    k = key.view(b, s, kv_num_heads, d).transpose(1, 2)  # (B, H_kv, S, D)
    v = value.view(b, s, kv_num_heads, d).transpose(1, 2)
    pk, pv = past_key.clone(), past_value.clone()
    out = torch.zeros(b, num_heads, s, d, dtype=query.dtype)
    rep = num_heads // kv_num_heads
    for i in range(b):
        t, n = int(seqlens_k[i]) + 1, int(query_seqlens[i])
        if n == 0:
            continue
        pk[i, :, t - n:t], pv[i, :, t - n:t] = k[i, :, :n], v[i, :, :n]
        keys = pk[i, :, :t].repeat_interleave(rep, 0)  # (N, T, D)
        vals = pv[i, :, :t].repeat_interleave(rep, 0)
        scores = q[i, :, :n] @ keys.transpose(-1, -2) * scale  # (N, Q, T)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if attention_bias is not None:
            scores = scores + attention_bias[i if attention_bias.shape[0] > 1 else 0, :, :n, :t]
        pos = t - n + torch.arange(n)[:, None]  # (Q, 1) each query's absolute position
        causal = torch.arange(t)[None, :] > pos  # (Q, T)
        if local_window >= 1:
            causal = causal | (torch.arange(t)[None, :] <= pos - local_window)
        out[i, :, :n] = scores.masked_fill(causal, float("-inf")).softmax(-1) @ vals
    return out.transpose(1, 2).reshape(b, s, num_heads * d), pk, pv


@gqa.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total_len, query_seqlens, attention_bias, num_heads,
      kv_num_heads, scale, local_window=-1, softcap=0.0):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


_GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
               "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight",
               "k_norm_weight", "query_seqlens"]  # ORT 1.32's input order


def _register_onnx_schema() -> None:
    """Teach ``onnx.defs`` the contrib op's signature (the part used here), so onnxscript can build the node.

    ONNX Runtime owns the real schema; onnx's Python registry does not know ``com.microsoft``.
    """
    from onnx import defs

    if defs.has("GroupQueryAttention", "com.microsoft"):
        return
    S = defs.OpSchema
    types = {"seqlens_k": "M", "total_sequence_length": "M", "query_seqlens": "M", "position_ids": "I"}
    single = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [S.FormalParameter(n, types.get(n, "T"), param_option=S.FormalParameterOption.Single if n in single
                                else S.FormalParameterOption.Optional) for n in _GQA_INPUTS]
    outputs = [S.FormalParameter(n, "T") for n in ("output", "present_key", "present_value")]
    defs.register_schema(S(
        "GroupQueryAttention", "com.microsoft", 1, inputs=inputs, outputs=outputs,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""),
                          ("I", ["tensor(int64)"], "")],
        attributes=[S.Attribute("num_heads", S.AttrType.INT), S.Attribute("kv_num_heads", S.AttrType.INT),
                    S.Attribute("scale", S.AttrType.FLOAT, required=False),
                    S.Attribute("local_window_size", S.AttrType.INT, required=False),
                    S.Attribute("softcap", S.AttrType.FLOAT, required=False)]))


def _gqa_onnx(query, key, value, past_key, past_value, seqlens_k, total_len, query_seqlens, attention_bias,
              num_heads: int, kv_num_heads: int, scale: float, local_window: int = -1, softcap: float = 0.0):
    """``refit::gqa`` -> com.microsoft.GroupQueryAttention (opset 1), inputs by the op's schema order."""
    import onnxscript

    msft = onnxscript.values.Opset("com.microsoft", 1)
    return msft.GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_len,
        None, None, None, attention_bias, None, None, None, None, None, query_seqlens,  # rotary, sink, quant: unused
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, local_window_size=local_window,
        softcap=softcap, _outputs=3)


def translation_table() -> dict:
    """For ``torch.onnx.export(custom_translation_table=...)``."""
    _register_onnx_schema()
    return {torch.ops.refit.gqa.default: _gqa_onnx}


def gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: (B, N, S, D) q, (B, H_kv, S, D) k/v of the new tokens only
    (the model runs without an HF cache) -> ((B, S, N, D) output, None). The buffers, lengths and
    attention bias (T5's, refit/export/fused_seq2seq.py; None here) come from the fused call in progress.
    What the layer asks for is passed on per layer: its ``scaling`` (Gemma-2: ``query_pre_attn_scalar ** -0.5``),
    ``sliding_window`` (None on a full layer of Gemma-2's alternating pattern) and ``softcap``."""
    st = ACTIVE[-1]
    i = module.layer_idx
    window = kwargs.get("sliding_window")  # HF (Mistral): query q sees keys (q - window, q], i.e. window tokens
    softcap = kwargs.get("softcap")  # HF (Gemma-2): attn_logit_softcapping, None when off
    b, n, s, d = query.shape
    h = key.shape[1]
    out, pk, pv = torch.ops.refit.gqa(
        query.transpose(1, 2).reshape(b, s, n * d), key.transpose(1, 2).reshape(b, s, h * d),
        value.transpose(1, 2).reshape(b, s, h * d), st["past"][2 * i], st["past"][2 * i + 1],
        st["seqlens_k"], st["total_len"], st["query_seqlens"], st.get("bias"), n, h,
        float(scaling if scaling is not None else d ** -0.5), int(window) if window else -1,
        float(softcap) if softcap else 0.0)
    st["present"][2 * i], st["present"][2 * i + 1] = pk, pv
    return out.view(b, s, n, d), None


def no_mask(*args, **kwargs):
    return None  # the op masks by seqlens_k / query_seqlens; no (B, 1, S, T) mask is built


def register() -> None:
    """Register the attention function and its (empty) mask with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, gqa_attention)
    AttentionMaskInterface.register(ATTN_NAME, no_mask)


@contextlib.contextmanager
def active_state(state: dict):
    ACTIVE.append(state)
    try:
        yield state
    finally:
        ACTIVE.pop()


class FusedDecoder(torch.nn.Module):
    """(input_ids (B,S), position_ids (B,S), seqlens_k (B,), query_seqlens (B,), total_len (),
    logits_index (B,K), *past (B,H_kv,C,D)) -> (logits (B,K,V), *present (B,H_kv,C,D)).

    ``logits_index`` picks, per row, the chunk positions whose logits are computed (prefill: each
    row's last valid position; decode: 0; score: every position). The model's attention
    implementation is switched to :data:`ATTN_NAME` for the wrapper's lifetime.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        register()
        self.model = model
        model.config._attn_implementation = ATTN_NAME
        for m in model.modules():  # sub-configs cache the implementation too (transformers 5)
            if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
                m.config._attn_implementation = ATTN_NAME
        self.n_layers = model.config.num_hidden_layers

    def forward(self, input_ids, position_ids, seqlens_k, query_seqlens, total_len, logits_index, *past):
        state = dict(past=past, present=[None] * (2 * self.n_layers), seqlens_k=seqlens_k,
                     query_seqlens=query_seqlens, total_len=total_len)
        with active_state(state):
            hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
        b, k = logits_index.shape
        picked = hidden.gather(1, logits_index[:, :, None].expand(b, k, hidden.shape[-1]))  # (B, K, H)
        logits = self.model.get_output_embeddings()(picked)
        cap = getattr(self.model.config, "final_logit_softcapping", None)  # Gemma-2, as its forward does
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return (logits, *state["present"])


# ----------------------------------------------------------------------------- export


def supports_fused(model, caps, backend: str, dtype: str) -> str | None:
    """None when the fused graph applies to this export, else the reason it does not (one line).

    Decided from what the model does, not its type: a decoder-only model whose attention layers go
    through transformers' ``AttentionInterface`` (``_supports_attention_backend``) and know their layer
    (``layer_idx``), a sliding window (Mistral; Gemma-2's alternating layers, per layer) given to the op as
    ``local_window_size``, attention soft-capping as its ``softcap`` and the layer's scaling as its ``scale``,
    Gemma-2's final logit soft-capping applied after the lm_head; an encoder-decoder
    one whose decoder has either T5's relative position bias or one absolute position embedding (BART, Marian;
    :func:`refit.export.fused_seq2seq.seq2seq_refusal`). Whether the graph computes what PyTorch computes is
    the parity gate's call: under ``attention=auto`` a fused export that fails it falls back to plain.
    """
    if backend != "onnxruntime":
        return f"backend {backend!r}: TensorRT builds from the standard-op graph (contrib ops are ONNX Runtime's)"
    if dtype == "bf16":  # the exporter gates bf16 through its CPU twin (refit/export/precision.py), standard ops only
        return ("dtype bf16: ONNX Runtime's CPU GroupQueryAttention has no bf16 kernel, so a fused bf16 graph "
                "cannot be gated here; the standard-op graph is exported and gated through its CPU twin")
    if caps.head_dim % 8:
        return f"head_dim {caps.head_dim}: ONNX Runtime's GroupQueryAttention CPU kernel needs a multiple of 8"
    if caps.kind != "decoder":
        return None  # the encoder-decoder checks are fused_seq2seq.seq2seq_refusal's (choose_attention asks it)
    if caps.sliding_window is not None and caps.sliding_window < 1:
        return f"sliding window {caps.sliding_window}: the op's local_window_size must be >= 1"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
    for scaled in ("logit_scale", "logits_scaling"):  # Cohere, Granite: applied after the lm_head in their forward
        if getattr(model.config, scaled, None) not in (None, 1, 1.0):
            return f"config.{scaled} = {getattr(model.config, scaled)}: the fused graph's lm_head does not apply it"
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attn or any(getattr(m, "layer_idx", None) is None for m in attn):
        return "an attention module does not know its layer index (layer_idx)"
    return None


def fused_spec(model, caps) -> dict:
    """The decoder graph spec (as :func:`refit.export.trace.graph_specs` returns) of the fused graph."""
    D = torch.export.Dim
    batch, seq, cap, keep = D("batch"), D("seq"), D("cap"), D("keep")
    L, H, Dh, B = caps.n_layers, caps.n_kv_heads, caps.head_dim, 2
    names = [f"past.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    args = (torch.full((B, 3), 5, dtype=torch.long), torch.arange(3).expand(B, 3).contiguous(),
            torch.tensor([2, 1], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32),
            torch.tensor(8, dtype=torch.int32), torch.tensor([[2, 1], [1, 0]]),  # keep 2, not 1: export specialises 1
            *[torch.zeros(B, H, 8, Dh, dtype=model.dtype) for _ in range(2 * L)])
    return dict(
        name="decoder", module=FusedDecoder(model), args=args,
        inputs=["input_ids", "position_ids", "seqlens_k", "query_seqlens", "total_sequence_length", "logits_index",
                *names],
        outputs=["logits", *[n.replace("past", "present", 1) for n in names]],
        dynamic={"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}, "seqlens_k": {0: batch},
                 "query_seqlens": {0: batch}, "total_len": None, "logits_index": {0: batch, 1: keep},
                 "past": tuple({0: batch, 2: cap} for _ in range(2 * L))},
        translation=translation_table())


def fused_profiles(caps, max_batch: int, max_len: int, seq2seq: bool = False) -> dict:
    """Shape ranges of the fused graph's inputs (the manifest's record; TensorRT never builds this graph).

    ``seq2seq`` (refit/export/fused_seq2seq.py): the decoder also takes the encoder mask and cross K/V (length
    ``e``), its prefill is the start token; the plain encoder graph keeps its profile."""
    def shapes(b, s, c, k, e):
        d = {"input_ids": [b, s], "position_ids": [b, s], "seqlens_k": [b], "query_seqlens": [b],
             "total_sequence_length": [], "logits_index": [b, k]}
        if seq2seq:
            d["encoder_attention_mask"] = [b, e]
        for p, n in ((("cross", e),) if seq2seq else ()) + (("past", c),):
            d.update({f"{p}.{i}.{kv}": [b, caps.n_kv_heads, n, caps.head_dim]
                      for i in range(caps.n_layers) for kv in ("key", "value")})
        return d

    def profile(lo, opt, hi):
        return {n: ShapeRange(min=tuple(lo[n]), opt=tuple(opt[n]), max=tuple(hi[n])) for n in lo}

    ob, ol = max(1, max_batch // 2), max(1, max_len // 2)
    lo, big = shapes(1, 1, 1, 1, 1), max_len
    out = {"encoder": shape_profiles(caps, max_batch, max_len)["encoder"]} if seq2seq else {}
    out["decoder"] = {
        "prefill": profile(lo, shapes(ob, 1 if seq2seq else ol, big, 1, ol), shapes(max_batch, big, big, big, big)),
        "decode": profile(lo, shapes(ob, 1, big, 1, ol), shapes(max_batch, 1, big, 1, big)),
    }
    return out


def fused_dynamic_dims(seq2seq: bool = False) -> dict[str, str]:
    dims = {"batch": "rows in the batch (engine slots)", "seq": "chunk length (right-padded per row)",
            "cap": "KV buffer capacity: positions per row, past and present share it",
            "keep": "positions per row whose logits are returned (logits_index width)"}
    if seq2seq:
        dims["enc_seq"] = "encoder input length"
    return dims
