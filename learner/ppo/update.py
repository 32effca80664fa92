"""One PPO-KL iteration on a rollout batch: experience (learner side) and the clipped update.

The log-prob contract (see TRL PR "[t5] Fix negative kl issue", https://github.com/huggingface/trl/pull/262):
- ``old_logprobs`` and ``ref_logprobs`` are both computed HERE, by the learner, on the same
  padded inputs and at the same temperature, with no top-k/top-p truncation. KL between them
  is therefore exactly 0 when policy == reference, whatever the sampler did.
- The engine's ``rollout_logprobs`` (the distribution actually sampled from) and
  ``rollout_plain_logprobs`` (its untruncated policy) are used only to measure the mismatch
  and, if asked, to correct for it (truncated importance sampling or sequence masking).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from refit.core.errors import RefitError
from refit.core.memory import SCORE_ROWS
from refit.learner import losses as L
from refit.learner.ppo.mismatch import mismatch_stats
from refit.learner.ppo.objective import clip_scores, loss_mask, slice_norms, trl_objective
from refit.learner.run.distributed import reduce_stats
from refit.learner.run.precision import autocast
from refit.learner.run.policy import ForwardOut, ValueHead, response_forward


@dataclass
class Experience:
    """Learner-side tensors for one rollout batch, all (B, Tr) unless noted, CPU."""

    prompt_ids: torch.Tensor  # (B, Tp) as in RolloutBatch
    prompt_mask: torch.Tensor  # (B, Tp)
    response_ids: torch.Tensor  # (B, Tr)
    mask: torch.Tensor  # (B, Tr) float: response_mask, times the seq_mask correction if used
    old_logprobs: torch.Tensor  # learner log-probs before the update
    ref_logprobs: torch.Tensor  # frozen reference log-probs
    values: torch.Tensor  # value head before the update
    advantages: torch.Tensor  # whitened GAE advantages, or the RLOO / GRPO sequence advantage on every token
    returns: torch.Tensor  # GAE returns (value targets); 0 without a critic
    is_weights: torch.Tensor | None  # truncated importance weights (tis) or None


@dataclass
class Scored:
    """The learner's view of a rollout batch before the update, all (B, Tr) float32, CPU."""

    logprobs: torch.Tensor  # policy log-probs of the sampled tokens
    values: torch.Tensor  # value head
    entropy: torch.Tensor  # policy entropy per position
    ref_logprobs: torch.Tensor | None  # frozen reference log-probs of the sampled tokens (None: not scored)
    exact_kl: torch.Tensor | None  # KL(pi || ref) over the full vocabulary; >= 0 by construction


def engine_ref_logprobs(ref_engine, batch, s: slice, temperature: float, vocab: int) -> torch.Tensor:
    """(b, Tr, V) reference log-probs of rows ``s`` at ``temperature``, scored on a frozen reference engine.

    ``Engine.score`` with ``topk = V`` returns every token's plain log-prob in vocabulary order (no sort,
    see :class:`refit.rollout.types.ScoreResult`). Same padding and positions as the learner's forward (the
    engine's padding rule), so at step 0 they equal the policy's up to the engine's parity (1e-4 gate; ~1e-7 in fp32).
    """
    out = ref_engine.score(batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s],
                           batch.response_mask[s], temperature=temperature, topk=vocab)
    return out.topk_logprobs


def score_chunks(rows: int, chunk: int = SCORE_ROWS) -> list[slice]:
    """The row ranges :func:`score_batch` scores at a time."""
    return [slice(i, min(i + chunk, rows)) for i in range(0, rows, chunk)]


