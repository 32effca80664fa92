"""Weight sync: the learner's weights into the engine that generates, and the check that the engine took them.

The contract between the engine and the learner (the temperature both score at, the tolerance a push may leave,
an int8 engine's manifest) is one frozen record, :class:`Contract`; the push-and-check cycle is one object,
:class:`WeightSync`, that both jobs hold (PPO, distillation) and that speaks in that record:

    push          the policy's weights (a LoRA policy: its adapter only, :func:`push_tensors`) into the engine;
                  the engine's ``weights_version`` after it is the one every later rollout must come from (the
                  engine owns the number, :attr:`WeightSync.version` reads it)
    check         at once: a fixed probe batch, generated once at setup, scored by the engine and by the learner's
                  PyTorch model with the same padding, positions and temperature (:meth:`WeightSync.check_now`, the
                  learner's half a :class:`LearnerSide`); or on the next rollout (``Contract.check_on_rollout``,
                  PPO's ``probe_on_rollout``): its engine log-probs against the learner's, before any update uses it
    overlapped    PPO with ``rollout.max_staleness`` >= 1: the room's push-and-probe job queued on the engine's
                  background thread behind the generation in flight (:class:`PushQueue`), the probe's learner half
                  computed first (refit.learner.ppo.overlap: the protocol)
    finish        the queued pushes waited for and their errors raised before the run closes

A disagreement stops the run in one line naming the last checkpoint: an engine that did not take the new weights
would otherwise sample from a stale policy silently. What the room reads of the engine (``weights_version``,
``manifest``, ``adapter``) is declared by the Engine protocol (refit.rollout.engine).
"""

from __future__ import annotations

import copy
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

import torch

from refit.core.contract import DTYPES, PARITY_TOL, canonical_params
from refit.core.errors import RefitError
from refit.core.int8 import reference_model, rounding_floor
from refit.core.manifest import Manifest
from refit.learner.run.checkpoint import latest_checkpoint
from refit.learner.run.lora import (adapter_tensors, adapts_tied_head, fp32_compute, holds_int8, holds_low_precision,
                                    is_lora, merged_tensors)
from refit.learner.run.policy import learner_view
from refit.rollout.engine import Engine, check_version, next_version
from refit.rollout.types import RolloutBatch, SamplingParams

FLOOR_EVERY = 10  # an int8 engine's rounding floor is measured again after this many pushes checked against it


@dataclass(frozen=True)
class Contract:
    """What the engine and the learner agree on, and how a push is checked: one record per run."""

    temperature: float  # both sides' log-probs at it: the sampling temperature (distillation: 1.0, the models' own)
    probe_tol: float  # rollout.probe_tol: the largest max |engine - learner log-prob| a push may leave
    int8_manifest: Manifest | None = None  # an int8 engine's manifest: the learner side quantized as the engine is
    check_on_rollout: bool = False  # a push (but the last) checked by the next rollout, not the probe batch
    label: str = "engine"  # what a failed check's line calls the engine


@dataclass(frozen=True)
class LearnerSide:
    """The learner's half of a probe (:meth:`WeightSync.learner_side`): what the engine's log-probs are compared with.
    It needs only the weights about to be pushed, so an overlapped run computes it before the push."""

    logprobs: torch.Tensor  # (B, Tr) the compared model's log-probs of the probe batch's responses (0 on padding)
    floor: float  # the least tolerance the comparison needs: an fp16/bf16 engine's gate tolerance, 0.0 for fp32
    model: torch.nn.Module  # the model compared: the policy, or (an int8 engine) the policy quantized as the engine is


class Pushed(NamedTuple):
    """A push into the engine, done and checked on the probe batch (an overlapped run logs it on a later row)."""

    version: int  # the engine's weights_version after it
    probe_diff: float  # max |engine - learner log-prob| on the probe batch (within the contract's tolerance)
    push_s: float  # seconds of the push: the engine's update_weights (pushed now: with gathering the tensors)
    probe_s: float  # seconds of the probe's engine half and the comparison


