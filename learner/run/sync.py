"""Weight sync: the learner's weights into the engine that generates, and the check that the engine took them.

The contract between the engine and the learner (the temperature both score at, the tolerance a push may leave,
an int8 engine's manifest) is one frozen record, :class:`Contract`; the push-and-check cycle is one object,
:class:`WeightSync`, that both jobs hold (PPO, distillation):

    push          the policy's weights (a LoRA policy: its adapter only, :func:`push_tensors`) into the engine;
                  the engine's ``weights_version`` becomes the one every later rollout must come from
    check         at once: a fixed probe batch, generated once at setup, scored by the engine and by the learner's
                  PyTorch model with the same padding, positions and temperature (:func:`probe_check`);
                  or on the next rollout (``Contract.check_on_rollout``, PPO's ``probe_on_rollout``): its
                  engine log-probs against the learner's, before any update uses it
    overlapped    PPO with ``rollout.max_staleness`` >= 1: the push queued on the engine's background thread behind
                  the generation in flight, the probe's learner half computed first (refit.learner.ppo.overlap)
    finish        the queued pushes waited for and their errors raised before the run closes

A disagreement stops the run in one line naming the last checkpoint: an engine that did not take the new weights
would otherwise sample from a stale policy silently.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refit.core.contract import DTYPES, PARITY_TOL, canonical_params
from refit.core.errors import RefitError
from refit.core.int8 import reference_model, rounding_floor
from refit.core.manifest import MANIFEST, Manifest
from refit.learner.run.checkpoint import latest_checkpoint
from refit.learner.run.lora import (adapter_tensors, adapts_tied_head, fp32_compute, holds_low_precision, is_lora,
                                    merged_tensors)
from refit.learner.run.policy import learner_view
from refit.rollout.engine import Engine, check_version
from refit.rollout.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:  # the overlapped push's thread (PPO only); typing, not a dependency
    from refit.learner.ppo.overlap import RolloutAhead


@dataclass(frozen=True)
class Contract:
    """What the engine and the learner agree on, and how a push is checked: one record per run."""

    temperature: float  # both sides' log-probs at it: the sampling temperature (distillation: 1.0, the models' own)
    probe_tol: float  # rollout.probe_tol: the largest max |engine - learner log-prob| a push may leave
    int8_manifest: Manifest | None = None  # an int8 engine's manifest: the learner side quantized as the engine is
    check_on_rollout: bool = False  # a push (but the last) checked by the next rollout, not the probe batch
    label: str = "engine"  # what a failed check's line calls the engine


class WeightSync:
    """One engine's pushes and their checks under ``contract`` (the module's docstring: the cycle)."""

    def __init__(self, engine: Engine, probe: RolloutBatch, contract: Contract, run_dir: Path,
                 ahead: RolloutAhead | None = None, unchecked: bool = False):
        self.engine, self.probe, self.contract, self.run_dir, self.ahead = engine, probe, contract, run_dir, ahead
        self.version = engine.weights_version  # the engine weights_version a rollout must come from (the learner's)
        self.unchecked = unchecked  # a push whose check is the next rollout's (Contract.check_on_rollout)
        self.told: set[str] = set()  # engine/learner mismatch causes named once per run (int8 precision, version lag)

    # ------------------------------------------------------------------ checks

    def check_version(self, rollout: RolloutBatch) -> None:
        """One line when ``rollout`` came from other weights than the last push's."""
        check_version(rollout, self.version)

    def check_now(self, model: torch.nn.Module) -> float:
        """The probe batch scored on both sides; the max |log-prob diff|, or one line above the tolerance."""
        c = self.contract
        return probe_check(self.engine, model, self.probe, c.temperature, c.probe_tol, self.run_dir, c.label,
                           c.int8_manifest)

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

    # ------------------------------------------------------------------ pushes

    def push(self, model: torch.nn.Module, last: bool = False) -> float | None:
        """Push ``model`` into the engine and check it: on the next rollout (``Contract.check_on_rollout``, not
        the ``last`` push: no rollout follows it; None), else on the probe batch now (its diff)."""
        if self.contract.check_on_rollout and not last:
            self.engine.update_weights(push_tensors(model, self.engine))
            self.version, self.unchecked = self.engine.weights_version, True
            return None
        c = self.contract
        self.version, diff = push_weights(self.engine, model, self.probe, c.temperature, c.probe_tol, self.run_dir,
                                          c.label, c.int8_manifest)
        return diff

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

        def collect() -> None:
            t = time.perf_counter()
            done = self.ahead.pushed()  # a failed probe is raised here: before this row and any later checkpoint
            timings["time/push_wait"] += time.perf_counter() - t
            for p in done:
                stats["probe/max_abs_logprob_diff"] = max(p.probe_diff, stats.get("probe/max_abs_logprob_diff", 0.0))
                timings["time/push_engine"] += p.push_s
                timings["time/probe_engine"] += p.probe_s

        collect()
        if not due:
            return
        c = self.contract
        t = time.perf_counter()  # a copy: the next optimizer step changes the weights in place, the push runs later
        snapshot = {n: p.detach().clone() for n, p in push_tensors(model, self.engine).items()}
        timings["time/weight_push"] = time.perf_counter() - t
        t = time.perf_counter()
        learner_side = probe_learner_side(self.engine, model, self.probe, c.temperature, c.int8_manifest)
        timings["time/probe_learner"] = time.perf_counter() - t
        # learner_side[2]: the model compared (the policy, or a copy of it quantized or rounded as the engine is); the
        # engine thread reads the policy only through it, and only for an int8 engine's rounding floor (a copy)
        check = partial(probe_check, self.engine, learner_side[2], self.probe, c.temperature, c.probe_tol,
                        self.run_dir, c.label, c.int8_manifest, learner_side)
        self.version += 1  # the Engine protocol: a push without a version is the engine's + 1
        self.ahead.push(snapshot, self.version, check)
        del snapshot  # the engine thread holds the only reference: freed once pushed
        if last:  # nothing left to overlap it with
            collect()

    def finish(self, log=print) -> None:
        """A run that reached its last step: overlapped, the engine's queued jobs waited for, a failed push's or
        probe's one line raised (the last step of ``run.max_steps_this_run`` queues a push no step collects; closing
        would drop its error), and a push that passed its probe there logged in one line (no step's row carries it)."""
        if self.ahead is None:
            return
        self.ahead.wait()
        for p in self.ahead.pushed():
            log(f"last weight push (version {p.version}): probe max |engine - learner log-prob| {p.probe_diff:.3g}")


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


