"""Token-level tensor math both jobs use: masked reductions, log-probs, entropy, KL estimators, exact KL.

Pure functions on tensors (torch only, no config objects, no state).  Shape
conventions used throughout:

* ``B`` batch (sequences), ``T`` response length (right-padded), ``V`` vocab.
* ``mask`` is a float or bool tensor of shape (B, T): 1 for real response
  tokens, 0 for padding.  Masks are assumed to hold only 0/1 values.
* Losses return ``(loss, stats)``; ``loss`` is a scalar tensor carrying the
  graph, ``stats`` is a dict of *detached* tensors (never ``.item()``-ed here,
  so no host sync is forced).

Token normalisation and micro-batching
--------------------------------------
Losses are the masked mean over all valid tokens of the batch they are given.
When one optimiser batch is split into micro-batches for gradient
accumulation, pass ``num_tokens`` = the number of valid tokens of the *whole*
batch (``mask.sum()`` over all micro-batches).  The loss is then
``sum(per_token * mask) / num_tokens`` and the *sum* of the micro-batch losses
(and of their gradients) equals the full-batch token mean exactly (see
:func:`token_mean`).  Averaging per-micro-batch means instead weights tokens of
short micro-batches more heavily.  Stats are always per-call masked means.
"""

from typing import Callable, Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

Stats = Dict[str, torch.Tensor]
Number = Union[float, int, torch.Tensor]


# --------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` != 0 (x, mask: same shape).

    Masked-out entries are replaced by 0 before multiplying, so ``inf``/``nan``
    in padding cannot leak into the result.
    """
    m = _float_mask(mask, x)
    x = torch.where(m != 0, x, torch.zeros_like(x)) * m
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over masked positions (TRL ``masked_mean``).

    Args:
        x: (B, T) (any shape broadcast-equal to ``mask``).
        mask: same shape, 1 = valid.
        dim: reduce over this dim only; ``None`` reduces over everything.
    Returns:
        scalar (dim=None) or the reduced tensor.  An empty mask gives 0, not NaN.
    """
    num = masked_sum(x, mask, dim)
    den = _float_mask(mask, num).sum() if dim is None else _float_mask(mask, num).sum(dim=dim)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[Number] = None) -> torch.Tensor:
    """Token-level loss reduction used by every loss in this package.

    ``num_tokens=None`` -> ``masked_mean(x, mask)``.  Otherwise
    ``masked_sum(x, mask) / num_tokens``: pass the valid-token count of the
    full optimiser batch so that summing micro-batch losses equals the
    full-batch masked mean (see module docstring).
    """
    if num_tokens is None:
        return masked_mean(x, mask)
    return masked_sum(x, mask) / num_tokens


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over masked positions (TRL ``masked_var``), scalar.

    With ``unbiased=True`` the Bessel correction n/(n-1) is applied, n = number
    of valid tokens; raises ``ValueError`` when n < 2 (as TRL does; this check
    syncs with the device).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = _float_mask(mask, var).sum()
        if bool(n < 2):
            raise ValueError(f"masked_var(unbiased=True) needs >= 2 valid tokens, got {float(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``x`` with masked mean / unbiased masked variance (TRL ``masked_whiten``).

    ``(x - mean) * rsqrt(var + 1e-8)``; with ``shift_mean=False`` the mean is
    added back (only the scale is normalised).  Shape (B, T) -> (B, T); values
    at masked positions are transformed too but are meaningless.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def chunked_apply(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], chunk_size: Optional[int], dim: int = 1
) -> torch.Tensor:
    """Apply ``fn(*chunks)`` to slices of ``tensors`` along ``dim`` and concatenate.

    Used to keep (B, chunk, V) temporaries bounded: ``fn`` maps (B, c, ...)
    inputs to a (B, c, ...) output (usually (B, c)), concatenated along ``dim``.
    When autograd needs the result, each chunk is wrapped in
    ``torch.utils.checkpoint`` so that the per-chunk (B, c, V) intermediates are
    recomputed in backward instead of being kept alive for all chunks (peak
    extra memory: a few chunks, at the cost of one forward recompute).
    ``chunk_size=None`` (or >= length) calls ``fn`` once on the full tensors.
    """
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    length = tensors[0].shape[dim]
    if chunk_size is None or chunk_size >= length:
        return fn(*tensors)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs = []
    for start in range(0, length, chunk_size):
        parts = [t.narrow(dim, start, min(chunk_size, length - start)) for t in tensors]
        if needs_grad:
            outs.append(torch.utils.checkpoint.checkpoint(fn, *parts, use_reentrant=False))
        else:
            outs.append(fn(*parts))
    return torch.cat(outs, dim=dim)