class PushQueue(Protocol):
    """The engine's background thread of an overlapped run (refit.learner.ppo.overlap.RolloutAhead), as the room
    uses it: jobs run in the order queued, behind the generation in flight."""

    def push(self, job: Callable[[], Pushed]) -> None: ...  # queue ``job``: the room's push and probe

    def pushed(self) -> list[Pushed]: ...  # the queued pushes waited for, forgotten; a failed one's error raised

    def wait(self) -> float: ...  # nothing in flight afterwards


class WeightSync:
    """One engine's pushes and their checks under ``contract`` (the module's docstring: the cycle).

    The engine owns the weights version: its ``weights_version`` after a push is the version every later rollout
    must come from (:attr:`version`); the room counts nothing of its own."""

    def __init__(self, engine: Engine, probe: RolloutBatch, contract: Contract, run_dir: Path,
                 ahead: PushQueue | None = None, unchecked: bool = False):
        self.engine, self.probe, self.contract, self.run_dir, self.ahead = engine, probe, contract, run_dir, ahead
        self.unchecked = unchecked  # a push whose check is the next rollout's (Contract.check_on_rollout)
        self.told: set[str] = set()  # engine/learner mismatch causes named once per run (int8 precision, version lag)
        self._queued: int | None = None  # overlapped: the version the engine gives the push queued, until collected
        # an int8 engine's reference of a LoRA policy, made once per policy (:meth:`int8_reference`)
        self._int8_refs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._floor: float | None = None  # the int8 rounding floor last measured (:meth:`_int8_floor`)
        self._floor_age = 0  # pushes checked against it since

    @property
    def version(self) -> int:
        """The weights_version a rollout must come from: the engine's, or, while a push waits on the engine's thread
        (overlapped), the one the engine gives it when it runs (rollout.engine.next_version, the engine's rule)."""
        return self.engine.weights_version if self._queued is None else self._queued

    # ------------------------------------------------------------------ checks

    def check_version(self, rollout: RolloutBatch) -> None:
        """One line when ``rollout`` came from other weights than the last push's."""
        check_version(rollout, self.version)

    def learner_side(self, model: torch.nn.Module) -> LearnerSide:
        """The learner's half of the probe for ``model``'s weights: its log-probs on the probe batch, compared as the
        engine computes (an fp16/bf16 engine: :func:`probe_reference`; an int8 one: :meth:`int8_reference`; a bf16
        LoRA base: its weights in fp32 arithmetic, as the engine runs the same rounded base)."""
        low_base = holds_low_precision(model)
        if self.contract.int8_manifest is not None:
            model = self.int8_reference(model)
        ref, floor = probe_reference(model, engine_dtype(self.engine))
        with fp32_compute(ref) if low_base else nullcontext():
            return LearnerSide(learner_view(ref, None, self.probe, self.contract.temperature)[0], floor, model)

    def check_now(self, model: torch.nn.Module) -> float:
        """The probe batch scored on both sides; the max |log-prob diff|, or one line above the tolerance."""
        return self._probe(self.learner_side(model))

    def _probe(self, side: LearnerSide) -> float:
        """The probe's engine half against ``side``: the max |log-prob diff|, or one line above the tolerance (at
        least ``side.floor``). An int8 engine above it: the int8 rounding floor on this batch is measured and the
        engine must be within twice it (refit/export/quantize.py, Exactness)."""
        p, c = self.probe, self.contract
        eng = self.engine.score(p.prompt_ids, p.prompt_mask, p.response_ids, p.response_mask,
                                temperature=c.temperature).logprobs
        diff = float(((eng - side.logprobs).abs() * p.response_mask).max())
        tol = max(c.probe_tol, side.floor)
        if c.int8_manifest is not None and diff > tol:
            tol = max(tol, 2 * self._int8_floor(side, diff))
        return check_parity(diff, tol, self.engine.weights_version, self.run_dir, c.label, "the probe batch")

    def _int8_floor(self, side: LearnerSide, diff: float) -> float:
        """The int8 rounding floor on the probe batch (refit.core.int8.rounding_floor; three forwards of the policy
        quantized): measured at the first push that needs it, again when a push's ``diff`` lands above twice the last
        measurement (so no push fails on an old floor), and at least every :data:`FLOOR_EVERY` pushes (so a floor
        that shrinks as the weights move is not trusted for long). Between, a push within twice the last floor passes
        without the cost: at Qwen2.5-0.5B full depth the measurement was 10.1 s of a 13.7 s push."""
        self._floor_age += 1
        if self._floor is None or diff > 2 * self._floor or self._floor_age >= FLOOR_EVERY:
            p, t = self.probe, self.contract.temperature
            with fp32_compute(side.model) if holds_low_precision(side.model) else nullcontext():
                self._floor = rounding_floor(side.model, lambda m: learner_view(m, None, p, t)[0],
                                             lambda j: float(((j - side.logprobs).abs() * p.response_mask).max()))
            self._floor_age = 0
        return self._floor

    def check_rollout(self, rollout: RolloutBatch, diff: float) -> float | None:
        """After an unchecked push: ``diff`` (the rollout's max |engine - learner log-prob|) within the tolerance,
        else one line; None when no push waits for this check."""
        if not self.unchecked:
            return None
        self.unchecked = False
        return check_parity(diff, self.contract.probe_tol, rollout.weights_version, self.run_dir, self.contract.label,
                            f"the first rollout after it, {int(rollout.response_mask.sum())} response tokens")

    def tell_once(self, cause: str) -> bool:
        """Whether a mismatch ``cause`` expected every step is to be named now (the first time only)."""
        if cause in self.told:
            return False
        self.told.add(cause)
        return True

    def int8_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as the int8 engine computes it (refit/core/int8.py ``reference_model``, the contract's manifest). A
        LoRA policy's is made once and held here: it shares every parameter of the policy (the adapter as it trains, the
        frozen base) and quantizes the base's linear layers at each forward (``Int8Linear(lazy=True)``), so it follows
        each step without being made again and costs no copy of the base, fp32 or int8."""
        manifest = self.contract.int8_manifest
        if holds_int8(model):  # an int8 base (lora.base_dtype int8): the policy computes as the engine does already
            return getattr(model, "module", model).get_base_model()
        if not is_lora(model):
            return reference_model(model, manifest)
        peft_model = getattr(model, "module", model)
        ref = self._int8_refs.get(peft_model)
        if ref is None:
            ref = self._int8_refs[peft_model] = reference_model(peft_model.get_base_model(), manifest,
                                                                 share_parameters=True)
        return ref

    # ------------------------------------------------------------------ pushes

    def push(self, model: torch.nn.Module, last: bool = False) -> float | None:
        """Push ``model`` into the engine and check it: on the next rollout (``Contract.check_on_rollout``, not
        the ``last`` push: no rollout follows it; None), else on the probe batch now (its diff)."""
        if self.contract.check_on_rollout and not last:
            self.engine.update_weights(push_tensors(model, self.engine))
            self.unchecked = True
            return None
        return self.push_now(model).probe_diff

    def push_now(self, model: torch.nn.Module) -> Pushed:
        """Push ``model``'s weights (:func:`push_tensors`) into the engine and check them on the probe batch now."""
        t = time.perf_counter()
        weights = [push_tensors(model, self.engine)]
        return self._push_job(weights, None, None, time.perf_counter() - t, model)

    def _push_job(self, weights: list[dict[str, torch.Tensor]], side: LearnerSide | None, numbered: int | None,
                  gathered_s: float = 0.0, model: torch.nn.Module | None = None) -> Pushed:
        """The push and its probe: ``weights`` (a one-item list, emptied here so that an overlapped push's copy is
        freed once the engine holds it) into the engine, whose ``weights_version`` must then be ``numbered`` (when
        the room numbered the push it queued), then the probe against ``side`` (None: ``model``'s, computed now).
        An overlapped run's job on the engine's thread; it reads the policy only through ``side``."""
        t0 = time.perf_counter()
        self.engine.update_weights(weights.pop())
        if numbered is not None and self.engine.weights_version != numbered:
            raise RefitError(f"weight push: the engine reports weights_version {self.engine.weights_version} after "
                             f"the push numbered {numbered}; was it pushed behind the learner's back?")
        t1 = time.perf_counter()
        diff = self._probe(side if side is not None else self.learner_side(model))
        return Pushed(self.engine.weights_version, diff, gathered_s + t1 - t0, time.perf_counter() - t1)

    def after_update(self, model: torch.nn.Module, due: bool, last: bool, stats: dict[str, float],
                     timings: dict[str, float]) -> None:
        """A step's sync phase: the push when ``due`` (queued behind the generation in flight when overlapped),
        its probe diff into ``stats`` (``probe/max_abs_logprob_diff``), its times into ``timings``."""
        if self.ahead is not None:
            self._push_overlapped(model, due, last, stats, timings)
            return
        t = time.perf_counter()
        diff = self.push(model, last) if due else None
        if diff is not None:
            stats["probe/max_abs_logprob_diff"] = max(diff, stats.get("probe/max_abs_logprob_diff", 0.0))
        timings["time/weight_push"] = time.perf_counter() - t if due else 0.0

    def _collect(self, stats: dict[str, float], timings: dict[str, float]) -> None:
        """The pushes queued at earlier steps, waited for: their probe diffs and engine times on this row."""
        t = time.perf_counter()
        done = self.ahead.pushed()  # a failed probe is raised here: before this row and any later checkpoint
        self._queued = None  # done: the engine's version is the one it gave them
        timings["time/push_wait"] += time.perf_counter() - t
        for p in done:
            stats["probe/max_abs_logprob_diff"] = max(p.probe_diff, stats.get("probe/max_abs_logprob_diff", 0.0))
            timings["time/push_engine"] += p.push_s
            timings["time/probe_engine"] += p.probe_s

    def _push_overlapped(self, model: torch.nn.Module, due: bool, last: bool, stats: dict[str, float],
                         timings: dict[str, float]) -> None:
        """Collect the push queued at an earlier step (its probe diff on this row), then, when a push is ``due``,
        snapshot the weights and queue the push behind the generation in flight, the probe's learner half computed
        here (refit.learner.ppo.overlap: the protocol). The ``last`` step waits for its own push.

        Timings, the learner's share: ``time/weight_push`` the snapshot, ``time/probe_learner`` the probe's learner
        half, ``time/push_wait`` the wait for queued pushes; the engine thread's: ``time/push_engine``
        (update_weights) and ``time/probe_engine`` (the probe's engine half) of the pushes collected on this row."""
        timings.update({k: 0.0 for k in ("time/weight_push", "time/probe_learner", "time/push_wait",
                                         "time/push_engine", "time/probe_engine")})
        self._collect(stats, timings)
        if not due:
            return
        t = time.perf_counter()  # a copy: the next optimizer step changes the weights in place, the push runs later
        snapshot = [{n: p.detach().clone() for n, p in push_tensors(model, self.engine).items()}]
        timings["time/weight_push"] = time.perf_counter() - t
        t = time.perf_counter()
        side = self.learner_side(model)
        timings["time/probe_learner"] = time.perf_counter() - t
        # nothing is queued now (collected above): the engine's version is settled, and this push gets the next one
        self._queued = next_version(self.engine.weights_version, None)
        self.ahead.push(partial(self._push_job, snapshot, side, self._queued))
        del snapshot  # the engine thread holds the only reference: freed once pushed
        if last:  # nothing left to overlap it with
            self._collect(stats, timings)

    def finish(self, log=print) -> None:
        """A run that reached its last step: overlapped, the engine's queued jobs waited for, a failed push's or
        probe's one line raised (the last step of ``run.max_steps_this_run`` queues a push no step collects; closing
        would drop its error), and a push that passed its probe there logged in one line (no step's row carries it)."""
        if self.ahead is None:
            return
        self.ahead.wait()
        for p in self.ahead.pushed():
            log(f"last weight push (version {p.version}): probe max |engine - learner log-prob| {p.probe_diff:.3g}")
        self._queued = None


