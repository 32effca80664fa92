"""The update route: how a PPO step goes from its scored rollout to the optimizer step, chosen once by
:func:`choose_route` (in refit.learner.ppo.build's ``setup``) from the config, the model and the process layout, held
by the run and logged in one line with its reason, e.g. ``refit ppo: update route single pass (1 epoch, ...)``.

- :class:`StreamingUpdate` (one-pass streaming, refit.learner.ppo.onepass): the old log-probs come from the update's
  own forward, micro-batch by micro-batch; the reference is scored per micro-batch. No value head, no KL in the
  reward, no seq_mask, a loss that splits over any rows.
- :class:`SinglePassUpdate`: the update's forward over the whole batch runs first, with autograd; its detached
  outputs are the old log-probs, values and entropy (the scoring pass), then the update reuses it. One epoch, one
  minibatch, no gradient accumulation.
- :class:`ScoreThenUpdate`: a no-grad scoring pass in chunks, then the update; every config (several epochs or
  minibatches, torchrun, bf16 autocast, LoRA dropout, ``single_pass: false``).

Every route needs one epoch, one minibatch, one process, no bf16 autocast and no LoRA dropout except the last; each
takes the step the others take within fp32 summation noise (tests/test_onepass.py, tests/test_ppo_update.py).

Two conditions depend on the step rather than the run, and are re-checked there: the single pass needs the batch
within one forward's rows (``micro_rows``: from this batch's lengths and the memory), and a streaming route with an
adaptive KL coefficient and the KL penalty in the reward needs the coefficient still at 0 (Ziegler's update is
multiplicative, so it stays there; checked all the same, since streaming would then be wrong). A route that declines
a step takes that step as :class:`ScoreThenUpdate` (the cycle logs the first time, with the reason); the route
itself stays the one chosen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.onepass import WIDTH_STEP, ReferenceAhead, onepass_update, streamable_loss
from refit.learner.ppo.experience import make_experience, needs_reference, score_chunks
from refit.learner.ppo.update import EntropyCoef, Experience, UpdateSettings, distributed_ppo_update, policy_forward
from refit.learner.run.lora import adapter_dropout
from refit.learner.run.precision import mixed_bf16
from refit.learner.run.policy import ForwardOut, vocab_size
from refit.rollout.types import RolloutBatch

Check = Callable[[dict[str, float]], None]  # the check of an unchecked push, on the experience stats, before a step


class UpdateRoute(Protocol):
    """One way through steps 3 (the experience) and 4 (the PPO update) of a PPO step."""

    name: str  # as logged: 'one-pass streaming', 'single pass', 'score-then-update'
    why: str  # the reason it was chosen, in the config's and the model's terms

    def declines(self, s: UpdateSettings, rows: int, kl_coef: float) -> str | None:
        """Why this step cannot run on this route (it runs as :class:`ScoreThenUpdate`), or None."""

    def learn(self, run, rollout: RolloutBatch, scores: torch.Tensor, s: UpdateSettings, update_gen: torch.Generator,
              check: Check, timings: dict[str, float], per_func: list | None = None
              ) -> tuple[dict[str, float], dict[str, float]]:
        """(experience stats, update stats) of the step on ``run`` (refit.learner.ppo.cycle.Run); ``timings`` gets
        ``time/score`` and ``time/update``."""


@dataclass(frozen=True)
class StreamingUpdate:
    """One learner pass: :func:`refit.learner.ppo.onepass.onepass_update` (time/score 0: inside time/update)."""

    why: str
    adaptive_reward_kl: bool = False  # the KL penalty in the reward at an adaptive coefficient: re-checked per step
    name: str = "one-pass streaming"

    def declines(self, s: UpdateSettings, rows: int, kl_coef: float) -> str | None:
        if self.adaptive_reward_kl and kl_coef > 0:
            return f"the adaptive KL coefficient is {kl_coef:g} with the KL penalty in the reward"
        return None

    def learn(self, run, rollout, scores, s, update_gen, check, timings, per_func=None):
        t1 = time.perf_counter()
        _, stats, upd = onepass_update(run.cfg, s, run.policy, run.optimizer, run.scheduler, rollout, scores,
                                       scoring_reference(run), run.state.kl.value, before_step=check,
                                       per_func=per_func)
        timings["time/score"], timings["time/update"] = 0.0, time.perf_counter() - t1
        return stats, upd


@dataclass(frozen=True)
class SinglePassUpdate:
    """The update's forward first (with autograd), its detached outputs the scoring pass (time/score holds it)."""

    why: str
    name: str = "single pass"

    def declines(self, s: UpdateSettings, rows: int, kl_coef: float) -> str | None:
        if s.micro_rows and rows > s.micro_rows:
            return (f"its batch of {rows} rows is more than one forward's {s.micro_rows} (optim.micro_batch_rows, "
                    "or what fits the memory)")
        return None

    def learn(self, run, rollout, scores, s, update_gen, check, timings, per_func=None):
        return score_then_update(run, rollout, scores, s, update_gen, check, timings, per_func, one_forward=True)