# --------------------------------------------------------------------------
# Log-probs, entropy, KL
# --------------------------------------------------------------------------


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``labels`` under ``log_softmax(logits / temperature)``.

    Args:
        logits: (B, T, V), already aligned with labels (logits[:, t] predicts labels[:, t]).
        labels: (B, T) integer token ids.
    Returns:
        (B, T) log-probs.  Computed as ``gather - logsumexp`` so no full (B, T, V)
        log-softmax is kept; precision is that of ``logits.dtype`` (upcast first
        if bf16 log-probs are not precise enough for importance ratios).
    """
    scaled = logits / temperature if temperature != 1.0 else logits
    picked = scaled.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """Per-token entropy H(softmax(logits / temperature)), (B, T, V) -> (B, T).

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (TRL ``entropy_from_logits``).
    Chunked along T when ``chunk_size`` is given.  Use
    ``masked_mean(entropy_from_logits(logits), mask)`` as the entropy bonus.
    """

    def _entropy(z: torch.Tensor) -> torch.Tensor:
        z = z / temperature if temperature != 1.0 else z
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)

    return chunked_apply(_entropy, [logits], chunk_size)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(pi || ref) per token: ``logp - ref_logp``.

    Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
    Unbiased for samples x ~ pi, high variance, can be negative.  (B, T) -> (B, T).
    """
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 estimator: ``0.5 * (logp - ref_logp)**2`` (Schulman 2020). Biased, low variance, >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator: ``exp(r) - r - 1`` with ``r = ref_logp - logp`` (Schulman 2020).

    Unbiased for x ~ pi and always >= 0 (since e^r >= 1 + r).  Not clamped:
    very negative ``logp`` makes ``exp(r)`` large.
    """
    r = ref_logp - logp
    return torch.exp(r) - r - 1


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Dispatch to :func:`kl_k1` / :func:`kl_k2` / :func:`kl_k3` by ``kind`` ("k1", "k2", "k3")."""
    estimators = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
    if kind not in estimators:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(estimators)}")
    return estimators[kind](logp, ref_logp)


def exact_kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Exact per-token KL(pi || ref) over the full vocabulary.

    ``KL_t = sum_v pi_v (log pi_v - log ref_v)`` with
    ``log pi = log_softmax(logits / temperature)``, ``log ref = log_softmax(ref_logits / temperature)``.

    Args:
        logits, ref_logits: (B, T, V), finite.
        mask: optional (B, T); masked positions are set to 0 in the output.
        chunk_size: process T in chunks so at most a few (B, chunk, V)
            temporaries exist at once (see :func:`chunked_apply`).
    Returns:
        (B, T).  The true KL is >= 0; the result is clamped at 0 only to remove
        tiny negative values from floating-point rounding (e.g. identical inputs).
    """

    def _kl(z: torch.Tensor, z_ref: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            z, z_ref = z / temperature, z_ref / temperature
        logp, logq = F.log_softmax(z, dim=-1), F.log_softmax(z_ref, dim=-1)
        return (logp.exp() * (logp - logq)).sum(dim=-1).clamp_min(0.0)

    kl = chunked_apply(_kl, [logits, ref_logits], chunk_size)
    if mask is not None:
        kl = torch.where(mask != 0, kl, torch.zeros_like(kl))
    return kl


__all__ = ["Number", "Stats", "masked_sum", "masked_mean", "token_mean", "masked_var", "masked_whiten", "chunked_apply", "logprobs_from_logits", "entropy_from_logits", "kl_k1", "kl_k2", "kl_k3", "kl_estimate", "exact_kl_from_logits"]