def make_probe(engine: Engine, prompt_ids: list[list[int]], rollout, response_length: int,
               stop_ids: tuple[int, ...]) -> RolloutBatch:
    """The fixed probe batch: the first ``rollout.probe_size`` prompts, greedy, :func:`probe_length` tokens."""
    rows = prompt_ids[:min(rollout.probe_size, len(prompt_ids))]
    return engine.generate(rows, SamplingParams(max_new_tokens=probe_length(rollout, response_length), greedy=True,
                                                stop_ids=stop_ids))


def probe_length(rollout, response_length: int) -> int:
    """Response tokens of the probe batch: ``rollout.probe_tokens`` (0: all), at most ``response_length``."""
    return min(response_length, rollout.probe_tokens) if rollout.probe_tokens > 0 else response_length


def push_checkpoint(engine: Engine, model: torch.nn.Module, version: int | None) -> None:
    """A resumed run: the checkpoint's weights into ``engine`` under the version the engine had then."""
    engine.update_weights(push_tensors(model, engine), version=version)


def engine_dtype(engine: Engine) -> str:
    """The dtype of ``engine``'s weights and activations: its manifest's (an engine folder's: ONNX Runtime,
    TensorRT, a pool or a counting wrapper over one), "fp32" for an engine over a PyTorch model (no manifest)."""
    return engine.manifest.dtype if engine.manifest is not None else "fp32"


