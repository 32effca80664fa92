"""Group baselines (refit/learner/losses/advantages.py) against values computed by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from refit.learner.losses import broadcast_to_tokens, grpo_advantages, rloo_advantages

# two prompts, G = 3: returns (1, 2, 6) and (0, 0, 3)
R = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])


def test_rloo_hand_computed():
    # group 1: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5 -> -3, -1.5, 4.5
    # group 2: baselines 1.5, 1.5, 0 -> -1.5, -1.5, 3
    adv, stats = rloo_advantages(R, 3)
    assert_close(adv, torch.tensor([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]))
    # identity: A_i = G/(G-1) * (R_i - mean)
    g = R.view(2, 3)
    assert_close(adv, (1.5 * (g - g.mean(1, keepdim=True))).reshape(-1))
    assert_close(stats["baseline_mean"], torch.tensor((4 + 3.5 + 1.5 + 1.5 + 1.5 + 0) / 6))


def test_grpo_group_scaling_hand_computed():
    # group 1: mean 3, deviations (-2, -1, 3), unbiased std sqrt((4+1+9)/2)=sqrt(7)
    # group 2: mean 1, deviations (-1, -1, 2), unbiased std sqrt((1+1+4)/2)=sqrt(3)
    adv, stats = grpo_advantages(R, 3, "group")
    s1, s2 = math.sqrt(7) + 1e-4, math.sqrt(3) + 1e-4
    assert_close(adv, torch.tensor([-2 / s1, -1 / s1, 3 / s1, -1 / s2, -1 / s2, 2 / s2]))
    assert_close(stats["group_std_mean"], torch.tensor((math.sqrt(7) + math.sqrt(3)) / 2))
    assert stats["zero_std_frac"] == 0


def test_grpo_batch_and_none_scaling():
    # batch: one unbiased std over all six returns: mean 2, squares 1+0+16+4+4+1=26 -> sqrt(26/5)
    adv, _ = grpo_advantages(R, 3, "batch")
    s = math.sqrt(26 / 5) + 1e-4
    assert_close(adv, torch.tensor([-2 / s, -1 / s, 3 / s, -1 / s, -1 / s, 2 / s]))
    adv, _ = grpo_advantages(R, 3, "none")  # Dr. GRPO: the mean is removed, nothing scaled
    assert_close(adv, torch.tensor([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]))


def test_equal_returns_give_zero_advantage_and_are_counted():
    adv, stats = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2, "group")
    assert_close(adv[:2], torch.zeros(2))
    assert stats["zero_std_frac"] == 0.5
    assert_close(rloo_advantages(torch.tensor([5.0, 5.0]), 2)[0], torch.zeros(2))


def test_shift_invariance_and_group_size_errors():
    """Adding a constant to every return changes no advantage (the baseline moves with it)."""
    for fn in (lambda r: rloo_advantages(r, 3)[0], lambda r: grpo_advantages(r, 3, "group")[0]):
        assert_close(fn(R + 10.0), fn(R), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of group_size"):
        rloo_advantages(R, 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        grpo_advantages(R, 1)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(R, 3, "std")


def test_broadcast_to_tokens_zero_on_padding():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert_close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask),
                 torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
