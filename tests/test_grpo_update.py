"""The PPO update with TRL's loss settings (refit/learner/ppo/objective.py) on a tiny GPT-2: one optimizer step's
gradient equals TRL's, summed over its gradient-accumulation slices as TRL's trainer sums them (the per-slice formula of
tests/test_grpo_losses.py on the policy's own forward), whatever the memory cut of a slice; the replayed minibatch
order; mask_truncated_completions; the facade's mapping of the DAPO settings and its refusals."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.hf_folder import load_model
from refit.learner import losses as L
from refit.learner.ppo.objective import loss_mask
from refit.learner.ppo.update import Experience, UpdateSettings, ppo_update
from test_grpo_losses import trl_grpo_loss

B, TP, TR = 8, 4, 5


@pytest.fixture(scope="module")
def setup(model_dirs):
    torch.manual_seed(0)
    policy = load_model(model_dirs["tiny-gpt2"]).eval()
    g = torch.Generator().manual_seed(3)
    v = policy.config.vocab_size
    prompt, response = torch.randint(4, v, (B, TP), generator=g), torch.randint(4, v, (B, TR), generator=g)
    mask = torch.ones(B, TR)
    mask[2, 2:] = 0
    mask[5, 4:] = 0
    lp, _ = _logprobs(policy, prompt, response)
    old = lp.detach() + 0.3 * torch.randn(B, TR, generator=g)  # a later pass: ratios off 1
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 2.0, -1.0, 0.25, 0.3])
    adv = L.grpo_advantages(rewards, 4, "group")[0]
    z = torch.zeros(B, TR)
    exp = Experience(prompt, torch.ones(B, TP, dtype=torch.long), response, mask, old, z, z,
                     adv[:, None] * mask, z, None, 1.0)
    return policy, exp, rewards


def _logprobs(model, prompt, response):
    """Per-token log-probs and entropies of the response from one plain forward (TRL's _get_per_token_logps...)."""
    logits = model(input_ids=torch.cat([prompt, response], 1)).logits[:, TP - 1:TP - 1 + TR].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, response[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _our_grads(policy, exp, s: UpdateSettings, seed=0):
    """The gradient ppo_update steps with (SGD at lr 1, no clipping: the weights move by -grad)."""
    p = copy.deepcopy(policy).requires_grad_(True)
    before = [q.detach().clone() for q in p.parameters()]
    opt = torch.optim.SGD(p.parameters(), lr=1.0)
    ppo_update(p, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), exp, s,
               torch.Generator().manual_seed(seed))
    return [b - q.detach() for b, q in zip(before, p.parameters())]


def _trl_grads(policy, exp, perm, ga: int, **kw):
    """TRL: the step's slices (perm's rows in order, ga of them), each loss from the formula, backward summed."""
    p = copy.deepcopy(policy).requires_grad_(True)
    micro = B // ga
    for a in range(ga):
        idx = perm[a * micro:(a + 1) * micro]
        lp, ent = _logprobs(p, exp.prompt_ids[idx], exp.response_ids[idx])
        loss = trl_grpo_loss(lp, exp.old_logprobs[idx], exp.advantages[idx, 0], exp.mask[idx], ga=ga,
                             steps_per_generation=ga, num_items_in_batch=exp.mask.sum(), entropies=ent,
                             max_completion_length=TR, **kw)
        loss.backward()
    return [q.grad.detach().clone() for q in p.parameters()]


def _settings(ga: int, micro_rows: int = 0, **kw) -> UpdateSettings:
    return UpdateSettings(1, 1, ga, 0.2, 0.2, 0.0, kw.pop("entropy_coef", 0.0), 1e9, use_critic=False,
                          micro_rows=micro_rows, max_completion_length=TR, **kw)


SLOW = pytest.mark.slow  # each ~5 s alone, 20-30 s on a loaded 2-core box; the bnpo + entropy-mask case stays
CASES = [pytest.param(dict(loss_type="dapo", cliprange_high=0.28), marks=SLOW),
         pytest.param(dict(loss_type="bnpo"), marks=SLOW), pytest.param(dict(loss_type="grpo", delta=1.3), marks=SLOW),
         pytest.param(dict(loss_type="dr_grpo", importance_sampling_level="sequence"), marks=SLOW),
         dict(loss_type="bnpo", top_entropy_quantile=0.5, entropy_coef=0.01),
         pytest.param(dict(loss_type="dapo", off_policy_mask_threshold=0.02), marks=SLOW)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_update_gradient_equals_trls_over_its_accumulation_slices(setup, case):
    policy, exp, _ = setup
    trl_kw = {{"cliprange_high": "epsilon_high"}.get(k, k): v for k, v in case.items()}
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    want = _trl_grads(policy, exp, perm, 2, **trl_kw)
    for micro_rows in (0, 1):  # a slice cut in forwards of one row (memory) is the same step (not with the mask)
        got = _our_grads(policy, exp, _settings(2, micro_rows, **case))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert max(float(w.abs().max()) for w in want) > 1e-4


@pytest.mark.slow
def test_rloo_update_gradient_equals_trls(setup):
    """TRL's RLOO step over 2 accumulation slices (its leave-one-out advantages, its loss on the model's forward,
    the micro-batch mean divided by the accumulation steps as HF's Trainer does) = Refit's update, loss_type rloo."""
    policy, exp, rewards = setup
    grouped = rewards.view(-1, 4)
    adv = rewards - ((grouped.sum(1, keepdim=True) - grouped) / 3).view(-1)
    rloo_exp = Experience(**{**exp.__dict__, "advantages": adv[:, None] * exp.mask})
    got = _our_grads(policy, rloo_exp, _settings(2, loss_type="rloo"))
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    p = copy.deepcopy(policy).requires_grad_(True)
    for a in range(2):
        idx = perm[a * 4:(a + 1) * 4]
        lp, _ = _logprobs(p, exp.prompt_ids[idx], exp.response_ids[idx])
        # TRL RLOO's _compute_loss: one ratio per row from the summed log-probs, clipped, mean over the rows
        coef_1 = torch.exp((lp * exp.mask[idx]).sum(1) - (exp.old_logprobs[idx] * exp.mask[idx]).sum(1))
        (-torch.min(coef_1 * adv[idx], coef_1.clamp(0.8, 1.2) * adv[idx]).mean() / 2).backward()
    for a, b in zip(got, [q.grad for q in p.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_replay_keeps_one_order_over_the_iterations(setup):
    """num_iterations 2 over 2 minibatches: TRL's buffer order (one shuffle, replayed) vs Refit's reshuffle."""
    policy, exp, _ = setup
    seen = []
    orig = ppo_update.__globals__["_micro_loss"]

    def spy(model, vh, e, idx, *a, **k):  # the rows each optimizer step sees; no forward needed for the order
        seen.append(sorted(idx.tolist()))
        return (next(model.parameters()) * 0).sum(), {}

    ppo_update.__globals__["_micro_loss"] = spy
    try:
        for order in ("replay", "reshuffle"):
            seen.clear()
            s = UpdateSettings(2, 2, 1, 0.2, 0.2, 0.0, 0.0, 1e9, use_critic=False, loss_type="dapo",
                               minibatch_order=order)
            _our_grads(policy, exp, s, seed=5)
            assert (seen[:2] == seen[2:]) == (order == "replay"), (order, seen)
    finally:
        ppo_update.__globals__["_micro_loss"] = orig


def test_mask_truncated_completions_masks_rows_without_a_stop_token():
    response = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0], [5, 6, 7, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    rollout = SimpleNamespace(response_ids=response, response_mask=mask, stop_set=lambda: {2})
    got, stats = loss_mask(SimpleNamespace(mask_truncated_completions=True), rollout)
    assert got.sum(1).tolist() == [3, 0, 1, 4] and stats["response/truncated_frac"] == 0.25
    assert torch.equal(loss_mask(SimpleNamespace(mask_truncated_completions=False), rollout)[0], mask)


def test_truncated_completions_keep_their_reward_in_the_group_baseline():
    """TRL masks truncated completions out of the loss only: the group's mean and std still see their rewards."""
    from refit.learner.ppo.onepass import _experience_shell

    response = torch.tensor([[5, 2, 0], [5, 6, 7], [2, 0, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rollout = SimpleNamespace(prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2),
                              response_ids=response, response_mask=mask, stop_set=lambda: {2},
                              sampling=SimpleNamespace(temperature=1.0))
    cfg = SimpleNamespace(mask_truncated_completions=True, reward_clip_range=(), advantage_estimator="grpo",
                          num_generations=4, scale_rewards="group", normalize_advantages=False, correction="none")
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    exp, stats = _experience_shell(cfg, rollout, scores)
    want = (scores - scores.mean()) / (scores.std() + 1e-4)
    torch.testing.assert_close(exp.advantages[:, 0], want * torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert exp.mask.sum(1).tolist() == [2, 0, 1, 0] and stats["response/truncated_frac"] == 0.5


def test_facade_maps_the_dapo_settings_and_refuses_with_reasons(tmp_path):
    from refit.learner.trl.grpo import GRPOConfig, RLOOConfig, to_ppo_config

    a = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, loss_type="dr_grpo",
                   scale_rewards="none", epsilon_high=0.28, num_iterations=2, steps_per_generation=2, top_p=0.9,
                   mask_truncated_completions=True, max_steps=4, use_cpu=True, importance_sampling_level="sequence",
                   delta=1.5, top_entropy_quantile=0.2, off_policy_mask_threshold=0.5, entropy_coef=0.01,
                   multi_objective_aggregation="normalize_then_sum")
    c = to_ppo_config(a, str(tmp_path))
    assert (c.loss_type, c.cliprange_high, c.scale_rewards, c.num_ppo_epochs, c.num_mini_batches, c.minibatch_order,
            c.mask_truncated_completions, c.importance_sampling_level, c.delta, c.top_entropy_quantile,
            c.off_policy_mask_threshold, c.entropy_coef, c.kl_bias_correction, c.multi_objective_aggregation) == (
        "dr_grpo", 0.28, "none", 2, 2, "replay", True, "sequence", 1.5, 0.2, 0.5, 0.01, True, "normalize_then_sum")
    r = to_ppo_config(RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                                 max_steps=1, normalize_advantages=True, reward_clip_range=(-1.0, 1.0), use_cpu=True),
                      str(tmp_path))
    assert (r.loss_type, r.normalize_advantages, r.reward_clip_range) == ("rloo", True, (-1.0, 1.0))
    ad = to_ppo_config(GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                  max_steps=1, use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=0.5,
                                  entropy_coef_delta=0.002, entropy_coef_max=0.1), str(tmp_path))
    assert (ad.entropy_coef, ad.entropy_target, ad.entropy_coef_delta, ad.entropy_coef_min, ad.entropy_coef_max) == (
        0.01, 0.5, 0.002, 0.0, 0.1)
    with pytest.raises(RefitError, match="loss_type='ppo'"):
        to_ppo_config(GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                 max_steps=1, loss_type="ppo"), str(tmp_path))
    with pytest.raises(RefitError, match="delta=1.1 must be > 1 \\+ epsilon_high"):
        to_ppo_config(GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                 max_steps=1, delta=1.1), str(tmp_path))