@dataclass(frozen=True)
class ScoreThenUpdate:
    """A no-grad scoring pass in chunks, then the update (time/score, time/update)."""

    why: str
    name: str = "score-then-update"

    def declines(self, s: UpdateSettings, rows: int, kl_coef: float) -> str | None:
        return None

    def learn(self, run, rollout, scores, s, update_gen, check, timings, per_func=None):
        return score_then_update(run, rollout, scores, s, update_gen, check, timings, per_func, one_forward=False)


def choose_route(cfg, s: UpdateSettings, distributed: bool, kl_coef: float) -> UpdateRoute:
    """The run's update route from ``cfg``, the update's settings ``s`` (the model's: its value head, bf16 autocast
    on CUDA) and the process layout, at the KL coefficient the run starts from; each with its reason."""
    blocked = one_pass_blockers(cfg, s, distributed)
    if blocked:
        return ScoreThenUpdate(", ".join(blocked))
    unstreamed = stream_blockers(cfg, s, kl_coef)
    if not unstreamed:
        kl = (f"KL in the loss at kl_coef {kl_coef:g}" if needs_reference(cfg, kl_coef) else
              f"no reference scored at kl_coef {kl_coef:g}")
        adaptive = cfg.adap_kl_ctrl and cfg.kl_penalty == "reward"
        return StreamingUpdate(f"{cfg.advantage_estimator}: no value head, 1 epoch, 1 minibatch, {kl}"
                               + (", adaptive KL re-checked each step" if adaptive else ""), adaptive)
    if s.gradient_accumulation_steps == 1:
        return SinglePassUpdate(f"1 epoch, 1 minibatch, no accumulation; not streamed: {', '.join(unstreamed)}")
    return ScoreThenUpdate(f"gradient_accumulation_steps {s.gradient_accumulation_steps}; not streamed: "
                           + ", ".join(unstreamed))


def on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).is_cuda


def update_settings(cfg: PPOConfig, kl_coef: float, on_cuda: bool, entropy: EntropyCoef | None = None
                    ) -> UpdateSettings:
    """The update's knobs from ``cfg``, at the current (adaptive) ``kl_coef``, with the run's entropy coefficient
    (``entropy``, its owner; None: ``cfg.entropy_coef`` fixed); bf16 autocast as ``cfg`` resolved it
    (refit.learner.run.precision)."""
    return UpdateSettings(num_ppo_epochs=cfg.num_ppo_epochs, num_mini_batches=cfg.num_mini_batches,
                          gradient_accumulation_steps=cfg.optim.gradient_accumulation_steps,
                          cliprange=cfg.cliprange, cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef,
                          entropy_coef=cfg.entropy_coef, max_grad_norm=cfg.optim.max_grad_norm,
                          kl_coef=kl_coef, kl_in_loss=cfg.kl_penalty == "loss",
                          kl_estimator=cfg.kl_estimator, use_critic=cfg.advantage_estimator == "gae",
                          autocast_bf16=mixed_bf16(cfg), loss_type=cfg.loss_type,
                          cliprange_high=cfg.cliprange_high, delta=cfg.delta,
                          importance_sampling_level=cfg.importance_sampling_level,
                          top_entropy_quantile=cfg.top_entropy_quantile,
                          off_policy_mask_threshold=cfg.off_policy_mask_threshold,
                          kl_bias_correction=cfg.kl_bias_correction, max_completion_length=cfg.response_length,
                          sapo_temperatures=tuple(cfg.sapo_temperatures), vespo_params=tuple(cfg.vespo_params),
                          minibatch_order=cfg.minibatch_order,
                          entropy_ctrl=entropy if cfg.loss_type not in ("token", "rloo") else None,
                          router_aux_loss_coef=cfg.router_aux_loss_coef)


