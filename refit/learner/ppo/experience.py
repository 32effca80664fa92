"""The experience of a rollout batch (the learner's side of a PPO-KL step): log-probs, the reference, KL, rewards and
advantages, into the :class:`refit.learner.ppo.update.Experience` the update takes.

The log-prob contract (see TRL PR "[t5] Fix negative kl issue", https://github.com/huggingface/trl/pull/262):
- ``old_logprobs`` and ``ref_logprobs`` are both computed HERE, by the learner, on the same
  padded inputs and at the same temperature, with no top-k/top-p truncation. KL between them
  is therefore exactly 0 when policy == reference, whatever the sampler did.
- The engine's ``rollout_logprobs`` (the distribution actually sampled from) and
  ``rollout_plain_logprobs`` (its untruncated policy) are used only to measure the mismatch
  and, if asked, to correct for it (truncated importance sampling or sequence masking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit.core.errors import RefitError
from refit.core.memory import SCORE_ROWS
from refit.learner import losses as L
from refit.learner.ppo.mismatch import mismatch_stats
from refit.learner.ppo.objective import clip_scores, loss_mask
from refit.learner.ppo.update import Experience
from refit.learner.run.policy import ForwardOut, ValueHead, response_forward
from refit.learner.run.precision import autocast


@dataclass
class Scored:
    """The learner's view of a rollout batch before the update, all (B, Tr) float32, CPU."""

    logprobs: torch.Tensor  # policy log-probs of the sampled tokens
    values: torch.Tensor  # value head
    entropy: torch.Tensor  # policy entropy per position
    ref_logprobs: torch.Tensor | None  # frozen reference log-probs of the sampled tokens (None: not scored)
    exact_kl: torch.Tensor | None  # KL(pi || ref) over the full vocabulary; >= 0 by construction


def engine_ref_logprobs(ref_engine, batch, s: slice, vocab: int) -> torch.Tensor:
    """(b, Tr, V) reference log-probs of rows ``s`` at the batch's sampling temperature, scored on a frozen reference
    engine.

    ``Engine.score`` with ``topk = V`` returns every token's plain log-prob in vocabulary order (no sort,
    see :class:`refit.rollout.types.ScoreResult`). Same padding and positions as the learner's forward (the
    engine's padding rule), so at step 0 they equal the policy's up to the engine's parity (1e-4 gate; ~1e-7 in fp32).
    """
    out = ref_engine.score(batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s],
                           batch.response_mask[s], temperature=batch.sampling.temperature, topk=vocab)
    return out.topk_logprobs


def score_chunks(rows: int, chunk: int = SCORE_ROWS) -> list[slice]:
    """The row ranges :func:`score_batch` scores at a time."""
    return [slice(i, min(i + chunk, rows)) for i in range(0, rows, chunk)]


@torch.no_grad()
def score_batch(model, value_head: ValueHead, ref_model, batch, chunk: int = SCORE_ROWS,
                policy_out: ForwardOut | None = None, ref_ahead=None) -> Scored:
    """Everything the PPO step needs from the learner, from ONE policy and ONE reference forward per chunk.

    ``batch``: a :class:`refit.rollout.types.RolloutBatch`; scored at the temperature it was sampled at
    (``batch.sampling.temperature``: the learner's log-probs are the sampler's distribution before truncation).
    Same inputs (padding, positions, temperature) as :func:`learner_view`, which it equals
    field by field; the exact KL is taken from the same logits instead of two extra forwards.
    ``ref_model`` is the frozen reference as a PyTorch module, or an Engine over the reference's
    engine folder (``ref_backend: onnxruntime``): its full-vocabulary log-probs then stand in for the
    reference logits (log_softmax of log-probs is themselves); None: no reference is scored
    (:func:`needs_reference` false), ``ref_logprobs`` and ``exact_kl`` are None.
    ``policy_out``: the policy's forward over the whole batch, already run (refit.learner.ppo.update.single_pass: the
    update's own forward); its rows are used, detached, instead of a policy forward here. ``ref_ahead``: the
    reference's logits of each ``chunk`` rows, scored on a thread of their own since before the policy's forward
    (refit.learner.ppo.onepass.ReferenceAhead over :func:`score_chunks`; ``take(j)``: chunk ``j``'s).
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "v", "ent", "ref", "kl")}
    temperature = batch.sampling.temperature
    for j, s in enumerate(score_chunks(batch.num_rows, chunk)):
        args = (batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s], batch.is_seq2seq, temperature)
        if policy_out is None:
            pol = response_forward(model, *args, value_head)  # value_head None (no critic): values are 0
        else:
            pol = ForwardOut(logits=policy_out.logits[s].detach(),
                             values=None if policy_out.values is None else policy_out.values[s].detach())
        ref = None
        if ref_model is not None:  # scored beside the policy's forward already (ref_ahead), else now
            ref = (ref_ahead.take(j) if ref_ahead is not None
                   else reference_logits(ref_model, batch, s, pol.logits.shape[-1])).to(pol.logits.device)
        ids = batch.response_ids[s].to(pol.logits.device)
        st = L.token_stats(pol.logits, ids, ref)  # token-chunked: (b, chunk, V) temporaries only
        parts["lp"].append(st.logprobs.cpu())
        parts["v"].append(pol.values.float().cpu() if pol.values is not None else torch.zeros(ids.shape))
        parts["ent"].append(st.entropy.cpu())
        if ref is not None:
            parts["ref"].append(L.token_stats(ref, ids).logprobs.cpu())
            parts["kl"].append(st.exact_kl.cpu())
        del ref, st
    c = {k: torch.cat(v) if v else None for k, v in parts.items()}
    return Scored(logprobs=c["lp"], values=c["v"], entropy=c["ent"], ref_logprobs=c["ref"], exact_kl=c["kl"])


@torch.no_grad()
def reference_logits(ref_model, batch, s: slice, vocab: int) -> torch.Tensor:
    """(b, Tr, V) reference logits of rows ``s`` at the batch's sampling temperature: a PyTorch reference's forward,
    or an engine's full-vocabulary log-probs (:func:`engine_ref_logprobs`; log_softmax of log-probs is themselves)."""
    if isinstance(ref_model, torch.nn.Module):
        return response_forward(ref_model, batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s],
                                batch.is_seq2seq, batch.sampling.temperature).logits
    return engine_ref_logprobs(ref_model, batch, s, vocab)


