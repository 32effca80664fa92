"""The GRPO family's policy losses as TRL 1.16's ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss``
compute them (trl/trainer/grpo_trainer.py, rloo_trainer.py; read, not copied), one micro-batch at a time.

Pure functions on tensors (torch only, no config, no ``.item()``). Shapes: ``B`` rows (completions), ``T``
response positions; ``mask`` (B, T) is 1 on the tokens that count (TRL's ``completion_mask``, after
``mask_truncated_completions``). The normalisers are arguments, so a caller that splits TRL's micro-batch
further (memory) or accumulates gradients passes TRL's counts and gets TRL's loss, summed over its parts:

- ``num_tokens``: ``bnpo``: the micro-batch's token count x gradient_accumulation_steps; ``dapo`` / ``cispo`` /
  ``vespo``: the generation batch's token count x gradient_accumulation_steps / steps_per_generation (TRL's
  rescaled ``num_items_in_batch``);
- ``num_seqs``: the rows of one optimizer step (micro-batch rows x gradient_accumulation_steps), for ``grpo`` /
  ``sapo`` (mean of per-sequence token means), ``dr_grpo`` (x ``max_completion_length``), ``luspo`` (mean of
  per-sequence sums) and RLOO.

Loss types (TRL's names; the papers as TRL's paper index cites them): ``grpo`` (Shao et al. 2024), ``bnpo``,
``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"), ``dapo`` (Yu et al. 2025, DAPO, token-level
normalisation; with ``epsilon_high``: clip-higher), ``cispo`` (MiniMax-M1 2025: the clipped ratio is a detached
weight on the log-prob), ``sapo`` (soft adaptive policy optimisation: a sigmoid gate instead of the clip),
``luspo`` (length-unbiased sequence policy optimisation: per-sequence sums averaged over sequences), ``vespo``
(gamma-shaped sequence weights). ``importance_sampling_level='sequence'``: GSPO (Zheng et al. 2025), the
length-normalised sequence ratio. ``delta``: two-sided clipping (INTELLECT-2, 2025), an upper cap on the unclipped
ratio. The entropy mask: Wang et al. 2025, "Beyond the 80/20 Rule" (the top ``q`` share of tokens by entropy). The
off-policy sequence mask: DeepSeek-V3.2 (2025).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from refit.learner.losses.common import Number, Stats

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's -min(ratio A, clip(ratio) A)
IS_LEVELS = ("token", "sequence")


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """TRL's ``get_high_entropy_mask`` at ``threshold = 1 - top_quantile`` (one process): True on the valid tokens
    whose entropy is at least the ``1 - top_quantile`` quantile (``torch.quantile``, linear) of the valid tokens'
    entropies; (B, T) entropies and mask -> (B, T) bool, all False when no token is valid."""
    ent = entropies.detach()
    valid = mask.bool()
    local = ent[valid].float()
    if local.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(local, 1.0 - top_quantile)
    return ((ent * mask.to(ent.dtype)) >= threshold) & valid


def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL ``get_off_policy_mask``): (B, 1) float, 1 to keep a row whose
    advantage is >= 0 or whose mean ``sampling - current`` log-prob over its valid tokens is <= ``threshold``.

    advantages: (B,) or (B, 1); logprobs, sampling_logprobs, mask: (B, T). NaN log-prob gaps count as 0."""
    adv = advantages.detach().reshape(-1, 1)
    m = mask.to(logprobs.dtype)
    kl = torch.nan_to_num(sampling_logprobs.detach() - logprobs.detach(), nan=0.0)
    avg = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (avg <= threshold)).to(m.dtype)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  is_ratio: Optional[torch.Tensor], k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """VESPO's detached sequence weights ``phi(w) = exp(lam + k log w - lam w)`` (TRL ``get_gamma_weights``),
    ``w`` the sequence's summed log ratio (times ``is_ratio``'s, the engine mismatch weights, when given), both
    clamped as TRL clamps them; (k, lam) by the advantage's sign. (B, T) in, (B, 1) out."""
    lower = math.log(1e-8)
    m = mask.to(log_ratio.dtype)
    seq = (torch.clamp(log_ratio.detach(), -20.0, 20.0) * m).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + torch.clamp(torch.log(is_ratio.detach()), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    pos = advantages.detach().reshape(-1, 1) >= 0
    k = torch.where(pos, k_pos, k_neg)
    lam = torch.where(pos, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _per_token(loss_type: str, logprobs, coef_1, adv, log_ratio, mask, epsilon_low: float, epsilon_high: float,
               delta: Optional[float], sapo: Tuple[float, float], vespo: Tuple[float, ...], is_weights):
    """The per-token (or, at sequence level, per-row (B, 1)) policy term of ``loss_type``."""
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=epsilon_high).detach() * adv * logprobs
    if loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:  # two-sided clipping: the unclipped ratio capped at delta
            coef_1 = torch.clamp(coef_1, max=delta)
        return -torch.min(coef_1 * adv, coef_2 * adv)
    if loss_type == "sapo":
        temp = torch.where(adv > 0, sapo[0], sapo[1])
        return -(torch.sigmoid(temp * (coef_1 - 1)) * 4 / temp) * adv
    if loss_type == "vespo":
        return -vespo_weights(adv, log_ratio, mask, is_weights, *vespo) * adv * logprobs
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def grpo_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
    loss_type: str = "dapo", epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
    importance_sampling_level: str = "token", delta: Optional[float] = None,
    num_tokens: Optional[Number] = None, num_seqs: Optional[Number] = None, max_completion_length: int = 0,
    token_weights: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
    kl: Optional[torch.Tensor] = None, beta: float = 0.0, kl_bias_correction: bool = True,
    entropies: Optional[torch.Tensor] = None, entropy_coef: float = 0.0, entropy_mask: Optional[torch.Tensor] = None,
    num_entropy_tokens: Optional[Number] = None,
    sapo_temperatures: Tuple[float, float] = (1.0, 1.05), vespo_params: Tuple[float, ...] = (2.0, 3.0, 3.0, 2.0),
) -> Tuple[torch.Tensor, Stats]:
    """TRL 1.16 GRPO's micro-batch loss (``_compute_loss``), the normalisers given (module docstring).

    Args:
        logprobs: (B, T) current policy log-probs (with grad); old_logprobs: (B, T) constants.
        advantages: (B,), (B, 1) or (B, T) (one value per row on its valid tokens); constants.
        mask: (B, T) 1 on the tokens in the loss.
        loss_type: one of :data:`LOSS_TYPES`; epsilon_low / epsilon_high: the clip range ``[1 - lo, 1 + hi]``
            (``epsilon_high`` None: ``epsilon_low``; cispo's cap on the ratio itself); delta: two-sided clipping.
        importance_sampling_level: 'token', or 'sequence' (GSPO: ``exp(mean log ratio)`` of the row, (B, 1)).
        token_weights: (B, T) or (B, 1) multiplying the policy term: the off-policy mask times the entropy mask
            (TRL's order); is_weights: (B, T) engine-mismatch weights multiplying it after (not for vespo, which
            folds them into its sequence weight).
        kl: (B, T) per-token KL to the reference (TRL's k3), added as ``beta * kl`` before the aggregation;
            ``kl_bias_correction`` multiplies it by the importance ratio (TRL's ``use_bias_correction_kl``).
        entropies, entropy_coef, entropy_mask: the entropy bonus ``- coef * sum(H * eff) / num_entropy_tokens``,
            ``eff`` = mask (times the entropy mask); ``num_entropy_tokens`` default: ``eff.sum()``.
    Returns:
        ``(loss, stats)``: ``pg_loss`` (the aggregated policy term), ``kl_loss`` (the aggregated KL term, without
        ``beta``, when ``kl`` is given; TRL's ``policy_loss`` is ``pg_loss + beta * kl_loss``), ``entropy_bonus``
        (its aggregated entropy), the
        clip figures ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (``clipfrac``
        too), ``approx_kl``, ``ratio_mean``, ``ratio_max`` (token ratios; 0 when no token is valid, as when
        ``mask_truncated_completions`` masks a whole micro-batch).
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = mask.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    log_ratio = logprobs - old_logprobs.detach()
    if importance_sampling_level == "token":
        log_iw = log_ratio
    elif importance_sampling_level == "sequence":
        log_iw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    else:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {importance_sampling_level!r}")
    coef_1 = torch.exp(log_iw)
    per = _per_token(loss_type, logprobs, coef_1, adv, log_ratio, m, epsilon_low, eps_high, delta,
                     sapo_temperatures, vespo_params, is_weights)
    if token_weights is not None:
        per = per * token_weights.detach()
    if is_weights is not None and loss_type != "vespo":
        per = per * is_weights.detach()
    n_tok = m.sum() if num_tokens is None else num_tokens
    n_seq = logprobs.shape[0] if num_seqs is None else num_seqs
    agg = lambda x: _aggregate(loss_type, x, m, n_tok, n_seq, max_completion_length)  # noqa: E731
    loss = agg(per)  # the aggregation is linear: TRL's sum of the per-token terms, aggregated once, is the same
    stats = {"pg_loss": loss.detach()}
    if kl is not None and beta != 0.0:
        kl_term = agg(kl * coef_1 if kl_bias_correction else kl)
        loss = loss + beta * kl_term
        stats["kl_loss"] = kl_term.detach()
    if entropies is not None and entropy_coef != 0.0:
        eff = m if entropy_mask is None else m * entropy_mask.to(m.dtype)
        n_ent = eff.sum().clamp(min=1.0) if num_entropy_tokens is None else num_entropy_tokens
        bonus = (entropies * eff).sum() / n_ent
        loss = loss - entropy_coef * bonus
        stats["entropy_bonus"] = bonus.detach()
    seen = torch.clamp(coef_1, max=delta) if delta is not None and loss_type in CLIPPED else coef_1  # TRL's figures
    stats.update(_clip_stats(loss_type, seen, adv, log_ratio, m, epsilon_low, eps_high))
    return loss, stats


def _aggregate(loss_type: str, x: torch.Tensor, m: torch.Tensor, num_tokens, num_seqs, max_len: int) -> torch.Tensor:
    """TRL's reduction of the per-token term ``x`` ((B, T) or (B, 1), broadcast over the mask) by ``loss_type``."""
    xm = x * m
    if loss_type in ("grpo", "sapo"):
        return (xm.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / num_seqs
    if loss_type == "dr_grpo":
        return xm.sum() / (num_seqs * max_len)
    if loss_type == "luspo":
        return xm.sum() / num_seqs
    return xm.sum() / num_tokens  # bnpo, dapo, cispo, vespo


@torch.no_grad()
def _clip_stats(loss_type: str, coef_1, adv, log_ratio, m, eps_low: float, eps_high: float) -> Stats:
    """TRL's clip figures (masked means over tokens; a sequence-level ratio counts once per token of its row)."""
    valid = m != 0
    mean = lambda x: ((x.to(m.dtype) * m).sum() / m.sum().clamp(min=1.0)).detach()  # noqa: E731
    if loss_type == "cispo":
        low = torch.zeros_like(coef_1, dtype=torch.bool)
        high = (coef_1 > eps_high) & (adv > 0)
    else:
        low = (coef_1 < 1 - eps_low) & (adv < 0)
        high = (coef_1 > 1 + eps_high) & (adv > 0)
    ratio = torch.exp(log_ratio)
    return {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
            "clip_ratio/region_mean": mean(low | high), "clipfrac": mean(low | high),
            "approx_kl": 0.5 * mean(log_ratio ** 2), "ratio_mean": mean(ratio),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max().detach()}  # 0: no valid token


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, coef_min: float,
                          coef_max: float) -> float:
    """TRL 1.16 GRPO's adaptive entropy controller (``use_adaptive_entropy``), one optimizer step: the coefficient
    for the next step from ``entropy``, the step's token-weighted mean entropy (over every micro-batch and rank, on
    the tokens the bonus acts on): ``+ delta`` (capped at ``coef_max``) when it is at or below ``target``, else
    ``- delta`` (floored at ``coef_min``). The bonus a step applies is :func:`applied_entropy_coef`."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The entropy bonus's coefficient in an optimizer step under the adaptive controller: ``coef`` when the last
    step's mean entropy ``last_entropy`` was at or below ``target``, else 0 (TRL: ``last_entropy`` starts at +inf,
    so the first step applies none)."""
    return coef if last_entropy <= target else 0.0


