"""Per-token log-prob, entropy and exact KL over a large vocabulary, token chunk by token chunk.

With a 128k-256k vocabulary one (B, T, V) fp32 tensor is hundreds of MB (8 x 64 x 151936: 311 MB), and the
plain formulas of :mod:`refit.learner.losses.common` make several: ``logsumexp``'s exponentials, the entropy's
softmax and product (kept for backward), the exact KL's two log-softmaxes, their difference and product.
:func:`token_stats` computes all three from ONE log-softmax per chunk of ``chunk_size`` positions, so
only (B, chunk, V) temporaries exist, and its backward (a :class:`torch.autograd.Function`) writes the
gradient into one (B, T, V) buffer chunk by chunk from the closed forms, recomputing the chunk's
log-softmax instead of keeping it: the logits and their gradient are the only full-size tensors, as
in Liger-Kernel's fused linear cross-entropy (https://github.com/linkedin/Liger-Kernel).

Closed forms, with ``z = logits / temperature``, ``p = softmax(z)``, ``q = softmax(ref / temperature)``:

- ``lp = z_y - logsumexp(z)``;            d lp / d z_j = [j = y] - p_j
- ``H = -sum p log p``;                   d H / d z_j = -p_j (log p_j + H)
- ``KL = sum p (log p - log q)``;         d KL / d z_j = p_j (log p_j - log q_j - KL)

and d / d logits = (d / d z) / temperature. The KL is clamped at 0 as in
:func:`refit.learner.losses.common.exact_kl_from_logits` (rounding of identical inputs), its gradient 0 where
the clamp bites. The reference is a constant (the frozen model, or an engine's log-probs). fp16/bf16 logits
(a bf16 learner's head) are upcast to fp32 one chunk at a time: the values are fp32, the gradient has the
logits' dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # default: chunks of about 16M logits (64 MB in fp32) per temporary


class TokenStats(NamedTuple):
    logprobs: torch.Tensor  # (B, T) log-prob of each label under softmax(logits / temperature)
    entropy: torch.Tensor  # (B, T) entropy of that distribution
    exact_kl: Optional[torch.Tensor]  # (B, T) KL(pi || ref) over the vocabulary, >= 0; None without ref_logits


def default_chunk(batch: int, vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Token positions per chunk so that one (batch, chunk, vocab) temporary holds about ``elements`` values."""
    return max(1, elements // max(1, batch * vocab))


def _chunk_forward(z: torch.Tensor, labels: torch.Tensor, z_ref: Optional[torch.Tensor]):
    """(lp, H, KL or None, logp, KL before the clamp or None) of one chunk; ``z`` already divided by temperature."""
    logp = F.log_softmax(z, dim=-1)  # (B, c, V)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    kl = raw = None
    if z_ref is not None:
        raw = (p * (logp - F.log_softmax(z_ref, dim=-1))).sum(-1)
        kl = raw.clamp_min(0.0)
    return lp, ent, kl, logp, raw


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The chunk's arithmetic type: fp16/bf16 logits (a bf16 learner) are upcast to fp32 one chunk at a time,
    as TRL and OpenRLHF upcast the whole (B, T, V) tensor; fp32 and fp64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ref_logits, temperature: float, chunk: int):
        b, t, _ = logits.shape
        acc = _acc(logits.dtype)
        lp, ent = logits.new_empty(b, t, dtype=acc), logits.new_empty(b, t, dtype=acc)
        kl = logits.new_empty(b, t, dtype=acc) if ref_logits is not None else None
        live = logits.new_empty(b, t, dtype=torch.bool) if ref_logits is not None else None  # KL not clamped
        for s in range(0, t, chunk):
            c = slice(s, min(s + chunk, t))
            z_ref = _scaled(ref_logits[:, c], acc, temperature) if ref_logits is not None else None
            out = _chunk_forward(_scaled(logits[:, c], acc, temperature), labels[:, c], z_ref)
            lp[:, c], ent[:, c] = out[0], out[1]
            if kl is not None:
                kl[:, c], live[:, c] = out[2], out[4] >= 0
        ctx.save_for_backward(logits, labels, ref_logits, ent, kl, live)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an output the loss leaves out (the entropy, most often) has no term
        if kl is None:
            return lp, ent
        return lp, ent, kl

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_kl=None):
        logits, labels, ref_logits, ent, kl, live = ctx.saved_tensors
        temp, chunk, t = ctx.temperature, ctx.chunk, logits.shape[1]
        grad = torch.empty_like(logits)  # (B, T, V): the one full-size tensor of the backward
        for s in range(0, t, chunk):
            c = slice(s, min(s + chunk, t))
            logp = F.log_softmax(_scaled(logits[:, c], ent.dtype, temp), dim=-1)  # recomputed, not kept
            # d/dz of sum_t (g_lp lp + g_ent H + g_kl KL) = p * coef + g_lp * onehot(y): the module docstring's
            # closed forms; a term whose output the loss left out (its grad None) costs nothing
            coef = None
            if g_ent is not None:
                coef = (logp + ent[:, c, None]).mul_(-g_ent[:, c, None])  # the entropy term / p
            if ref_logits is not None and g_kl is not None:
                log_q = F.log_softmax(_scaled(ref_logits[:, c], ent.dtype, temp), dim=-1)
                g = torch.where(live[:, c], g_kl[:, c], torch.zeros_like(g_kl[:, c]))  # clamp_min's gradient
                term = (logp - log_q).sub_(kl[:, c, None]).mul_(g[..., None])
                coef = term if coef is None else coef.add_(term)
            g_lab = g_lp[:, c] if g_lp is not None else torch.zeros_like(ent[:, c])
            coef = -g_lab[..., None] if coef is None else coef.sub_(g_lab[..., None])  # the log-prob's -p part
            gc = logp.exp_().mul_(coef)  # p * coef, in logp's buffer
            gc.scatter_add_(-1, labels[:, c, None], g_lab[..., None])  # and the log-prob's one-hot part
            grad[:, c] = gc / temp if temp != 1.0 else gc
        return grad, None, None, None, None


