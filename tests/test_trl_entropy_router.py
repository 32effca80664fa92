"""TRL 1.16 GRPO's adaptive entropy bonus (``use_adaptive_entropy``) and a Mixture-of-Experts policy's load-balancing
loss (``router_aux_loss_coef``) in Refit's update, each against TRL's computation written out here from
trl/trainer/grpo_trainer.py (``_compute_loss``: the controller at the optimizer-step boundary, the aux term added
after the entropy bonus), on fixed batches, to 1e-6."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from refit.learner import losses as L
from refit.learner.ppo.objective import Norm
from refit.learner.ppo.update import EntropyCoef, Experience, UpdateSettings, _micro_loss, ppo_update


def _trl_controller(coef, last, entropy, target, delta, lo, hi):
    """TRL's lines: ``apply_coef`` for the step, then the update at the step boundary."""
    apply = coef if last <= target else 0.0
    coef = min(coef + delta, hi) if entropy <= target else max(coef - delta, lo)
    return apply, coef, entropy


def test_the_controller_is_trls_step_by_step():
    ctrl = EntropyCoef(0.02, target=1.0, delta=0.01, lo=0.005, hi=0.04)
    coef, last = 0.02, math.inf
    for h in (0.5, 0.7, 0.9, 1.0, 2.0, 3.0, 1.5, 0.2, 0.1):  # below, at and above the target; both clamps reached
        want_apply, coef, last = _trl_controller(coef, last, h, 1.0, 0.01, 0.005, 0.04)
        assert ctrl.applied() == want_apply
        ctrl.after_optimizer_step(h)
        assert (ctrl.value, ctrl.last_entropy) == (coef, last)
    assert L.applied_entropy_coef(0.3, math.inf, 1e9) == 0.0  # the first step applies none (TRL starts at +inf)
    fixed = EntropyCoef(0.02)
    fixed.after_optimizer_step(0.0)
    assert (fixed.applied(), fixed.value) == (0.02, 0.02)


def _gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64)).eval()


def _batch(model, b, tp, tr, temp, seed=1):
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size
    prompt, resp = torch.randint(4, v, (b, tp), generator=g), torch.randint(4, v, (b, tr), generator=g)
    mask = torch.ones(b, tr)
    mask[1, 3:] = 0
    mask[5, 1:] = 0
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        logits = old(input_ids=torch.cat([prompt, resp], 1)).logits[:, tp - 1:tp - 1 + tr] / temp
    old_lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
    adv = torch.randn(b, 1, generator=g) * mask
    return Experience(prompt, torch.ones(b, tp, dtype=torch.long), resp, mask, old_lp, old_lp.clone(),
                      torch.zeros(b, tr), adv, torch.zeros(b, tr), None, temp)


def test_adaptive_entropy_in_the_update_is_trls_over_two_optimizer_steps():
    """dapo, 2 optimizer steps (minibatches) of 2 accumulation slices each, SGD: the parameters after the update, the
    coefficient and the last step's entropy equal TRL's loop (the first step applies no bonus, the second coef +
    delta; each slice's bonus its own token mean / the accumulation steps)."""
    temp, b, tp, tr, eps, target, delta, c0 = 0.9, 8, 4, 5, 0.2, 100.0, 0.05, 0.1
    model = _gpt2()
    exp = _batch(model, b, tp, tr, temp)
    ref_model = copy.deepcopy(model)
    ctrl = EntropyCoef(c0, target=target, delta=delta, lo=0.0, hi=1.0)
    s = UpdateSettings(num_ppo_epochs=1, num_mini_batches=2, gradient_accumulation_steps=2, cliprange=eps,
                       cliprange_value=0.2, vf_coef=0.0, entropy_coef=c0, max_grad_norm=1.0, use_critic=False,
                       loss_type="dapo", entropy_ctrl=ctrl)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    stats = ppo_update(model, None, opt, sched, exp, s, torch.Generator().manual_seed(7))

    # TRL's loop, written out
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(7))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    normaliser = exp.mask.sum() / 2  # num_items_in_batch x GA / steps_per_generation (2 x 2)
    coef, last, applied = c0, math.inf, []
    for m in range(2):
        rows = perm[m * 4:(m + 1) * 4]
        ref_opt.zero_grad()
        window = [0.0, 0.0]
        for a in range(2):
            i = rows[a * 2:(a + 1) * 2]
            logits = ref_model(input_ids=torch.cat([exp.prompt_ids[i], exp.response_ids[i]], 1)).logits
            logp_all = torch.log_softmax(logits[:, tp - 1:tp - 1 + tr] / temp, -1)
            logp = logp_all.gather(-1, exp.response_ids[i][..., None])[..., 0]
            ent = -(logp_all.exp() * logp_all).sum(-1)
            mask, adv = exp.mask[i], exp.advantages[i][:, :1]
            ratio = (logp - exp.old_logprobs[i]).exp()
            per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
            loss = (per_token * mask).sum() / normaliser
            entropy_loss = (ent * mask).sum() / mask.sum().clamp(min=1.0) / 2
            apply = coef if last <= target else 0.0
            (loss - apply * entropy_loss).backward()
            window[0] += float((ent * mask).sum().detach())
            window[1] += float(mask.sum())
        applied.append(apply)
        world = window[0] / max(window[1], 1.0)
        coef = min(coef + delta, 1.0) if world <= target else max(coef - delta, 0.0)
        last = world
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()

    assert applied == [0.0, c0 + delta]
    assert ctrl.value == pytest.approx(coef, abs=1e-12) and ctrl.last_entropy == pytest.approx(last, abs=1e-6)
    assert stats["entropy_coef"] == pytest.approx((c0 + delta + c0 + 2 * delta) / 2)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    moved = sum(float((p - q).abs().max()) for p, q in zip(model.parameters(), _gpt2().parameters()))
    assert moved > 1e-3  # the steps changed the weights