def engine_dtype(engine) -> str:
    """The dtype of ``engine``'s weights and activations: its manifest's (ONNX Runtime, TensorRT, a pool or a
    counting wrapper over one), "fp32" for the PyTorch backends."""
    m = getattr(engine, "manifest", None)
    if m is None and getattr(engine, "path", None) is not None and (Path(engine.path) / MANIFEST).exists():
        m = Manifest.read(engine.path)
    return getattr(m, "dtype", None) or "fp32"


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


def probe_learner_side(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float,
                       int8_manifest=None) -> tuple[torch.Tensor, float, torch.nn.Module]:
    """The learner's half of :func:`probe_check`: (its log-probs on ``probe``, the tolerance floor, the model
    compared). It needs only the weights about to be pushed, so an overlapped PPO run computes it while the engine
    still generates (refit.learner.ppo.overlap), before the push."""
    low_base = holds_low_precision(model)
    if int8_manifest is not None:
        model = int8_reference(model, int8_manifest)
    ref, floor = probe_reference(model, engine_dtype(engine))
    # a bf16 LoRA base (lora.base_dtype): its weights in fp32 arithmetic, as the engine runs the same rounded base
    with fp32_compute(ref) if low_base else nullcontext():
        return learner_view(ref, None, probe, temperature)[0], floor, model


def probe_check(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float, tol: float,
                run_dir: Path, label: str = "engine", int8_manifest=None, learner_side=None) -> float:
    """Score ``probe`` on ``engine`` and on ``model``; the max |log-prob diff|, or one line when above ``tol``
    (for an fp16/bf16 engine: against ``model``'s weights in that dtype, ``tol`` at least the dtype's gate
    tolerance, :func:`probe_reference`).

    ``int8_manifest``: the engine is int8 (export/quantize.py): the learner side is ``model`` quantized as the engine
    quantizes it (``reference_model``); above ``tol``, the int8 rounding floor on this batch is measured and the
    engine must be within twice it (export/quantize.py, Exactness).

    ``learner_side``: :func:`probe_learner_side`'s result, computed already (for the weights pushed)."""
    p = probe
    eng = engine.score(p.prompt_ids, p.prompt_mask, p.response_ids, p.response_mask, temperature=temperature).logprobs
    mine, floor, model = learner_side or probe_learner_side(engine, model, p, temperature, int8_manifest)
    dist = lambda other: float(((eng - other).abs() * p.response_mask).max())  # noqa: E731
    diff = dist(mine)
    tol = max(tol, floor)
    if int8_manifest is not None and diff > tol:
        with fp32_compute(model) if holds_low_precision(model) else nullcontext():
            floor = rounding_floor(model, lambda m: learner_view(m, None, p, temperature)[0],
                                   lambda j: float(((j - mine).abs() * p.response_mask).max()))
        tol = max(tol, 2 * floor)
    return check_parity(diff, tol, engine.weights_version, run_dir, label, "the probe batch")


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
    if engine is None or getattr(engine, "adapter", None) is not None:
        return adapter_tensors(model)
    if adapts_tied_head(model):  # merged, the head would be refit into the one weight it shares with the embeddings
        raise RefitError("lora: an adapter on an output head tied to the input embeddings cannot be merged into an "
                         "engine without adapter inputs (TensorRT refits one weight for both); leave lm_head out of "
                         "lora.target_modules or use rollout.backend onnxruntime")
    return merged_tensors(model)


def int8_reference(model: torch.nn.Module, manifest: Manifest) -> torch.nn.Module:
    """``model`` as an int8 engine computes it (core/int8.py ``reference_model``). For a LoRA policy the
    reference is made once and kept on the model: it shares every parameter of the policy (the adapter as it
    trains, the frozen base) and quantizes the base's linear layers at each forward (``Int8Linear(lazy=True)``),
    so it follows each step without being made again and costs no copy of the base, fp32 or int8."""
    if not is_lora(model):
        return reference_model(model, manifest)
    peft_model = getattr(model, "module", model)
    ref = getattr(peft_model, "_refit_int8_reference", None)
    if ref is None:
        ref = reference_model(peft_model.get_base_model(), manifest, share_parameters=True)
        object.__setattr__(peft_model, "_refit_int8_reference", ref)
    return ref


def push_weights(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float, tol: float,
                 run_dir: Path, label: str = "engine", int8_manifest=None, learner_side=None) -> tuple[int, float]:
    """Push ``model``'s weights into ``engine``, then :func:`probe_check`; (the new weights_version, probe diff).
    ``learner_side``: the probe's learner half for these weights, computed already (:func:`probe_learner_side`)."""
    engine.update_weights(push_tensors(model, engine))
    return engine.weights_version, probe_check(engine, model, probe, temperature, tol, run_dir, label, int8_manifest,
                                               learner_side)