def needs_reference(cfg, kl_coef: float) -> bool:
    """Whether this step scores the frozen reference: when the KL is in the objective (``kl_coef`` > 0, the
    current, possibly adaptive, coefficient) or ``reference: always`` (the kl/* metrics at kl_coef 0). TRL's GRPO
    at ``beta`` 0 loads no reference either; without it the step logs no kl/* figures."""
    return cfg.reference == "always" or kl_coef > 0


def per_token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """TRL/Ziegler reward shaping: -kl_coef * KL on every token, the score added on the last real one.

    scores (B,), kl (B, Tr), mask (B, Tr) -> rewards (B, Tr); 0 on padding.
    """
    rewards = -kl_coef * kl * mask
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] += scores * (mask.sum(-1) > 0)
    return rewards


def make_advantages(rewards, values, mask, gamma: float, lam: float, whiten_rewards: bool):
    if whiten_rewards:
        rewards = L.masked_whiten(rewards, mask, shift_mean=False) * mask
    adv, returns = L.compute_gae(rewards, values, mask, gamma, lam)
    return L.masked_whiten(adv, mask) * mask, returns


def group_advantages(rewards: torch.Tensor, mask: torch.Tensor, estimator: str, group_size: int,
                     scale_rewards: str = "group", normalize: bool = False, per_func: list | None = None
                     ) -> tuple[torch.Tensor, dict]:
    """RLOO / GRPO advantages (B, Tr) from per-token rewards (B, Tr): each row's return is the sum of its
    rewards (the score plus the per-token KL penalty, undiscounted: TRL RLOO's ``score - kl_coef * sum KL``),
    the group baseline is taken over the ``group_size`` rows of a prompt (prompt-major), and the sequence
    advantage is given to every response token of the row (``mask``; 0 elsewhere). ``normalize``: RLOO's
    ``normalize_advantages``. ``per_func``: each reward function's values (B, F) and weights (F,): GRPO's
    ``normalize_then_sum`` from them instead (no KL in the reward: GRPO's is in the loss)."""
    returns = rewards.sum(-1)  # (B,)
    if per_func is not None:
        adv, stats = L.normalize_then_sum_advantages(per_func[0], per_func[1], group_size)
    elif estimator == "rloo":
        adv, stats = L.rloo_advantages(returns, group_size, normalize)
    elif estimator == "grpo":
        adv, stats = L.grpo_advantages(returns, group_size, scale_rewards)
    else:
        raise RefitError(f"unknown group estimator {estimator!r} (rloo, grpo)")
    return L.broadcast_to_tokens(adv, mask), stats


