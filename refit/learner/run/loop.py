"""The run scaffold both jobs share: run folder, resolved config, metrics, progress bar, step range,
checkpoints, and closing everything whatever happens.

A job (PPO, distillation) is a :class:`Job`: a ``setup`` that builds its state, a ``step`` that
returns one step's metrics, and a ``save`` that writes a checkpoint. :func:`run_job` drives it:

    0. the config's ranges (refit.core.validate), whether the batch can fit in memory (an estimate before the
       prompts are read: refit.learner.run.engines.check_batch_memory), the run folder's lock and owner and every
       engine folder's lock and integrity (refit.learner.run.folder: refused in one line before any work;
       --overwrite, --resume); a fresh run's record (run.json) written at once
    1. run folder, resolved config printed and saved (rank 0)
    2. setup (engines, models, optimizer; resume from the last checkpoint)
    3. optional step-0 metrics (``Job.initial``, not on resume)
    4. for each step in [start + 1, last]: step -> metrics.jsonl / TensorBoard -> checkpoint when due;
       after the last, ``Job.finish``: work still in flight collected, its error raised (a normal end only)
    5. close the progress bar, the metrics, the engines (in the job's order) and the process group;
       the job's final output (``Job.final``: OUTPUT_DIR/final, rank 0), plots (rank 0)

A Python caller may watch the steps through :class:`StepHooks` (the TRL facade's callbacks): called before
and after each step, it may add values to the step's metrics row, ask for a checkpoint, or end the run early
(which then ends as after its last step: ``finish``, closing, ``final``).

Under ``torchrun`` only rank 0 writes; the other ranks run ``step`` (their slice of the update).
"""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from refit.core.errors import RefitError
from refit.learner.run.checkpoint import latest_checkpoint
from refit.core.integrity import fault_point
from refit.core.noise import verbose
from refit.core.validate import validate
from refit.learner.run.config import save_config
from refit.learner.run.folder import claim, guard_engines, write_record
from refit.learner.run.distributed import DistContext, init_from_env
from refit.learner.run.engines import check_batch_memory
from refit.learner.run.metrics import MetricsLog, plot_metrics


@dataclass
class Job:
    """What makes a training job; every callable gets the job's state (what ``setup`` returned)."""

    name: str  # "ppo" | "distill": log prefix and progress-bar label
    setup: Callable[[Any, bool, Callable, DistContext], Any]  # (cfg, resume, log, dist) -> state
    step: Callable[[Any, int], dict]  # (state, step) -> metrics ({} on ranks > 0)
    save: Callable[[Any, int], Any]  # (state, step): write the checkpoint of ``step``
    engines: Callable[[Any], list]  # (state) -> engines to close, in order (None entries skipped)
    postfix: Callable[[dict], dict]  # metrics -> progress-bar postfix
    plot_panels: dict[str, list[str]] = field(default_factory=dict)
    initial: Callable[[Any], dict] | None = None  # (state) -> step-0 metrics of a fresh run ({}: no row)
    final: Callable[[Any], Any] | None = None  # (state): after a run that ended without error (rank 0)
    # (state): after the last step of a run that got there without error, before closing: what is still in flight
    # (an overlapped PPO run's queued push and probe) collected, its error raised; an end already unwinding on
    # another error skips it, and closing does not raise over that error
    finish: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class StepControl:
    """What a step hook asks of the loop after a step."""

    save: bool = False  # write this step's checkpoint even when ckpt.save_steps does not make it due
    stop: bool = False  # end the run after this step, as after the last one
    metrics: dict = field(default_factory=dict)  # values added to this step's metrics row (metrics.jsonl, TB)


@dataclass(frozen=True)
class StepHooks:
    """Called on rank 0 around each step of :func:`run_job` (one process only; the CLI passes none)."""

    before: Callable[[int], None]  # (step) before the step runs
    after: Callable[[int, dict], StepControl]  # (step, metrics) after it ran, before it is logged and saved
    saved: Callable[[int], None]  # (step) after its checkpoint was written


def last_step(cfg, start_step: int) -> int:
    """The last step this process runs: ``steps``, or ``max_steps_this_run`` past the start (tests)."""
    r = cfg.run
    return r.steps if not r.max_steps_this_run else min(r.steps, start_step + r.max_steps_this_run)


def due(step: int, every: int, total: int) -> bool:
    """Every ``every`` steps and at the last step."""
    return step % every == 0 or step == total