@torch.no_grad()
def score_batch(model, value_head: ValueHead, ref_model, batch, temperature: float, chunk: int = SCORE_ROWS,
                policy_out: ForwardOut | None = None, ref_ahead=None) -> Scored:
    """Everything the PPO step needs from the learner, from ONE policy and ONE reference forward per chunk.

    Same inputs (padding, positions, temperature) as :func:`learner_view`, which it equals
    field by field; the exact KL is taken from the same logits instead of two extra forwards.
    ``ref_model`` is the frozen reference as a PyTorch module, or an Engine over the reference's
    engine folder (``ref_backend: onnxruntime``): its full-vocabulary log-probs then stand in for the
    reference logits (log_softmax of log-probs is themselves); None: no reference is scored
    (:func:`needs_reference` false), ``ref_logprobs`` and ``exact_kl`` are None.
    ``policy_out``: the policy's forward over the whole batch, already run (:func:`single_pass`: the
    update's own forward); its rows are used, detached, instead of a policy forward here. ``ref_ahead``: the
    reference's logits of each ``chunk`` rows, scored on a thread of their own since before the policy's forward
    (refit.learner.ppo.onepass.ReferenceAhead over :func:`score_chunks`; ``take(j)``: chunk ``j``'s).
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "v", "ent", "ref", "kl")}
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
                   else reference_logits(ref_model, batch, s, temperature, pol.logits.shape[-1])).to(pol.logits.device)
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
def reference_logits(ref_model, batch, s: slice, temperature: float, vocab: int) -> torch.Tensor:
    """(b, Tr, V) reference logits of rows ``s`` at ``temperature``: a PyTorch reference's forward, or an engine's
    full-vocabulary log-probs (:func:`engine_ref_logprobs`; log_softmax of log-probs is themselves)."""
    if isinstance(ref_model, torch.nn.Module):
        return response_forward(ref_model, batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s],
                                batch.is_seq2seq, temperature).logits
    return engine_ref_logprobs(ref_model, batch, s, temperature, vocab)


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


@dataclass
class UpdateSettings:
    """The PPO update's knobs (a view of PPOConfig, so losses never see a config object)."""

    num_ppo_epochs: int
    num_mini_batches: int
    gradient_accumulation_steps: int
    cliprange: float
    cliprange_value: float
    vf_coef: float
    entropy_coef: float
    max_grad_norm: float
    temperature: float
    kl_coef: float = 0.0  # used only when kl_in_loss
    kl_in_loss: bool = False  # GRPO-style: KL to the reference as a loss term (instead of a reward penalty)
    kl_estimator: str = "k3"  # the loss term's estimator: k1 | k2 | k3 | exact (exact needs ref_model)
    use_critic: bool = True  # False (rloo / grpo): no value forward, no value loss
    autocast_bf16: bool = False  # bf16 autocast for the forward, on the model's device type
    micro_rows: int = 0  # rows per forward with autograd (micro-batches split further to it); 0: no cap
    # TRL's loss settings (learner/ppo/objective.py; PPOConfig's fields of the same names): 'token' is Refit's own
    loss_type: str = "token"
    cliprange_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    kl_bias_correction: bool = False
    max_completion_length: int = 0  # dr_grpo's constant
    sapo_temperatures: tuple = (1.0, 1.05)
    vespo_params: tuple = (2.0, 3.0, 3.0, 2.0)
    minibatch_order: str = "reshuffle"  # or 'replay': one shuffle for every epoch (TRL's num_iterations)


@dataclass
class KLCoef:
    """The KL penalty's coefficient, its one owner: ``cfg.kl_coef`` at step 0, adapted after each step with
    ``adap_kl_ctrl`` (Ziegler et al. 2019, Sec. 2.2), saved in and restored from a checkpoint's state. The update
    reads it through :class:`UpdateSettings`, the reward penalty through :func:`make_experience`."""

    value: float
    target: float | None = None  # adaptive: the target KL per sequence; None: the coefficient stays fixed
    horizon: float = 10000.0  # adaptive: the horizon

    def adapt(self, kl_per_sequence: float, rows: int) -> None:
        """After a step on ``rows`` sequences whose mean summed k1 KL was ``kl_per_sequence``."""
        if self.target is not None:
            self.value = L.adaptive_kl_update(self.value, kl_per_sequence, self.target, self.horizon, rows)


