"""TRL 1.16's GRPO / RLOO loss settings (refit/learner/losses/grpo.py, advantages.py) against TRL's formulas written out
here, independently, as trl/trainer/grpo_trainer.py ``_compute_loss`` and rloo_trainer.py compute them: loss value
AND gradient on one fixed batch (fixed log-probs, old log-probs, rewards, masks, entropies), float64, to 1e-6.

Then the update: TRL's normalisers per gradient-accumulation slice (a micro-batch cut further for memory gives the
same gradient), the replayed minibatch order, mask_truncated_completions, and the facade's mapping."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from refit.learner import losses as L

B, T = 6, 5
TOL = dict(rtol=1e-6, atol=1e-6)


def batch():
    """Fixed completions' tensors: current log-probs (the leaf), old log-probs some way off (ratios off 1 in both
    directions), group advantages from fixed rewards (G = 3), a mask with short rows, entropies, reference log-probs."""
    g = torch.Generator().manual_seed(7)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[1, :2] = logp.detach()[1, :2] - 0.5  # ratio 1.65 on a negative-advantage row: past delta 1.3
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25], dtype=torch.float64)
    grouped = rewards.view(-1, 3)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, ent, ref


# ---------------------------------------------------------------- TRL 1.16 GRPOTrainer._compute_loss, written out


def trl_grpo_loss(per_token_logps, old_per_token_logps, advantages, mask, loss_type="dapo", epsilon=0.2,
                  epsilon_high=None, importance_sampling_level="token", delta=None, top_entropy_quantile=1.0,
                  entropies=None, off_policy_mask_threshold=None, beta=0.0, ref_per_token_logps=None,
                  use_bias_correction_kl=True, entropy_coef=0.0, max_completion_length=T, num_items_in_batch=None,
                  ga=1, steps_per_generation=1, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0)):
    """One process, one micro-batch, train mode (current_gradient_accumulation_steps = ga)."""
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    advantages = advantages.unsqueeze(1)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        local = entropies[mask.bool()].float()
        thr = torch.quantile(local, 1 - top_entropy_quantile)
        entropy_mask = ((entropies * mask.float()) >= thr) & mask.bool()
    if off_policy_mask_threshold is not None:
        kl_div = old_per_token_logps - per_token_logps.detach()
        avg = (kl_div * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (avg <= off_policy_mask_threshold)).to(mask.dtype)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps)
                        - 1)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temps = torch.where(advantages > 0, sapo[0], sapo[1])
        per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            lower = math.log(1e-8)
            seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            log_w = torch.clamp(seq, lower, 20.0)
            k = torch.where(advantages >= 0, vespo[0], vespo[2])
            lam = torch.where(advantages >= 0, vespo[1], vespo[3]).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi * advantages * per_token_logps
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / ga
    elif loss_type in ["cispo", "dapo", "vespo"]:
        n = mask.sum() if num_items_in_batch is None else num_items_in_batch
        normalizer = n.clamp(min=1.0) * ga / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean() / ga
    if entropy_coef != 0.0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * ((entropies * eff).sum() / eff.sum().clamp(min=1.0) / ga)
    return loss


def both(ours_kw: dict, trl_kw: dict):
    """(our loss, our grad, TRL's loss, TRL's grad) on the fixed batch."""
    logp, old, adv, mask, ent, ref = batch()
    ours, _ = L.grpo_policy_loss(logp, old, adv, mask, **ours_kw)
    (g1,) = torch.autograd.grad(ours, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    trl = trl_grpo_loss(logp2, old, adv, mask, **trl_kw)
    (g2,) = torch.autograd.grad(trl, logp2)
    return ours, g1, trl, g2


def assert_same(ours, g1, trl, g2):
    torch.testing.assert_close(ours, trl, **TOL)
    torch.testing.assert_close(g1, g2, **TOL)
    assert g1.abs().sum() > 0  # the batch reaches the gradient


@pytest.mark.parametrize("loss_type", L.LOSS_TYPES)
def test_each_loss_type_equals_trls_formula_value_and_gradient(loss_type):
    kw = dict(loss_type=loss_type, epsilon_high=0.28 if loss_type != "cispo" else 5.0)
    ours, g1, trl, g2 = both({**kw, "epsilon_low": 0.2, "max_completion_length": T}, kw)
    assert_same(ours, g1, trl, g2)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_importance_sampling_gspo(loss_type):
    kw = dict(loss_type=loss_type, importance_sampling_level="sequence")
    assert_same(*both(kw, kw))


def test_two_sided_clipping_delta_and_clip_higher():
    kw = dict(loss_type="dapo", epsilon_high=0.28, delta=1.3)
    ours, g1, trl, g2 = both(kw, kw)
    assert_same(ours, g1, trl, g2)
    plain = both(dict(loss_type="dapo", epsilon_high=0.28), dict(loss_type="dapo", epsilon_high=0.28))
    assert not torch.allclose(plain[0], ours)  # delta bites on this batch


def test_entropy_mask_top_quantile():
    logp, old, adv, mask, ent, ref = batch()
    em = L.high_entropy_mask(ent, mask, 0.4)
    assert 0 < em.sum() < mask.sum() and not (em & ~mask.bool()).any()
    assert_same(*both(dict(loss_type="bnpo", token_weights=em.double(), entropy_mask=em),
                      dict(loss_type="bnpo", top_entropy_quantile=0.4, entropies=ent)))


def test_entropy_bonus_with_and_without_the_mask():
    logp, old, adv, mask, ent, ref = batch()
    ent = ent + 0.1 * logp  # an entropy that carries gradient, as the policy's does
    em = L.high_entropy_mask(ent, mask, 0.5)
    for q, e_mask in ((1.0, None), (0.5, em)):
        ours, _ = L.grpo_policy_loss(logp, old, adv, mask, loss_type="grpo", entropies=ent, entropy_coef=0.03,
                                     token_weights=None if e_mask is None else e_mask.double(), entropy_mask=e_mask)
        (g1,) = torch.autograd.grad(ours, logp, retain_graph=True)
        trl = trl_grpo_loss(logp, old, adv, mask, loss_type="grpo", entropies=ent, entropy_coef=0.03,
                            top_entropy_quantile=q)
        (g2,) = torch.autograd.grad(trl, logp, retain_graph=True)
        assert_same(ours, g1, trl, g2)


def test_off_policy_mask_threshold():
    logp, old, adv, mask, ent, ref = batch()
    keep = L.off_policy_mask(adv, logp, old, mask, 0.05)
    assert 0 < keep.sum() < B  # some negative-advantage rows dropped on this batch
    assert_same(*both(dict(loss_type="dapo", token_weights=keep), dict(loss_type="dapo",
                                                                        off_policy_mask_threshold=0.05)))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_kl_term_with_trls_bias_correction(bias_correction):
    logp, old, adv, mask, ent, ref = batch()
    kl = L.kl_k3(logp, ref)
    ours, st = L.grpo_policy_loss(logp, old, adv, mask, loss_type="grpo", kl=kl, beta=0.04,
                                  kl_bias_correction=bias_correction)
    (g1,) = torch.autograd.grad(ours, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    trl = trl_grpo_loss(logp2, old, adv, mask, loss_type="grpo", beta=0.04, ref_per_token_logps=ref,
                        use_bias_correction_kl=bias_correction)
    (g2,) = torch.autograd.grad(trl, logp2)
    assert_same(ours, g1, trl, g2)
    torch.testing.assert_close(st["pg_loss"] + 0.04 * st["kl_loss"], trl.detach(), **TOL)


def test_accumulation_slices_sum_to_trls_step():
    """TRL with gradient_accumulation_steps 2 and steps_per_generation 2 over one generation of B rows: each slice's
    loss with the normalisers Refit's update passes (objective.slice_norms) equals TRL's slice loss, for every type."""
    logp, old, adv, mask, ent, ref = batch()
    halves = [slice(0, 3), slice(3, 6)]
    for lt in L.LOSS_TYPES:
        for h in halves:
            n_mb = mask[h].sum()
            ours, _ = L.grpo_policy_loss(logp[h], old[h], adv[h], mask[h], loss_type=lt,
                                         num_tokens=(n_mb * 2 if lt == "bnpo" else mask.sum() / 1),
                                         num_seqs=6, max_completion_length=T)
            trl = trl_grpo_loss(logp[h], old[h], adv[h], mask[h], loss_type=lt, ga=2, steps_per_generation=2,
                                num_items_in_batch=mask.sum())
            torch.testing.assert_close(ours, trl, **TOL)


# ---------------------------------------------------------------- RLOO


def trl_rloo(per_token_logps, old_per_token_logps, rewards, mask, g, beta=0.0, ref=None, epsilon=0.2,
             epsilon_high=None, normalize_advantages=False, reward_clip_range=None):
    """TRL 1.16 RLOOTrainer: rewards (clip, KL penalty of summed k1, leave-one-out, normalise) and the loss."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if reward_clip_range:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0:
        rewards = rewards - beta * ((old_per_token_logps - ref) * mask).sum(-1)
    grouped = rewards.view(-1, g)
    baselines = ((grouped.sum(1, keepdim=True) - grouped) / (g - 1)).view(-1)
    advantages = rewards - baselines
    if normalize_advantages:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
    logps = (per_token_logps * mask).sum(1)
    old_logps = (old_per_token_logps * mask).sum(1)
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    return -torch.min(coef_1 * advantages, coef_2 * advantages).mean(), advantages


