"""The update's objective with a TRL loss type (``loss_type`` other than Refit's ``token``): TRL 1.16's GRPO / RLOO
micro-batch loss (:mod:`refit.learner.losses.grpo`) with TRL's normalisers, the entropy mask, the off-policy mask
and the entropy bonus, for the micro-batch rows that :func:`refit.learner.ppo.update.ppo_update` hands it.

TRL's micro-batch is one gradient-accumulation slice of an optimizer step's minibatch (Refit's ``micro``); Refit may
cut it further to fit memory (``micro_rows``): :class:`Norm` carries TRL's counts of the whole slice and step, so
the parts' losses add up to TRL's. The entropy mask's quantile is over the whole slice, so with
``top_entropy_quantile`` < 1 the slice is never cut.

Also the experience's two TRL settings before the advantages: :func:`loss_mask` (``mask_truncated_completions``)
and :func:`clip_scores` (RLOO's ``reward_clip_range``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit.learner import losses as L


@dataclass(frozen=True)
class Norm:
    """The normalisers of one micro-batch's loss (scalars; counts summed over every rank under torchrun)."""

    tokens: torch.Tensor  # the minibatch's response tokens (Refit's ``token`` loss; the logged entropy)
    dapo_tokens: torch.Tensor  # the generation batch's tokens / minibatches (TRL's rescaled num_items_in_batch)
    seqs: int  # the minibatch's rows (TRL: micro-batch rows x gradient_accumulation_steps)
    micro_tokens: torch.Tensor  # this accumulation slice's tokens (at least 1) x gradient_accumulation_steps x ranks
    scale: int  # gradient_accumulation_steps x ranks (TRL's per-slice means are divided by it)