def single_pass(s: UpdateSettings, distributed: bool, rows: int | None = None) -> bool:
    """True when the update's one forward can also serve as the scoring forward: one epoch, one minibatch
    and no accumulation (the only forward of every row runs before the only optimizer step, so its
    log-probs, values and entropy ARE the pre-update ones), one process (under torchrun rank 0 scores rows
    that other ranks update) and the batch's ``rows`` within one forward's memory (``s.micro_rows``). Under bf16
    autocast the old log-probs and the reference are scored under the same autocast (:func:`make_experience`), so
    the update's forward serves as well."""
    fits = rows is None or not s.micro_rows or rows <= s.micro_rows
    return (s.num_ppo_epochs == 1 and s.num_mini_batches == 1 and s.gradient_accumulation_steps == 1
            and not distributed and fits)


def policy_forward(model, value_head, batch, s: UpdateSettings) -> ForwardOut:
    """The update's forward over a whole rollout batch, with autograd (for :func:`single_pass`), under the update's
    bf16 autocast when it has one."""
    with _autocast(model, s):
        return response_forward(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.is_seq2seq,
                                s.temperature, value_head if s.use_critic else None)


def _autocast(model, s: UpdateSettings):
    """bf16 autocast on ``model``'s device when ``s.autocast_bf16`` (full fine-tuning in mixed precision)."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=s.autocast_bf16)


def kl_loss_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
                 logits: torch.Tensor | None = None, ref_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi || ref) (B, Tr) for the loss, by ``kind``; ``exact`` sums over the vocabulary and
    needs both models' logits (B, Tr, V) at the update's temperature (the others only the sampled tokens')."""
    if kind == "exact":
        if logits is None or ref_logits is None:
            raise RefitError("kl_estimator=exact in the loss needs the reference model's logits")
        return L.exact_kl_from_logits(logits, ref_logits, chunk_size=L.default_chunk(*logits.shape[::2]))
    return L.kl_estimate(logprobs, ref_logprobs, kind)


def _micro_loss(model, value_head, exp: Experience, idx, n_tokens, s: UpdateSettings, ref_model=None,
                out: ForwardOut | None = None):
    """The micro-batch's loss and stats; ``out``: its forward, already run (rows ``idx``), else run here."""
    ctx = _autocast(model, s)
    args = (exp.prompt_ids[idx], exp.prompt_mask[idx], exp.response_ids[idx], _is_s2s(model), s.temperature)
    if out is None:
        with ctx:
            out = response_forward(model, *args, value_head if s.use_critic else None)
    dev = out.logits.device
    ref_logits = None
    if kl_term_on(s) and s.kl_estimator == "exact":
        if ref_model is None:
            raise RefitError("kl_penalty=loss with kl_estimator=exact: ppo_update needs ref_model")
        with torch.no_grad(), ctx:
            ref_logits = response_forward(ref_model, *args).logits.to(dev)
    # log-prob, entropy (and exact KL) from one token-chunked pass: the logits and their gradient are the only
    # (B, Tr, V) tensors (learner/losses/chunked.py)
    st = L.token_stats(out.logits, exp.response_ids[idx].to(dev), ref_logits)
    return micro_objective(out, st, exp, idx, n_tokens, s)


def kl_term_on(s: UpdateSettings) -> bool:
    """The KL to the reference is a loss term: ``kl_penalty: loss`` at a coefficient > 0 (at 0 the reference is
    not scored, :func:`needs_reference`)."""
    return s.kl_in_loss and s.kl_coef > 0