def make_experience(cfg, policy: torch.nn.Module, value_head: ValueHead | None, ref, rollout, scores: torch.Tensor,
                    kl_coef: float, policy_out: ForwardOut | None = None,
                    ref_ahead=None, per_func: list | None = None) -> tuple[Experience, dict[str, float]]:
    """The :class:`Experience` of a rollout: learner log-probs, KL by every estimator, mismatch figures, rewards and
    advantages; (experience, stats).

    ``cfg``: the PPO config (estimators, correction; the temperature is the rollout's: ``rollout.sampling``);
    ``value_head``: the critic (None: rloo / grpo);
    ``ref``: the frozen reference (an engine or a PyTorch model; scored only when :func:`needs_reference`);
    ``kl_coef``: the KL penalty's coefficient now; ``policy_out``: the update's forward, already run (single pass);
    else the policy is scored here; ``ref_ahead``: the reference's chunks, already being scored (score_batch)."""
    critic = value_head is not None
    scores = clip_scores(cfg, scores)
    response, trunc_stats = loss_mask(cfg, rollout)
    # one policy forward (or none: policy_out) + one reference forward (or none: no KL in the objective); under bf16
    # autocast both, as the update's forward is: KL(0) = 0 and the first ratio is 1 (refit.learner.run.precision)
    with autocast(cfg, next(policy.parameters()).device):
        sc = score_batch(policy, value_head, ref if needs_reference(cfg, kl_coef) else None, rollout,
                         policy_out=policy_out, ref_ahead=ref_ahead)
    old_lp, values, ref_lp = sc.logprobs, sc.values, sc.ref_logprobs
    is_weights, mask, stats = corrections(cfg, rollout, old_lp, slice(None), response.clone())
    stats.update(trunc_stats)
    stats.update(experience_stats(cfg, rollout, old_lp, sc.entropy, ref_lp, sc.exact_kl, is_weights))
    penalty = (kl_terms(old_lp, ref_lp, sc.exact_kl)[cfg.kl_estimator] if cfg.kl_penalty == "reward"
               and ref_lp is not None else torch.zeros_like(old_lp))
    if critic:
        rewards = per_token_rewards(scores, penalty, mask, kl_coef)
        adv, returns = make_advantages(rewards, values, mask, cfg.gamma, cfg.lam, cfg.whiten_rewards)
        stats["value/explained_variance"] = float(L.explained_variance(values, returns, mask))
    else:  # the group baseline sees every sampled row (seq_mask drops rows from the loss only)
        # every row's score counts (TRL scores truncated completions too); the KL is summed over the loss's tokens
        rewards = per_token_rewards(scores, penalty * response, rollout.response_mask, kl_coef)
        adv, gstats = group_advantages(rewards, mask, cfg.advantage_estimator, cfg.num_generations, cfg.scale_rewards,
                                       cfg.normalize_advantages, per_func)
        returns = torch.zeros_like(adv)
        stats.update({f"advantage/{k}": float(v) for k, v in gstats.items()})
    exp = Experience(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, response_ids=rollout.response_ids,
                     mask=mask, old_logprobs=old_lp, ref_logprobs=ref_lp if ref_lp is not None else
                     torch.zeros_like(old_lp), values=values, advantages=adv, returns=returns, is_weights=is_weights,
                     temperature=rollout.sampling.temperature)
    return exp, stats


def corrections(cfg, rollout, old_lp: torch.Tensor, rows: slice | torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The mismatch correction of rows ``rows`` (old log-probs ``old_lp`` and ``mask`` are those rows'):
    (truncated importance weights or None, the mask with seq_mask's dropped rows zeroed, stats)."""
    stats = {}
    is_weights = None
    if cfg.correction == "tis":
        is_weights = L.truncated_importance_weights(old_lp, rollout.rollout_logprobs[rows], cfg.tis_cap) * mask
    elif cfg.correction == "seq_mask":
        drop = L.sequence_mismatch_mask(old_lp, rollout.rollout_plain_logprobs[rows], mask, cfg.seq_mask_threshold)
        mask = mask * (~drop).float()[:, None]
        stats["mismatch/seq_masked_frac"] = float(drop.float().mean())
    return is_weights, mask, stats


def kl_terms(old_lp: torch.Tensor, ref_lp: torch.Tensor, exact: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per-token KL(pi || ref) by every estimator (B, Tr)."""
    kls = {k: L.kl_estimate(old_lp, ref_lp, k) for k in ("k1", "k2", "k3")}
    if exact is not None:
        kls["exact"] = exact
    return kls


def experience_stats(cfg, rollout, old_lp: torch.Tensor, entropy: torch.Tensor, ref_lp: torch.Tensor | None,
                     exact_kl: torch.Tensor | None, is_weights: torch.Tensor | None) -> dict[str, float]:
    """The step's learner-side figures over the whole batch: engine/learner mismatch, the TIS factor, the KL by
    every estimator (when the reference was scored) and the policy's entropy."""
    response = rollout.response_mask
    stats = mismatch_stats(rollout, old_lp)
    if is_weights is not None:  # the factor by which TIS scales the mean policy-gradient term (1 = untouched)
        stats["mismatch/tis_grad_scale"] = float(L.masked_mean(is_weights, response))
    if ref_lp is not None:
        kls = kl_terms(old_lp, ref_lp, exact_kl)
        for k, v in kls.items():
            stats[f"kl/{k}"] = float(L.masked_mean(v, response))
        stats["kl/k1_seq"] = float((kls["k1"] * response).sum(-1).mean())
    stats["policy/entropy"] = float(L.masked_mean(entropy, response))
    return stats