def rloo_sequence_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
                       num_seqs: Optional[Number] = None) -> Tuple[torch.Tensor, Stats]:
    """TRL 1.16 RLOO's loss (``RLOOTrainer._compute_loss``): one ratio per row from the summed log-probs,
    ``exp(sum(logp * mask) - sum(old * mask))``, clipped to ``[1 - lo, 1 + hi]``, ``-min(ratio A, clip A)`` summed
    over rows / ``num_seqs`` (default B: the micro-batch mean; the rows of the optimizer step with accumulation).

    logprobs, old_logprobs, mask: (B, T); advantages: (B,) or (B, T) (its first column). Returns ``(loss, stats)``:
    ``pg_loss``, the clip figures (over rows), ``ratio_mean``, ``ratio_max``."""
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = mask.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)
    adv = adv[:, 0] if adv.dim() == 2 else adv
    coef_1 = torch.exp((logprobs * m).sum(1) - (old_logprobs.detach() * m).sum(1))  # (B,)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_high)
    per_seq = -torch.min(coef_1 * adv, coef_2 * adv)
    loss = per_seq.sum() / (logprobs.shape[0] if num_seqs is None else num_seqs)
    with torch.no_grad():
        low, high = (coef_1 < 1 - epsilon_low) & (adv < 0), (coef_1 > 1 + eps_high) & (adv > 0)
        stats = {"pg_loss": loss.detach(), "clip_ratio/low_mean": low.float().mean(),
                 "clip_ratio/high_mean": high.float().mean(), "clip_ratio/region_mean": (low | high).float().mean(),
                 "clipfrac": (low | high).float().mean(), "ratio_mean": coef_1.mean(), "ratio_max": coef_1.max()}
    return loss, {k: v.detach() for k, v in stats.items()}


__all__ = ["LOSS_TYPES", "IS_LEVELS", "high_entropy_mask", "off_policy_mask", "vespo_weights", "grpo_policy_loss",
           "adaptive_entropy_coef", "applied_entropy_coef", "rloo_sequence_loss"]
