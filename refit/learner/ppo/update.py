"""The clipped PPO update on a rollout's :class:`Experience` (made by refit.learner.ppo.experience): epochs,
minibatches and micro-batches normalised by the minibatch's tokens, the value loss with a critic, the KL term with
``kl_penalty: loss``, TRL's loss types (refit.learner.ppo.objective), and its torchrun form.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from refit.core.errors import RefitError
from refit.learner import losses as L
from refit.learner.ppo.objective import slice_norms, trl_objective
from refit.learner.run.distributed import reduce_stats
from refit.learner.run.policy import ForwardOut, response_forward


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
    temperature: float  # the rollout's sampling temperature (RolloutBatch.sampling): each learner forward's

    def part(self, rows: torch.Tensor, batch) -> "Experience":
        """Rows ``rows`` as ``batch`` holds them (those rows of the rollout without their all-padding columns:
        ``RolloutBatch.rows(rows).trimmed()``): its prompt and response, every (B, Tr) field cut to its response's
        width. The cut fields are copies (advanced indexing)."""
        w = batch.response_ids.shape[1]
        cut = lambda t: None if t is None else t[rows, :w]  # noqa: E731
        return replace(self, prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                       response_ids=batch.response_ids,
                       **{f: cut(getattr(self, f)) for f in ("mask", "old_logprobs", "ref_logprobs", "values",
                                                             "advantages", "returns", "is_weights")})


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
    kl_coef: float = 0.0  # used only when kl_in_loss
    kl_in_loss: bool = False  # GRPO-style: KL to the reference as a loss term (instead of a reward penalty)
    kl_estimator: str = "k3"  # the loss term's estimator: k1 | k2 | k3 | exact (exact needs ref_model)
    use_critic: bool = True  # False (rloo / grpo): no value forward, no value loss
    autocast_bf16: bool = False  # bf16 autocast for the forward, on the model's device type
    micro_rows: int = 0  # rows per forward with autograd (micro-batches split further to it); 0: no cap
    # TRL's loss settings (refit/learner/ppo/objective.py; PPOConfig's fields of the same names): 'token' is Refit's own
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
    entropy_ctrl: EntropyCoef | None = None  # a TRL loss type's entropy bonus coefficient (adaptive: moves per step)
    router_aux_loss_coef: float = 0.0  # a TRL loss type: the MoE policy's load-balancing loss times this


@dataclass
class KLCoef:
    """The KL penalty's coefficient, its one owner: ``cfg.kl_coef`` at step 0, adapted after each step with
    ``adap_kl_ctrl`` (Ziegler et al. 2019, Sec. 2.2), saved in and restored from a checkpoint's state. The update
    reads it through :class:`UpdateSettings`, the reward penalty through ``make_experience`` (ppo.experience)."""

    value: float
    target: float | None = None  # adaptive: the target KL per sequence; None: the coefficient stays fixed
    horizon: float = 10000.0  # adaptive: the horizon

    def adapt(self, kl_per_sequence: float, rows: int) -> None:
        """After a step on ``rows`` sequences whose mean summed k1 KL was ``kl_per_sequence``."""
        if self.target is not None:
            self.value = L.adaptive_kl_update(self.value, kl_per_sequence, self.target, self.horizon, rows)


@dataclass
class EntropyCoef:
    """The entropy bonus's coefficient for TRL's loss types, its one owner: ``cfg.entropy_coef``; with a ``target``
    (TRL's ``use_adaptive_entropy``) moved after every optimizer step from that step's mean entropy
    (:func:`refit.learner.losses.adaptive_entropy_coef`) and applied only after a step at or below the target.
    :func:`ppo_update` moves it; the checkpoint's state keeps it (``state()``)."""

    value: float
    target: float | None = None  # None: the coefficient stays ``value``
    delta: float = 0.005
    lo: float = 0.0
    hi: float = 1.0
    last_entropy: float = math.inf  # the last optimizer step's mean entropy (TRL's _last_world_entropy)

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def applied(self) -> float:
        """The coefficient the current optimizer step's micro-batches apply."""
        return L.applied_entropy_coef(self.value, self.last_entropy, self.target) if self.adaptive else self.value

    def after_optimizer_step(self, entropy: float) -> None:
        """The step's token-weighted mean entropy (every micro-batch, every rank) moves the coefficient."""
        if self.adaptive:
            self.value = L.adaptive_entropy_coef(self.value, entropy, self.target, self.delta, self.lo, self.hi)
            self.last_entropy = entropy

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the adaptive controller's coefficient and last entropy (TRL's names); nothing for
        a fixed coefficient (the config holds it; no +inf written into state.json)."""
        return {"entropy_coef": self.value, "last_world_entropy": self.last_entropy} if self.adaptive else {}


def single_pass(s: UpdateSettings, distributed: bool, rows: int | None = None) -> bool:
    """True when the update's one forward can also serve as the scoring forward: one epoch, one minibatch
    and no accumulation (the only forward of every row runs before the only optimizer step, so its
    log-probs, values and entropy ARE the pre-update ones), one process (under torchrun rank 0 scores rows
    that other ranks update) and the batch's ``rows`` within one forward's memory (``s.micro_rows``). Under bf16
    autocast the old log-probs and the reference are scored under the same autocast
    (:func:`refit.learner.ppo.experience.make_experience`), so the update's forward serves as well."""
    fits = rows is None or not s.micro_rows or rows <= s.micro_rows
    return (s.num_ppo_epochs == 1 and s.num_mini_batches == 1 and s.gradient_accumulation_steps == 1
            and not distributed and fits)