def test_router_aux_loss_is_trls_term_value_and_gradient():
    """A Qwen3-MoE policy (published head_dim 128 > hidden / heads, q/k norms, top-k renormalised; widths cut), dapo
    with router_aux_loss_coef 0.02 and 2 accumulation steps: TRL adds coef x the model's aux_loss (over the prompt
    and completion attention mask) / the accumulation steps. Loss and gradient to 1e-6."""
    from transformers import AutoModelForCausalLM

    from refit.learner.builtin.moe_models import moe_config

    cfg = moe_config("tiny-qwen3-moe", 96, head_dim=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ref_model = copy.deepcopy(model)
    b, tp, tr, temp, coef = 4, 4, 5, 1.0, 0.02
    exp = _batch(model, 6, tp, tr, temp)
    idx = torch.tensor([0, 1, 4, 5])  # rows with a masked tail (1) and a one-token completion (5)
    s = UpdateSettings(num_ppo_epochs=1, num_mini_batches=1, gradient_accumulation_steps=2, cliprange=0.2,
                       cliprange_value=0.2, vf_coef=0.0, entropy_coef=0.0, max_grad_norm=1.0, use_critic=False,
                       loss_type="dapo", router_aux_loss_coef=coef)
    n = exp.mask[idx].sum()
    norm = Norm(tokens=n, dapo_tokens=n * 2, seqs=b * 2, micro_tokens=n * 2, scale=2)
    loss, stats = _micro_loss(model, None, exp, idx, norm, s)
    loss.backward()

    mask = exp.mask[idx]
    attn = torch.cat([exp.prompt_mask[idx], mask.long()], 1)
    out = ref_model(input_ids=torch.cat([exp.prompt_ids[idx], exp.response_ids[idx]], 1), attention_mask=attn,
                    output_router_logits=True)
    logp = torch.log_softmax(out.logits[:, tp - 1:tp - 1 + tr] / temp, -1).gather(
        -1, exp.response_ids[idx][..., None])[..., 0]
    ratio = (logp - exp.old_logprobs[idx]).exp()
    adv = exp.advantages[idx][:, :1]
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    want = (per_token * mask).sum() / (n * 2) + coef * out.aux_loss / 2
    want.backward()
    assert float(out.aux_loss) > 0 and float(stats["aux_loss"]) == pytest.approx(float(out.aux_loss), abs=1e-6)
    assert float(loss) == pytest.approx(float(want), abs=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    router = [p.grad for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert router and all(float(g.abs().max()) > 0 for g in router)  # the router learns from the aux term


def test_the_facade_takes_the_architectures_coefficient_for_moe_and_refuses_it_for_a_dense_model(tmp_path, tokenizer):
    from refit.core.errors import RefitError
    from refit.learner.builtin.moe_models import build_moe_model
    from refit.learner.trl import GRPOConfig, to_ppo_config

    moe = build_moe_model("tiny-qwen3-moe", tmp_path / "moe", tokenizer, num_hidden_layers=1)
    dense = tmp_path / "dense"
    _gpt2().save_pretrained(dense)
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_steps=1)
    assert to_ppo_config(GRPOConfig(**kw), str(moe)).router_aux_loss_coef == 0.001  # Qwen3-MoE's own, TRL's default
    assert to_ppo_config(GRPOConfig(**kw, router_aux_loss_coef=0.0), str(moe)).router_aux_loss_coef == 0.0
    assert to_ppo_config(GRPOConfig(**kw), str(dense)).router_aux_loss_coef == 0.0
    with pytest.raises(RefitError, match="router_aux_loss_coef=0.01: GPT2Config is not a Mixture-of-Experts model"):
        to_ppo_config(GRPOConfig(**kw, router_aux_loss_coef=0.01), str(dense))