def check_finite(values: dict[str, float], what: str, run_dir: Path) -> None:
    """One line, naming the last checkpoint, when any of ``values`` is NaN or infinite; nothing is saved."""
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        last = latest_checkpoint(run_dir)
        way = (f"last checkpoint: {last} (--resume continues from it)" if last else
               "there is no checkpoint yet: start again with --overwrite")
        raise RefitError(f"non-finite {what} ({', '.join(f'{k}={values[k]}' for k in bad)}); nothing from this "
                         f"step was saved, {way}")


def _progress(cfg, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=cfg.run.steps, initial=initial, desc=desc, dynamic_ncols=True)


def kept_note(run_dir: Path) -> str:
    """What a run that stopped early (a signal, a full disk) leaves, and how to go on from it."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return f"{run_dir} has no checkpoint yet: start the run again (with --overwrite)"
    return f"{run_dir} keeps checkpoint {last.name}: continue with the same command and --resume"


def run_job(job: Job, cfg, resume: bool = False, log=print, overwrite: bool = False,
            hooks: StepHooks | None = None) -> tuple[Path, Any]:
    """Run ``job`` with ``cfg``; return (the run folder, the job's state after closing).

    ``overwrite``: a fresh run may replace an earlier run in the same folder, and another model's engine
    folder it names (refit.learner.run.folder); otherwise both are refused in one line. ``hooks``: see
    :class:`StepHooks`. A full disk is one line naming the run folder and its last intact checkpoint; a stop by
    a signal (Ctrl-C, SIGTERM) carries the same note (``kept``) to the command line."""
    try:
        return _run_job(job, cfg, resume, log, overwrite, hooks)
    except KeyboardInterrupt as e:
        e.kept = kept_note(Path(cfg.run.output_dir))
        raise
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise RefitError(f"disk full while writing {e.filename or 'a file'}: free space; "
                         f"{kept_note(Path(cfg.run.output_dir))}") from e


def _run_job(job: Job, cfg, resume: bool, log, overwrite: bool, hooks: StepHooks | None) -> tuple[Path, Any]:
    validate(cfg)
    check_batch_memory(cfg)  # a batch that cannot fit: refused before any work, with the estimate
    run_dir = Path(cfg.run.output_dir)
    dist = init_from_env(cfg.run.device)  # [dist] torchrun's RANK/WORLD_SIZE; one process: nothing changes
    if hooks is not None and dist.enabled:  # a stop asked on rank 0 alone would leave the other ranks waiting
        raise RefitError("step hooks (TRL callbacks) run in one process; under torchrun use refit ppo / distill")
    main = dist.is_main  # [dist] rank 0 alone writes config, metrics, checkpoints and plots
    record = None
    if main:
        record = claim(run_dir, cfg, resume, overwrite, log)  # locked for this process; refusals before any write
        guard_engines(cfg, overwrite, log)
        if not resume:
            write_record(run_dir, record)  # a run that fails in setup leaves a folder known as a run (--overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        text = save_config(cfg, run_dir / "config.yaml").rstrip()  # the resolved config: on screen with --verbose
        log(f"refit {job.name}: resolved config\n{text}" if verbose() else
            f"refit {job.name}: resolved config in {run_dir / 'config.yaml'} (--verbose prints it)")
    state = job.setup(cfg, resume, log, dist)
    if main:
        write_record(run_dir, record)  # the folder is this run's from here on
    metrics = (MetricsLog(run_dir, cfg.log.tensorboard, resume_step=state.start_step if resume else None, log=log)
               if main else None)
    first = job.initial(state) if main and not resume and job.initial is not None else {}
    if first:
        metrics.log(0, first)
    bar = _progress(cfg, state.start_step, job.name) if cfg.log.progress and main else None
    try:
        for step in range(state.start_step + 1, last_step(cfg, state.start_step) + 1):
            if hooks is not None:
                hooks.before(step)
            m = job.step(state, step)
            if not main:  # [dist]
                continue
            ctl = hooks.after(step, m) if hooks is not None else StepControl()
            metrics.log(step, {**m, **ctl.metrics})
            if due(step, cfg.ckpt.save_steps, cfg.run.steps) or ctl.save:
                job.save(state, step)
                if hooks is not None:
                    hooks.saved(step)
            fault_point("step.end")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(**job.postfix(m))
            if ctl.stop:
                break
        if job.finish is not None:
            job.finish(state)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        for engine in job.engines(state):
            if engine is not None:
                engine.close()
        dist.close()  # [dist] waits for every rank, leaves the process group
    if main and job.final is not None:
        job.final(state)  # the trained model out (refit.learner.run.final), after the engines are closed
    if main and cfg.log.plots:
        plot_metrics(run_dir, job.plot_panels)
    return run_dir, state
