"""PPO / RLHF losses: GAE, the clipped policy and value losses, mismatch corrections, adaptive KL.

Pure functions on tensors (torch only, no config objects, no state); shapes and the token
normalisation rule (``num_tokens``) as in :mod:`refit.learner.losses.common`.
"""

import math
from typing import Optional, Tuple

import torch

from refit.learner.losses.common import Number, Stats, _float_mask, masked_mean, masked_var, token_mean

# --------------------------------------------------------------------------
# GAE and PPO losses
# --------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation, per token.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", Eq. (16): ``A_t = sum_l (gamma*lam)^l delta_{t+l}``,
    ``delta_t = r_t + gamma * V_{t+1} - V_t``; computed with the reversed loop of
    TRL / cleanrl: ``A_t = delta_t + gamma * lam * A_{t+1}``.

    Convention (masking): ``V_{t+1}`` is ``values[:, t+1]`` if position t+1 is
    valid and **0 otherwise** -- in particular the last valid token of a
    right-padded response is terminal (no bootstrap), and nothing from padding
    leaks in (padded rewards/values are ignored).  Any masked position acts as
    an episode boundary.  Advantages and returns are 0 at masked positions.

    Args:
        rewards, values, mask: (B, T).  ``values`` are treated as constants (detached).
    Returns:
        ``(advantages, returns)``, both (B, T), ``returns = advantages + values`` on valid tokens.
    """
    values = values.detach()
    m = _float_mask(mask, values)
    rewards = torch.where(m != 0, rewards.to(values.dtype), torch.zeros_like(values))
    values = torch.where(m != 0, values, torch.zeros_like(values))
    T = values.shape[1]
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] * m[:, t + 1] if t < T - 1 else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = (delta + gamma * lam * last_gae) * m[:, t]
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = (advantages + values) * m
    return advantages, returns


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    is_weights: Optional[torch.Tensor] = None,
    num_tokens: Optional[Number] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate policy loss, per token (Schulman et al. 2017, Eq. 7).

    ``ratio = exp(logprobs - old_logprobs)``, ``pg_loss1 = -A * ratio``,
    ``pg_loss2 = -A * clamp(ratio, 1 - cliprange, 1 + cliprange)``,
    ``loss = token_mean(max(pg_loss1, pg_loss2) * is_weights)`` (TRL/cleanrl).

    Args:
        logprobs: (B, T) current-policy log-probs (with grad).
        old_logprobs: (B, T) behaviour-policy log-probs (treated as constants).
        advantages: (B, T) (treated as constants).
        mask: (B, T).
        is_weights: optional (B, T) per-token weights multiplying the loss,
            e.g. :func:`truncated_importance_weights` for rollout/learner mismatch.
        num_tokens: see :func:`token_mean`.
    Returns:
        ``(loss, stats)``, stats: ``pg_loss``, ``clipfrac`` (fraction of tokens where
        the clipped term is active, ``pg_loss2 > pg_loss1``), ``approx_kl`` (TRL:
        ``0.5 * masked_mean((logprobs - old_logprobs)**2)``, the k2 estimator),
        ``approx_kl_k3`` (cleanrl: ``masked_mean((ratio - 1) - log ratio)``),
        ``ratio_mean``, ``ratio_max`` (over valid tokens; -inf if there are none) and,
        if given, ``is_weights_mean``.
    """
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.max(pg_loss1, pg_loss2)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = token_mean(per_token, mask, num_tokens)
    with torch.no_grad():
        valid = mask != 0
        stats = {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean((pg_loss2 > pg_loss1).to(ratio.dtype), mask),
            "approx_kl": 0.5 * masked_mean(log_ratio**2, mask),
            "approx_kl_k3": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": torch.where(valid, ratio, torch.full_like(ratio, -math.inf)).max(),
        }
        if is_weights is not None:
            stats["is_weights_mean"] = masked_mean(is_weights.detach().to(ratio.dtype), mask)
    return loss, {k: v.detach() for k, v in stats.items()}


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: Optional[float],
    num_tokens: Optional[Number] = None,
) -> Tuple[torch.Tensor, Stats]:
    """Clipped value-function loss (TRL PPO / OpenAI baselines; Ziegler et al. 2019).

    ``v_clipped = old_values + clamp(values - old_values, -c, c)``,
    ``vf_losses1 = (values - returns)**2``, ``vf_losses2 = (v_clipped - returns)**2``,
    ``loss = 0.5 * token_mean(max(vf_losses1, vf_losses2))``.
    ``cliprange_value=None`` disables clipping (plain 0.5 * MSE).

    Args:
        values: (B, T) new value predictions (with grad); old_values, returns: (B, T) constants.
    Returns:
        ``(loss, stats)`` with ``vf_loss`` and ``vf_clipfrac`` (fraction of tokens where
        the clipped error is the larger one).
    """
    old_values, returns = old_values.detach(), returns.detach()
    vf_losses1 = (values - returns) ** 2
    if cliprange_value is None:
        vf_losses2 = vf_losses1
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
        vf_losses2 = (v_clipped - returns) ** 2
    loss = 0.5 * token_mean(torch.max(vf_losses1, vf_losses2), mask, num_tokens)
    with torch.no_grad():
        clipfrac = masked_mean((vf_losses2 > vf_losses1).to(values.dtype), mask)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": clipfrac.detach()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over valid tokens (cleanrl), detached scalar.

    1 = perfect value function, 0 = no better than a constant, < 0 = worse.
    NaN when ``Var[returns] == 0`` (as cleanrl).  Uses the biased variance for both terms.
    """
    with torch.no_grad():
        var_y = masked_var(returns, mask, unbiased=False)
        var_res = masked_var(returns - values, mask, unbiased=False)
        ev = 1.0 - var_res / var_y
        return torch.where(var_y == 0, torch.full_like(ev, math.nan), ev).detach()


# --------------------------------------------------------------------------
# Rollout / learner mismatch
# --------------------------------------------------------------------------


def logprob_mismatch_stats(
    rollout_logprobs: torch.Tensor, learner_logprobs: torch.Tensor, mask: torch.Tensor
) -> Stats:
    """Agreement between inference-engine (rollout) and learner log-probs, (B, T) each.

    Returns detached scalars: ``mean_abs_diff`` (masked mean of |diff|),
    ``max_abs_diff`` (max over valid tokens, 0 if none) and
    ``token_mult_prob_error`` = masked mean of ``exp(|rollout - learner|)``
    (NeMo-RL's definition; 1.0 means perfect agreement, always >= 1).
    """
    with torch.no_grad():
        diff = (rollout_logprobs - learner_logprobs).abs()
        valid = mask != 0
        max_diff = torch.where(valid, diff, torch.zeros_like(diff)).max()
        return {
            "mean_abs_diff": masked_mean(diff, mask).detach(),
            "max_abs_diff": max_diff.detach(),
            "token_mult_prob_error": masked_mean(torch.exp(diff), mask).detach(),
        }


def truncated_importance_weights(
    learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Token-level truncated importance sampling (TIS) weights, detached (B, T).

    ``w = min(exp(learner - rollout), cap)`` -- Yao et al. 2025, "Your Efficient
    RL Framework Secretly Brings You Off-Policy RL Training".  Corrects for the
    rollout engine sampling from a slightly different distribution than the
    learner computes; pass as ``is_weights`` to :func:`ppo_policy_loss`.
    """
    return torch.clamp(torch.exp(learner_logprobs.detach() - rollout_logprobs.detach()), max=cap)


def sequence_mismatch_mask(
    learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Sequence-level mismatch filter, (B, T) -> (B,) bool.

    True for sequences whose max |learner - rollout| over valid tokens is
    strictly greater than ``threshold`` (candidates to drop: multiply the token
    mask by ``~result[:, None]``).  Sequences without valid tokens are False.
    """
    with torch.no_grad():
        diff = (learner_logprobs - rollout_logprobs).abs()
        diff = torch.where(mask != 0, diff, torch.zeros_like(diff))
        return diff.amax(dim=1) > threshold


# --------------------------------------------------------------------------
# Adaptive KL coefficient
# --------------------------------------------------------------------------


def adaptive_kl_update(kl_coef: float, current_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """Adaptive KL coefficient update (Ziegler et al. 2019, Sec. 2.2; TRL AdaptiveKLController).

    ``e = clip(current_kl / target - 1, -0.2, 0.2)``, ``mult = 1 + e * n_steps / horizon``,
    returns ``kl_coef * mult``.  Python floats in and out.
    """
    proportional_error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    mult = 1.0 + proportional_error * n_steps / horizon
    return float(kl_coef * mult)


__all__ = ["compute_gae", "ppo_policy_loss", "ppo_value_loss", "explained_variance", "logprob_mismatch_stats", "truncated_importance_weights", "sequence_mismatch_mask", "adaptive_kl_update"]
