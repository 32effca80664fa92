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


def rloo_advantages(returns: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, Stats]:
    """REINFORCE leave-one-out advantages.

    Args:
        returns: (B,) sequence returns (score minus any KL penalty), B = groups x ``group_size``.
        group_size: G >= 2 samples per prompt.
    Returns:
        ``(advantages (B,), stats)``; stats: ``baseline_mean``, ``group_std_mean`` (detached).
    """
    g = _groups(returns, group_size)  # (P, G)
    baseline = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    adv = (g - baseline).reshape(-1)
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


def broadcast_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantages -> (B, T) per token: every response token of a row gets its row's value, 0 on padding."""
    return seq_advantages[:, None].to(mask.dtype if mask.is_floating_point() else torch.float32) * mask


__all__ = ["rloo_advantages", "grpo_advantages", "broadcast_to_tokens", "SCALE_REWARDS"]