def _scaled(x: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """``x`` in ``dtype`` divided by ``temperature``; at 1.0 no division (and no copy when the dtype is x's)."""
    x = x.to(dtype)
    return x / temperature if temperature != 1.0 else x


def token_stats(logits: torch.Tensor, labels: torch.Tensor, ref_logits: Optional[torch.Tensor] = None,
                temperature: float = 1.0, chunk_size: Optional[int] = None) -> TokenStats:
    """Log-prob of ``labels``, entropy and (with ``ref_logits``) exact KL(pi || ref) per token, chunked over T.

    Args:
        logits: (B, T, V) float, aligned with labels (logits[:, t] predicts labels[:, t]); may require grad.
        labels: (B, T) integer token ids.
        ref_logits: optional (B, T, V) reference logits or log-probs (a constant: no gradient flows to it).
        temperature: both distributions are softmax(x / temperature).
        chunk_size: positions per chunk; None: :func:`default_chunk` (about 64 MB per temporary).
    Returns:
        :class:`TokenStats` of (B, T) tensors; equal to :func:`refit.learner.losses.common.logprobs_from_logits`,
        :func:`~refit.learner.losses.common.entropy_from_logits` and
        :func:`~refit.learner.losses.common.exact_kl_from_logits` up to rounding, gradients included.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"token_stats: logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    if ref_logits is not None and ref_logits.shape != logits.shape:
        raise ValueError(f"token_stats: ref_logits {tuple(ref_logits.shape)} != logits {tuple(logits.shape)}")
    if ref_logits is not None and ref_logits.requires_grad:
        raise ValueError("token_stats: ref_logits must not require grad (the reference is frozen)")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    b, t, v = logits.shape
    chunk = chunk_size or default_chunk(b, v)
    ref = ref_logits.to(logits.dtype) if ref_logits is not None else None
    out = _TokenStats.apply(logits, labels.long(), ref, float(temperature), max(1, min(chunk, max(t, 1))))
    return TokenStats(out[0], out[1], out[2] if ref is not None else None)


__all__ = ["TokenStats", "default_chunk", "token_stats"]
