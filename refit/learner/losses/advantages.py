"""Group baselines: sequence advantages from G samples of the same prompt (RLOO, GRPO), no critic.

Pure functions on tensors (torch only). Rows are prompt-major, as the engine returns them
(``RolloutBatch.prompt_index``: p0 s0..s(G-1), p1 s0, ...), so row ``i`` belongs to group ``i // G``.

- RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs", Eq. 7; Kool et al. 2019): the baseline of sample i is
  the mean of the OTHER G-1 samples' returns, ``A_i = R_i - (sum_j R_j - R_i) / (G - 1)``
  (TRL ``RLOOTrainer``: ``baseline = (grouped.sum(1) - grouped) / (G - 1)``).
- GRPO (Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2, outcome supervision): ``A_i = (R_i -
  mean(R_group)) / (std + 1e-4)``, with TRL ``GRPOTrainer``'s ``scale_rewards``: ``"group"`` (the
  paper: std over the group, unbiased as ``torch.std``), ``"batch"`` (one std over the whole batch,
  Hu et al. 2025 REINFORCE++ style), ``"none"`` (no division: Dr. GRPO, Liu et al. 2025, Sec. 3.1).
"""

from typing import Tuple

import torch

from refit.learner.losses.common import Stats

GRPO_EPS = 1e-4  # TRL GRPOTrainer: advantages / (std_rewards + 1e-4)
SCALE_REWARDS = ("group", "batch", "none")


def _groups(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    if returns.dim() != 1 or group_size < 2 or returns.numel() % group_size:
        raise ValueError(f"group baselines need (B,) returns with B a multiple of group_size >= 2; got "
                         f"{tuple(returns.shape)} and group_size {group_size}")
    return returns.float().view(-1, group_size)


def rloo_advantages(returns: torch.Tensor, group_size: int, normalize: bool = False) -> Tuple[torch.Tensor, Stats]:
    """REINFORCE leave-one-out advantages.

    Args:
        returns: (B,) sequence returns (score minus any KL penalty), B = groups x ``group_size``.
        group_size: G >= 2 samples per prompt.
        normalize: TRL RLOOConfig's ``normalize_advantages``: then ``(A - mean(A)) / (std(A) + 1e-4)`` over the
            whole batch (std unbiased, as TRL's ``nanstd``).
    Returns:
        ``(advantages (B,), stats)``; stats: ``baseline_mean``, ``group_std_mean`` (detached).
    """
    g = _groups(returns, group_size)  # (P, G)
    baseline = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    adv = (g - baseline).reshape(-1)
    if normalize:
        adv = (adv - adv.mean()) / (adv.std() + GRPO_EPS)
    stats = {"baseline_mean": baseline.mean().detach(), "group_std_mean": g.std(1).mean().detach()}
    return adv.detach(), stats


def grpo_advantages(returns: torch.Tensor, group_size: int, scale_rewards: str = "group"
                    ) -> Tuple[torch.Tensor, Stats]:
    """GRPO group-normalised advantages.

    Args:
        returns: (B,) sequence returns, B = groups x ``group_size``.
        group_size: G >= 2.
        scale_rewards: ``"group"`` | ``"batch"`` | ``"none"`` (TRL's choices; see the module docstring).
    Returns:
        ``(advantages (B,), stats)``; stats: ``group_std_mean``, ``zero_std_frac`` (fraction of groups whose
        returns are all equal: those rows get advantage 0 and teach nothing).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    g = _groups(returns, group_size)  # (P, G)
    adv = g - g.mean(1, keepdim=True)
    group_std = g.std(1, keepdim=True)  # unbiased, as torch.std and TRL
    if scale_rewards == "group":
        adv = adv / (group_std + GRPO_EPS)
    elif scale_rewards == "batch":
        adv = adv / (g.std() + GRPO_EPS)
    stats = {"group_std_mean": group_std.mean().detach(),
             "zero_std_frac": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().detach()}
    return adv.reshape(-1).detach(), stats


def normalize_then_sum_advantages(per_func: torch.Tensor, weights: torch.Tensor, group_size: int
                                  ) -> Tuple[torch.Tensor, Stats]:
    """TRL GRPOConfig's ``multi_objective_aggregation='normalize_then_sum'`` (GDPO): each reward function's values
    normalised within their group, ``(r_k - mean_k) / (std_k + 1e-4)`` (NaN, a function's None, left out of its
    group's mean and std, as TRL's nanmean / nanstd), the weighted nansum over functions, then the whole batch
    normalised, ``(R - mean(R)) / (std(R) + 1e-4)``; a row where every function gave None gets advantage 0.

    Args:
        per_func: (B, F) each function's rewards (NaN: None), B = groups x ``group_size``; weights: (F,).
    Returns:
        ``(advantages (B,), stats)``; stats: ``group_std_mean`` (of the summed rewards' batch std), ``zero_std_frac``.
    """
    if per_func.dim() != 2 or per_func.shape[0] % group_size or group_size < 2:
        raise ValueError(f"normalize_then_sum needs (B, F) rewards with B a multiple of group_size >= 2; got "
                         f"{tuple(per_func.shape)} and group_size {group_size}")
    b, f = per_func.shape
    g = per_func.float().view(-1, group_size, f)
    std_k = _nanstd(g, dim=1)
    rk = ((g - g.nanmean(1, keepdim=True)) / (std_k + GRPO_EPS)).view(b, f)
    unscorable = per_func.isnan().all(1)
    summed = torch.nansum(rk * weights.float()[None, :], dim=1)
    summed[unscorable] = torch.nan
    std = _nanstd(summed, dim=0)
    adv = torch.nan_to_num((summed - summed.nanmean()) / (std + GRPO_EPS), nan=0.0)
    stats = {"group_std_mean": std.mean().detach(),
             "zero_std_frac": torch.isclose(std, torch.zeros_like(std)).float().mean().detach()}
    return adv.detach(), stats


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased std ignoring NaN along ``dim`` (kept), NaN with fewer than two values (TRL's ``nanstd``)."""
    mean = x.nanmean(dim, keepdim=True)
    n = (~x.isnan()).sum(dim, keepdim=True)
    var = ((x - mean) ** 2).nanmean(dim, keepdim=True) * n / (n - 1)
    return torch.where(n > 1, var, torch.full_like(var, float("nan"))).sqrt()


def broadcast_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantages -> (B, T) per token: every response token of a row gets its row's value, 0 on padding."""
    return seq_advantages[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32) * mask


__all__ = ["rloo_advantages", "grpo_advantages", "normalize_then_sum_advantages", "broadcast_to_tokens", "SCALE_REWARDS"]