def trl_objective(logprobs: torch.Tensor, entropy: torch.Tensor, exp, idx, norm: Norm, s, kl: torch.Tensor | None,
                  aux_loss: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The loss and stats of rows ``idx`` of ``exp`` (an Experience) under ``s`` (UpdateSettings), from their
    current log-probs and entropies (B, Tr), the per-token KL to the reference (None: no KL term) and the MoE
    policy's load-balancing loss of these rows (None: none; added at ``s.router_aux_loss_coef`` / TRL's
    accumulation normaliser, as TRL adds it)."""
    dev = logprobs.device
    g = lambda t: None if t is None else t[idx].to(dev)  # noqa: E731
    mask, old = g(exp.mask), g(exp.old_logprobs)
    adv = g(exp.advantages)[:, :1]  # (B, 1): the row's advantage (every token of a row holds it; TRL's shape)
    logged = {"entropy": L.token_mean(entropy.detach(), mask, norm.tokens).detach()}
    if aux_loss is not None:
        logged["aux_loss"] = aux_loss.detach()
    aux = 0.0 if aux_loss is None else s.router_aux_loss_coef * aux_loss / norm.scale
    if s.loss_type == "rloo":
        loss, stats = L.rloo_sequence_loss(logprobs, old, adv, mask, s.cliprange, s.cliprange_high, norm.seqs)
        return loss + aux, {**stats, **logged, "loss": (loss + aux).detach()}
    weights = None
    if s.off_policy_mask_threshold is not None:  # TRL without vLLM: the sampling log-probs are the old ones
        weights = L.off_policy_mask(adv, logprobs, old, mask, s.off_policy_mask_threshold)
    ent_mask = L.high_entropy_mask(entropy, mask, s.top_entropy_quantile) if s.top_entropy_quantile < 1 else None
    if ent_mask is not None:
        weights = ent_mask.to(mask.dtype) if weights is None else weights * ent_mask.to(mask.dtype)
    if ent_mask is None:
        n_ent = norm.micro_tokens
    else:
        n_ent = (mask * ent_mask.to(mask.dtype)).sum().clamp(min=1.0) * norm.scale
    loss, stats = L.grpo_policy_loss(
        logprobs, old, adv, mask, loss_type=s.loss_type, epsilon_low=s.cliprange, epsilon_high=s.cliprange_high,
        importance_sampling_level=s.importance_sampling_level, delta=s.delta,
        num_tokens=norm.micro_tokens if s.loss_type == "bnpo" else norm.dapo_tokens, num_seqs=norm.seqs,
        max_completion_length=s.max_completion_length, token_weights=weights, is_weights=g(exp.is_weights),
        kl=kl, beta=s.kl_coef if kl is not None else 0.0, kl_bias_correction=s.kl_bias_correction,
        entropies=entropy, entropy_coef=s.entropy_ctrl.applied() if s.entropy_ctrl is not None else s.entropy_coef,
        entropy_mask=ent_mask, num_entropy_tokens=n_ent,
        sapo_temperatures=tuple(s.sapo_temperatures), vespo_params=tuple(s.vespo_params))
    if s.entropy_ctrl is not None and s.entropy_ctrl.adaptive:  # the step's entropy on the tokens the bonus acts on
        eff = mask if ent_mask is None else mask * ent_mask.to(mask.dtype)
        stats["entropy_window_sum"] = (entropy.detach() * eff).sum()
        stats["entropy_window_tokens"] = eff.sum()
    if ent_mask is not None:
        stats["entropy_mask_frac"] = L.masked_mean(ent_mask.to(mask.dtype), mask).detach()
    if s.off_policy_mask_threshold is not None:
        stats["off_policy_kept_frac"] = weights.mean().detach() if ent_mask is None else L.off_policy_mask(
            adv, logprobs, old, mask, s.off_policy_mask_threshold).mean().detach()
    return loss + aux, {**stats, **logged, "loss": (loss + aux).detach()}  # TRL's logged loss: every term


def slice_norms(s, exp, mine: torch.Tensor, micro: int, ranks: int, n_tokens: torch.Tensor, mb_rows: int
                ) -> list[Norm]:
    """One :class:`Norm` per accumulation slice of this rank's minibatch rows ``mine`` (``micro`` rows each):
    ``n_tokens`` the minibatch's token count (all ranks), ``mb_rows`` its rows (all ranks)."""
    gen = exp.mask.sum().clamp(min=1.0)
    dapo = gen / s.num_mini_batches
    scale = s.gradient_accumulation_steps * ranks
    out = []
    for a in range(s.gradient_accumulation_steps):
        t = exp.mask[mine[a * micro:(a + 1) * micro]].sum().clamp(min=1.0)
        out.append(Norm(tokens=n_tokens, dapo_tokens=dapo, seqs=mb_rows, micro_tokens=t * scale, scale=scale))
    return out


def clip_scores(cfg, scores: torch.Tensor) -> torch.Tensor:
    """The scores (B,) clamped to ``cfg.reward_clip_range`` (TRL RLOO's ``reward_clip_range``, before the KL
    penalty); unchanged when it is empty."""
    if not cfg.reward_clip_range:
        return scores
    lo, hi = cfg.reward_clip_range
    return scores.clamp(min=lo, max=hi)


def loss_mask(cfg, rollout) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask (B, Tr), with ``mask_truncated_completions`` the rows whose last token is no stop token (they
    ran into response_length) zeroed, as TRL zeroes their ``completion_mask``; (mask, stats)."""
    mask = rollout.response_mask.clone()
    if not cfg.mask_truncated_completions:
        return mask, {}
    n = mask.sum(-1).long()
    last = rollout.response_ids.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    stops = torch.tensor(sorted(rollout.stop_set()), dtype=last.dtype)
    truncated = ~torch.isin(last, stops) | (n == 0)
    mask = mask * (~truncated).to(mask.dtype)[:, None]
    return mask, {"response/truncated_frac": float(truncated.float().mean())}


__all__ = ["Norm", "trl_objective", "slice_norms", "clip_scores", "loss_mask"]