def one_pass_blockers(cfg, s: UpdateSettings, distributed: bool) -> list[str]:
    """What keeps the update's forward from giving the old log-probs on any route: [] when nothing does."""
    return [why for bad, why in (
        (not cfg.single_pass, "single_pass false"),
        (s.num_ppo_epochs != 1, f"{s.num_ppo_epochs} PPO epochs"),  # later passes need the pre-update log-probs
        (s.num_mini_batches != 1, f"{s.num_mini_batches} minibatches"),
        (bool(s.router_aux_loss_coef), "router_aux_loss_coef (the update's forward returns the router logits)"),
        (distributed, "torchrun (rank 0 scores rows that other ranks update)"),
        (cfg.lora.dropout > 0, f"LoRA dropout {cfg.lora.dropout:g} (the old log-probs have none)")) if bad]


def stream_blockers(cfg, s: UpdateSettings, kl_coef: float) -> list[str]:
    """What keeps a one-pass step from streaming micro-batch by micro-batch (refit.learner.ppo.onepass)."""
    return [why for bad, why in (
        (s.use_critic, "a value head (gae: the advantages need every row's values)"),
        (cfg.kl_penalty == "reward" and needs_reference(cfg, kl_coef),
         f"the KL penalty in the reward at kl_coef {kl_coef:g}"),
        (cfg.correction == "seq_mask", "seq_mask (the loss's tokens need every row's drop)"),
        (not streamable_loss(s), f"loss_type {s.loss_type} with its normalisers or entropy terms")) if bad]


def scoring_reference(run):
    """The reference that scores: its engine when it has one, else the PyTorch reference (None: not loaded)."""
    return run.ref_engine if run.ref_engine is not None else run.ref


def experience(run, rollout: RolloutBatch, scores: torch.Tensor, policy_out: ForwardOut | None = None,
               ref_ahead: ReferenceAhead | None = None, per_func: list | None = None
               ) -> tuple[Experience, dict[str, float]]:
    """:func:`refit.learner.ppo.experience.make_experience` on the run's models at the current KL coefficient."""
    critic = run.cfg.advantage_estimator == "gae"
    return make_experience(run.cfg, run.policy, run.value_head if critic else None, scoring_reference(run), rollout,
                           scores, run.state.kl.value, policy_out, ref_ahead, per_func)


def reference_beside(run, rollout: RolloutBatch) -> ReferenceAhead | None:
    """``reference_ahead`` with the reference on an engine: its scoring started on a thread of its own (ONNX Runtime
    releases the GIL) before the policy's forward, which it then runs beside; else None (scored in turn)."""
    if not (run.cfg.reference_ahead and run.ref_engine is not None and needs_reference(run.cfg, run.state.kl.value)):
        return None
    parts = [rollout.rows(r) for r in score_chunks(rollout.num_rows)]
    return ReferenceAhead(run.ref_engine, parts, vocab_size(run.policy), ahead=True)


def score_then_update(run, rollout: RolloutBatch, scores: torch.Tensor, s: UpdateSettings,
                      update_gen: torch.Generator, check: Check, timings: dict[str, float], per_func: list | None,
                      one_forward: bool) -> tuple[dict[str, float], dict[str, float]]:
    """The scoring pass (``one_forward``: the update's own forward, kept for the update), the check, the update, on
    the batch without its all-padding columns, its widths rounded up to multiples of ``WIDTH_STEP`` (a few shapes
    over a run: refit.learner.ppo.onepass)."""
    t1 = time.perf_counter()
    rollout = rollout.trimmed(WIDTH_STEP)
    beside = reference_beside(run, rollout)
    try:
        fwd = policy_forward(run.policy, run.value_head, rollout, s) if one_forward else None
        exp, stats = experience(run, rollout, scores, fwd, beside, per_func)
    finally:
        if beside is not None:
            beside.close()
    check(stats)
    timings["time/score"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    exp, _ = run.dist.share((exp, run.state.kl.value))  # [dist] to ranks > 0 (no-op for one process)
    with adapter_dropout(run.policy):  # LoRA dropout in the update's forward only (a no-op without it)
        upd = distributed_ppo_update(run.dist, run.policy, run.value_head, run.optimizer, run.scheduler, exp, s,
                                     update_gen, ref_model=run.ref, forward=fwd)  # [dist] one process
    del fwd  # its autograd graph is freed by the backward; drop the logits too
    timings["time/update"] = time.perf_counter() - t2
    return stats, upd


__all__ = ["UpdateRoute", "StreamingUpdate", "SinglePassUpdate", "ScoreThenUpdate", "choose_route", "update_settings",
           "experience"]