def policy_forward(model, value_head, batch, s: UpdateSettings) -> ForwardOut:
    """The update's forward over a whole rollout batch, with autograd (for :func:`single_pass`), at the temperature
    the batch was sampled at, under the update's bf16 autocast when it has one."""
    with _autocast(model, s):
        return response_forward(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.is_seq2seq,
                                batch.sampling.temperature, value_head if s.use_critic else None)


def _autocast(model, s: UpdateSettings):
    """bf16 autocast on ``model``'s device when ``s.autocast_bf16`` (full fine-tuning in mixed precision)."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=s.autocast_bf16)


def kl_loss_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
                 logits: torch.Tensor | None = None, ref_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi || ref) (B, Tr) for the loss, by ``kind``; ``exact`` sums over the vocabulary and
    needs both models' logits (B, Tr, V) at the rows' temperature (the others only the sampled tokens')."""
    if kind == "exact":
        if logits is None or ref_logits is None:
            raise RefitError("kl_estimator=exact in the loss needs the reference model's logits")
        return L.exact_kl_from_logits(logits, ref_logits, chunk_size=L.default_chunk(*logits.shape[::2]))
    return L.kl_estimate(logprobs, ref_logprobs, kind)


def _micro_loss(model, value_head, exp: Experience, idx, n_tokens, s: UpdateSettings, ref_model=None,
                out: ForwardOut | None = None):
    """The micro-batch's loss and stats; ``out``: its forward, already run (rows ``idx``), else run here."""
    ctx = _autocast(model, s)
    args = (exp.prompt_ids[idx], exp.prompt_mask[idx], exp.response_ids[idx], _is_s2s(model), exp.temperature)
    if out is None:
        with ctx:
            out = response_forward(model, *args, value_head if s.use_critic else None,
                                   router_aux=exp.mask[idx] if s.router_aux_loss_coef else None)
    dev = out.logits.device
    ref_logits = None
    if kl_term_on(s) and s.kl_estimator == "exact":
        if ref_model is None:
            raise RefitError("kl_penalty=loss with kl_estimator=exact: ppo_update needs ref_model")
        with torch.no_grad(), ctx:
            ref_logits = response_forward(ref_model, *args).logits.to(dev)
    # log-prob, entropy (and exact KL) from one token-chunked pass: the logits and their gradient are the only
    # (B, Tr, V) tensors (refit/learner/losses/chunked.py)
    st = L.token_stats(out.logits, exp.response_ids[idx].to(dev), ref_logits)
    return micro_objective(out, st, exp, idx, n_tokens, s)


def kl_term_on(s: UpdateSettings) -> bool:
    """The KL to the reference is a loss term: ``kl_penalty: loss`` at a coefficient > 0 (at 0 the reference is
    not scored, refit.learner.ppo.experience.needs_reference)."""
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
        return trl_objective(logprobs, st.entropy, exp, idx, n_tokens, s, kl, out.aux_loss)
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
            # never cut with the entropy mask (its quantile is over TRL's whole micro-batch) or the router loss
            whole = (forward is not None or not s.micro_rows or s.top_entropy_quantile < 1
                     or bool(s.router_aux_loss_coef))  # TRL's load-balancing loss is the whole micro-batch's
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
            _move_entropy_coef(s.entropy_ctrl, mb, shard, acc)
            for key, v in mb.items():
                acc.setdefault(key, []).append(_combine(key, v, over_micro_batches=True))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
            acc.setdefault("grad_norm", []).append(float(grad_norm))
            optimizer.step()
            scheduler.step()
    return {key: _combine(key, v) for key, v in acc.items()}


def _move_entropy_coef(ctrl: EntropyCoef | None, mb: dict[str, list[float]], shard, acc) -> None:
    """After an optimizer step's micro-batches: the adaptive entropy coefficient moved by the step's mean entropy
    (the micro-batches' window sums ``mb`` takes them out of, all-reduced over ranks), its value logged."""
    if ctrl is None or not (ctrl.adaptive or ctrl.value):  # no bonus: nothing to move or log (as TRL)
        return
    if ctrl.adaptive:
        window = torch.tensor([sum(mb.pop(ENTROPY_WINDOW[0])), sum(mb.pop(ENTROPY_WINDOW[1]))], dtype=torch.float64)
        window = shard.all_reduce(window) if shard is not None else window
        ctrl.after_optimizer_step(float(window[0] / window[1].clamp(min=1.0)))
    acc.setdefault("entropy_coef", []).append(ctrl.value)


# partial sums over the minibatch (its token count, or TRL's normalisers)
TOKEN_SUM_STATS = ("pg_loss", "vf_loss", "entropy", "kl_loss", "entropy_bonus", "loss")
ENTROPY_WINDOW = ("entropy_window_sum", "entropy_window_tokens")  # an optimizer step's entropy, for EntropyCoef
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