def probe_reference(model: torch.nn.Module, dtype: str) -> tuple[torch.nn.Module, float]:
    """(the model the probe compares a ``dtype`` engine with, the least tolerance that comparison needs).

    fp32: ``model`` itself, no floor. fp16/bf16: a copy of ``model`` whose weights are rounded to ``dtype``
    and computed in fp32, so the probe sees the engine's own weights (a push that did not take still shows)
    and only the engine's activation rounding remains, which the export's gate bounds at
    ``PARITY_TOL[dtype]`` (engine vs PyTorch in ``dtype``). The fp32 weights themselves would add the
    weights' rounding to every log-prob, which grows with width and depth. Costs one fp32 copy of the model.
    """
    if dtype == "fp32":
        return model, 0.0
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in [*rounded.parameters(), *rounded.buffers()]:
            if p.is_floating_point():
                p.copy_(p.to(DTYPES[dtype]).float())
    return rounded, PARITY_TOL[dtype]


def check_parity(diff: float, tol: float, version: int, run_dir: Path, label: str = "engine",
                 where: str = "the probe batch") -> float:
    """``diff`` (max |engine - learner log-prob| after a push) if within ``tol``, else one RefitError line."""
    if not diff <= tol:
        raise RefitError(f"parity probe failed after weight push ({label} weights_version {version}, on {where}): "
                         f"max |logprob diff| {diff:.3e} > {tol:g}; the engine did not take the new weights. "
                         f"Last checkpoint: {latest_checkpoint(run_dir)}")
    return diff


def push_tensors(model: torch.nn.Module, engine: Engine | None = None) -> dict[str, torch.Tensor]:
    """What a push of ``model`` into ``engine`` carries: a LoRA policy's adapter when the engine takes one
    (a LoRA-ready ONNX Runtime engine, refit.learner.run.lora.adapter_tensors), its targeted layers merged
    (``W + s B A``) when the engine takes no adapter inputs (TensorRT: a refit of those layers); else every weight
    by canonical HF name."""
    if not is_lora(model):
        return canonical_params(model)[0]
    if engine is None or engine.adapter is not None:
        return adapter_tensors(model)
    if adapts_tied_head(model):  # merged, the head would be refit into the one weight it shares with the embeddings
        raise RefitError("lora: an adapter on an output head tied to the input embeddings cannot be merged into an "
                         "engine without adapter inputs (TensorRT refits one weight for both); leave lm_head out of "
                         "lora.target_modules or use rollout.backend onnxruntime")
    return merged_tensors(model)