@pytest.mark.parametrize("normalize,clip", [(False, None), (True, (-0.5, 1.0))])
def test_rloo_loss_advantages_normalize_and_reward_clip(normalize, clip):
    from refit.learner.ppo.objective import clip_scores
    from refit.learner.ppo.experience import group_advantages, per_token_rewards

    logp, old, _, mask, _, ref = batch()
    old = logp.detach() + 0.02 * torch.randn(B, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25], dtype=torch.float64)
    cfg = SimpleNamespace(reward_clip_range=clip or ())
    per_tok = per_token_rewards(clip_scores(cfg, rewards), L.kl_k1(old, ref), mask, 0.05)
    adv, _ = group_advantages(per_tok, mask, "rloo", 3, normalize=normalize)
    ours, _ = L.rloo_sequence_loss(logp, old, adv, mask, 0.2, 0.3)
    (g1,) = torch.autograd.grad(ours, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    trl, trl_adv = trl_rloo(logp2, old, rewards, mask, 3, beta=0.05, ref=ref, epsilon_high=0.3,
                            normalize_advantages=normalize, reward_clip_range=clip)
    (g2,) = torch.autograd.grad(trl, logp2)
    torch.testing.assert_close(adv[:, 0].double(), trl_adv, **TOL)
    assert_same(ours, g1, trl, g2)


# ---------------------------------------------------------------- advantages


def test_normalize_then_sum_equals_trls_gdpo_aggregation():
    per = torch.tensor([[1.0, 0.2], [0.0, float("nan")], [1.0, 0.6], [0.0, 0.1], [0.0, 0.3], [1.0, 0.9]])
    w = torch.tensor([1.0, 0.5])
    ours, _ = L.normalize_then_sum_advantages(per, w, 3)

    def nanstd(x, dim=None, keepdim=False):  # TRL's nanstd, unbiased
        m = torch.nanmean(x, dim=dim, keepdim=True)
        var = torch.nanmean((x - m) ** 2, dim=dim, keepdim=True)
        n = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
        return torch.sqrt(var * n / (n - 1))

    grouped = per.view(-1, 3, 2)
    rk = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, 1) + 1e-4)).view(-1, 2)
    r = (rk * w[None]).nansum(1)
    trl = (r - torch.nanmean(r)) / (nanstd(r) + 1e-4)
    torch.testing.assert_close(ours, trl.view(-1), **TOL)


def test_scale_rewards_values_equal_trls():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25])
    g = r.view(-1, 3)
    centred = (g - g.mean(1, keepdim=True)).view(-1)
    expect = {"group": centred / (g.std(1).repeat_interleave(3) + 1e-4), "batch": centred / (r.std() + 1e-4),
              "none": centred}
    for scale, e in expect.items():
        torch.testing.assert_close(L.grpo_advantages(r, 3, scale)[0], e, **TOL)