def micro_objective(out: ForwardOut, st: L.TokenStats, exp: Experience, idx, n_tokens, s: UpdateSettings):
    """The loss and stats of the micro-batch of rows ``idx``, from its forward ``out`` and its token stats ``st``
    (log-probs, entropy and, for the exact KL term, the exact KL to the reference). ``n_tokens``: the minibatch's
    token count, or with a TRL ``loss_type`` the slice's :class:`refit.learner.ppo.objective.Norm`."""
    dev = out.logits.device
    g = lambda t: None if t is None else t[idx].to(dev)  # noqa: E731
    mask = g(exp.mask)
    logprobs = st.logprobs
    if s.loss_type != "token":
        kl = None
        if kl_term_on(s):
            kl = st.exact_kl if s.kl_estimator == "exact" else kl_loss_term(logprobs, g(exp.ref_logprobs),
                                                                            s.kl_estimator)
        return trl_objective(logprobs, st.entropy, exp, idx, n_tokens, s, kl)
    pg, pstats = L.ppo_policy_loss(logprobs, g(exp.old_logprobs), g(exp.advantages), mask, s.cliprange,
                                   is_weights=g(exp.is_weights), num_tokens=n_tokens)
    ent = L.token_mean(st.entropy, mask, n_tokens)
    loss = pg - s.entropy_coef * ent
    stats = {**pstats, "entropy": ent.detach()}
    if s.use_critic:
        vf, vstats = L.ppo_value_loss(out.values.float(), g(exp.values), g(exp.returns), mask, s.cliprange_value,
                                      num_tokens=n_tokens)
        loss = loss + s.vf_coef * vf
        stats.update(vstats)
    if kl_term_on(s):
        per_token = (st.exact_kl if s.kl_estimator == "exact"
                     else kl_loss_term(logprobs, g(exp.ref_logprobs), s.kl_estimator))
        kl = L.token_mean(per_token, mask, n_tokens)
        loss = loss + s.kl_coef * kl
        stats["kl_loss"] = kl.detach()
    return loss, stats


def _is_s2s(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def ppo_update(model, value_head, optimizer, scheduler, exp: Experience, s: UpdateSettings,
               generator: torch.Generator, shard=None, ref_model=None,
               forward: ForwardOut | None = None) -> dict[str, float]:
    """``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps, each over ``gradient_accumulation_steps``
    micro-batches whose losses are normalised by the minibatch's token count (so splitting changes nothing).

    ``shard`` (a :class:`refit.learner.run.distributed.DistContext` with world_size K > 1): this process is rank r of
    K data-parallel learners; it takes rows ``[r*L, (r+1)*L)`` of every minibatch (L = minibatch / K; the
    permutation is the same on every rank), the token count is all-reduced, the loss is scaled by K
    because DDP averages gradients, and gradient sync runs on the last micro-batch only. ``model`` and
    ``value_head`` are then the DDP wrappers. Stats are this rank's; the caller reduces them.

    Stats: per minibatch, the loss terms (``TOKEN_SUM_STATS``) are the minibatch's own values (the
    micro-batches' partial sums added), whatever the accumulation; then averaged over minibatches.

    ``forward`` (:func:`single_pass` settings only): the policy's forward over the whole batch in row order,
    already run with autograd (its detached outputs made ``exp``); it is the one micro-batch's forward.
    """
    k, r = (shard.world_size, shard.rank) if shard is not None else (1, 0)
    if forward is not None and not single_pass(s, shard is not None):
        raise RefitError("ppo_update: a precomputed forward needs one epoch, one minibatch, no gradient "
                         "accumulation, one process and no autocast (single_pass)")
    b = exp.response_ids.shape[0]
    mb_size = b // s.num_mini_batches
    if mb_size % (k * s.gradient_accumulation_steps):
        raise RefitError(f"minibatch size {mb_size} (batch {b} / num_mini_batches {s.num_mini_batches}) must be "
                         f"divisible by world_size {k} x gradient_accumulation_steps {s.gradient_accumulation_steps}")
    local = mb_size // k
    micro = local // s.gradient_accumulation_steps
    heads = list(value_head.parameters()) if value_head is not None else []  # None: no critic under DDP
    params = [p for p in list(model.parameters()) + heads if p.requires_grad]
    acc: dict[str, list[float]] = {}  # one value per minibatch
    perm = torch.randperm(b, generator=generator)  # the same on every rank
    for epoch in range(s.num_ppo_epochs):
        if epoch and s.minibatch_order != "replay":  # replay: TRL's one shuffle, every iteration in that order
            perm = torch.randperm(b, generator=generator)
        for m in range(s.num_mini_batches):
            mine = perm[m * mb_size:(m + 1) * mb_size][r * local:(r + 1) * local]
            if forward is not None:  # the forward's rows in batch order: the same rows, the same loss (a sum)
                mine = torch.arange(b)
            n_tokens = exp.mask[mine].sum()
            n_tokens = (shard.all_reduce(n_tokens) if shard is not None else n_tokens).clamp(min=1.0)
            optimizer.zero_grad(set_to_none=True)
            mb: dict[str, list[float]] = {}  # one value per micro-batch
            # each micro-batch in forwards of at most s.micro_rows rows (memory; the loss is a sum over tokens);
            # never cut with the entropy mask (its quantile is over TRL's whole micro-batch)
            whole = forward is not None or not s.micro_rows or s.top_entropy_quantile < 1
            per = micro if whole else min(micro, s.micro_rows)
            norms = (slice_norms(s, exp, mine, micro, k, n_tokens, mb_size) if s.loss_type != "token"
                     else [n_tokens] * s.gradient_accumulation_steps)
            parts = [(mine[a * micro:(a + 1) * micro][c:c + per], norms[a])
                     for a in range(s.gradient_accumulation_steps) for c in range(0, micro, per)]
            for a, (idx, norm) in enumerate(parts):
                last = a == len(parts) - 1
                with (shard.no_sync(last) if shard is not None else contextlib.nullcontext()):
                    loss, stats = _micro_loss(model, value_head, exp, idx, norm, s, ref_model, forward)
                    (loss * k).backward()
                for key, v in stats.items():
                    mb.setdefault(key, []).append(float(v))
            for key, v in mb.items():
                acc.setdefault(key, []).append(_combine(key, v, over_micro_batches=True))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
            acc.setdefault("grad_norm", []).append(float(grad_norm))
            optimizer.step()
            scheduler.step()
    return {key: _combine(key, v) for key, v in acc.items()}


# partial sums over the minibatch (its token count, or TRL's normalisers)
TOKEN_SUM_STATS = ("pg_loss", "vf_loss", "entropy", "kl_loss", "entropy_bonus")
MAX_STATS = ("ratio_max",)


def _combine(key: str, values: list[float], over_micro_batches: bool = False) -> float:
    """Micro-batch stats -> the minibatch's: loss terms are partial sums (added), ``ratio_max`` a max,
    the rest (fractions, KL estimates) averaged; minibatch stats -> the update's: max or mean."""
    if key in MAX_STATS:
        return max(values)
    if over_micro_batches and key in TOKEN_SUM_STATS:
        return sum(values)
    return sum(values) / len(values)


def distributed_ppo_update(ctx, policy, value_head, optimizer, scheduler, exp: Experience, s: UpdateSettings,
                           generator: torch.Generator, ref_model=None, forward: ForwardOut | None = None,
                           ) -> dict[str, float]:
    """:func:`ppo_update` for one process, or under torchrun over this rank's slice of every global minibatch
    (``ctx``: a :class:`refit.learner.run.distributed.DistContext` after ``wrap``), stats reduced across ranks.

    ``exp`` is the full batch on every rank; only this rank's rows go through the model.
    """
    if not ctx.enabled:
        return ppo_update(policy, value_head, optimizer, scheduler, exp, s, generator, ref_model=ref_model,
                          forward=forward)
    if ctx.policy_ddp is None:
        raise RefitError("distributed_ppo_update: call DistContext.wrap(policy, value_head) first")
    stats = ppo_update(ctx.policy_ddp, ctx.value_ddp, optimizer, scheduler, exp, s, generator, shard=ctx,
                       ref_model=ref_model)
    return reduce_stats(ctx, stats, TOKEN_SUM_STATS, MAX_STATS)


def make_experience(cfg, policy: torch.nn.Module, value_head: ValueHead | None, ref, rollout, scores: torch.Tensor,
                    kl_coef: float, policy_out: ForwardOut | None = None,
                    ref_ahead=None, per_func: list | None = None) -> tuple[Experience, dict[str, float]]:
    """The :class:`Experience` of a rollout: learner log-probs, KL by every estimator, mismatch figures, rewards and
    advantages; (experience, stats).

    ``cfg``: the PPO config (temperature, estimators, correction); ``value_head``: the critic (None: rloo / grpo);
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
                         cfg.sampling.temperature, policy_out=policy_out, ref_ahead=ref_ahead)
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
                     torch.zeros_like(old_lp), values=values, advantages=adv, returns=returns, is_weights=is_weights)
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
