"""Generation overlapped with the update: ``rollout.max_staleness`` k >= 1 (0, the default, is the synchronous loop).

The protocol (one engine, one background thread that runs its jobs in the order they are queued)::

    step s   take batch s: generated in the background during step s-1 (step 1, and the first step of a resumed
             run without a saved batch: generated now, in the foreground)
             its age: learner version - batch.weights_version must be in [0, k] pushes, else one RefitError line
             queue batch s+1: the prompts and the seed of step s+1, exactly those the synchronous loop uses
             rewards, learner scores, PPO update on batch s      ||  the engine: the push of step s-1 (if any),
                                                                      its probe, then generates batch s+1
             collect the push of step s-1: its probe diff on this step's row; a failed probe: one RefitError line
             a push due: snapshot the weights (a copy: the next optimizer step changes them in place), the
             probe's learner half on them, then queue (snapshot, learner half) behind batch s+1; the learner's
             version is the pushed one from here on (the engine's becomes it when the push runs)

The background thread runs the generation of batch s+1, then the push (update_weights from the snapshot, which is
then freed), then the probe's engine half and the comparison, then batch s+2 (queued at step s+1's take): a push
never meets a generation, and each batch gets the version it got when the learner pushed in the foreground (batch
s+1 from the weights pushed at step s-1). The job is the sync room's (refit.learner.run.sync.WeightSync: the
update_weights call and the probe are its own; this thread only runs them in order). The room numbers a push when it
queues it, by the engine's rule (rollout.engine.next_version of the engine's version, settled once the earlier
pushes are collected; the job refuses the push in one line if the engine reports another), so the staleness
check of batch s+1 needs no wait. The push's probe is known during step s+1: its diff is logged on step s+1's row
(``probe/max_abs_logprob_diff``, ``time/push_engine``, ``time/probe_engine``), its failure raised on the learner
thread when it takes a batch, collects the push, waits (evaluation) or saves, before step s+1's row and any
checkpoint after the push. The last step waits for its own push (nothing to overlap it with) and logs both diffs'
max. A checkpoint waits for the queued push and keeps its probe result with the batch in flight, so a resumed run
logs it on the same row as the uninterrupted run.

Batch s+1 therefore comes from the weights pushed at step s-1: one push behind the learner that updates on it
(AReaL's max_head_offpolicyness, NeMo-RL's max_trajectory_age_steps, both 1 here). With one batch in flight the
lag is at most one push; k > 1 only widens what is accepted. A batch older than k is refused, not regenerated:
with this protocol it can only come from an engine that was pushed behind the learner's back, which regenerating
would hide.

The correction: the engine's ``rollout_logprobs`` are the behaviour policy, the learner's old log-probs (its
weights now, before the update) the proximal policy; the PPO ratio is clipped against the proximal policy and each
token weighted by min(pi_proximal / pi_behaviour, tis_cap) (``mismatch_correction`` 'auto' is tis with k >= 1:
AReaL's decoupled PPO, truncated). The mismatch diagnostics name the disagreement "version_lag".

Pushes are checked on the fixed probe batch: the next rollout's log-probs come from older weights than the
learner's, so they cannot check the push (``probe_on_rollout`` applies to k = 0 only).

Every step is deterministic as in the synchronous loop: a row's tokens are a function of (seed, prompt, sample,
weights version) (refit.rollout.row_streams.RowStreams; the engines draw from no global generator, but the 'hf'
baseline seeds torch's, which the learner does not use: eval-mode models, a generator of its own per step). A
checkpoint holds the batch in flight and the queued push's probe result (``pending_rollout.pt``, written after
waiting for both): the weights the batch was generated with are not in the checkpoint, so a resumed run reads it
back rather than regenerating it, and logs what the uninterrupted run logs.

Threads: ONNX Runtime releases the GIL in ``run()`` and torch in its kernels. The engine gets
``rollout.engine_threads`` intra-op threads (0: half of torch's, at least one), the learner's torch keeps the rest
(at least one). torch's intra-op setting is process-wide (refit.rollout.sampling.one_thread), so the background
thread never changes it: its decode loop samples with the learner's count (the sampler's arrays are mostly too
small for torch to split; before, its per-step switch to one thread and back also switched the learner's). The
decode loop's Python shares the GIL with the learner's; with ``scale.workers`` >= 2 (a RayEnginePool) the
background thread only waits on the actors, whose processes generate.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from refit.core.errors import RefitError
from refit.learner.run.sync import Pushed
from refit.rollout.types import RolloutBatch, SamplingParams

PENDING_FILE = "pending_rollout.pt"  # the checkpoint's batch in flight and queued pushes, done:
# {"step": s, "batch": RolloutBatch, "pushed": [tuple(Pushed)]} ("pushed" absent in checkpoints before it)


def split_threads(engine_threads: int, total: int, shards: int = 1) -> tuple[int, int]:
    """(engine threads, learner torch threads) for an overlapped run on ``total`` threads: ``engine_threads`` (0:
    half of ``total``), at least 1 and at least ``shards`` (``rollout.engine_shards`` decode loops run at once,
    one thread each: the engine shares its threads out among them), and the rest for the learner (at least 1)."""
    engine = max(engine_threads or total // 2, shards, 1)
    return engine, max(1, total - engine)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """This thread's torch intra-op threads set to ``n`` inside the block (None: unchanged), restored after: a
    step's learner share, so runs set up side by side in one process (refit bench ppo) keep their own."""
    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def check_staleness(batch: RolloutBatch, learner_version: int, max_staleness: int) -> int:
    """The batch's lag in weight pushes behind ``learner_version``; one RefitError line unless in [0, max_staleness]."""
    lag = learner_version - batch.weights_version
    if not 0 <= lag <= max_staleness:
        raise RefitError(f"stale rollout: batch has weights_version {batch.weights_version}, the learner's is "
                         f"{learner_version}: {lag} pushes behind, rollout.max_staleness allows 0 to {max_staleness}")
    return lag


def _timed_generate(engine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[RolloutBatch, float]:
    t0 = time.perf_counter()
    batch = engine.generate(prompts, sampling)
    return batch, time.perf_counter() - t0


def _done(result) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut


class RolloutAhead:
    """The engine's jobs on one background thread, in the order queued: a rollout generated ahead and the weight
    pushes (the protocol above); ``wait`` waits for them (and raises a failed one), ``close`` closes the thread."""

    def __init__(self, engine):
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-rollout")
        self._pending: tuple[int, Future] | None = None  # (the step it is for, its (batch, seconds))
        self._pushes: list[Future] = []  # queued pushes not yet collected, oldest first: each a Pushed

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> tuple[RolloutBatch, float]:
        """Generate now, in the foreground (nothing may be in flight); (batch, seconds)."""
        self.wait()
        return _timed_generate(self.engine, prompts, sampling)

    def submit(self, step: int, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if self._pending is not None:
            raise RefitError(f"rollout for step {self._pending[0]} is still in flight; cannot start step {step}'s")
        self._pending = (step, self._pool.submit(_timed_generate, self.engine, prompts, sampling))

    def push(self, job: Callable[[], Pushed]) -> None:
        """Queue ``job``, the sync room's push and probe (refit.learner.run.sync.WeightSync: it holds the learner's
        copy of the weights, its update_weights call and the probe's engine half), behind the generation in flight."""
        self._pushes.append(self._pool.submit(job))

    def pushed(self) -> list[Pushed]:
        """The queued pushes, waited for (not the generation queued after them) and forgotten; a failed push's or
        probe's error is raised here."""
        done, self._pushes = self._pushes, []
        return [f.result() for f in done]

    def _raise_failed_push(self) -> None:
        for f in self._pushes:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def take(self, step: int) -> tuple[RolloutBatch, float] | None:
        """The batch generated ahead for ``step`` and its generation seconds (0.0: read from a checkpoint), or None
        when none was (one for another step is dropped). A generation's error, or a push's already known, is
        raised here."""
        self._raise_failed_push()
        if self._pending is None:
            return None
        s, fut = self._pending
        self._pending = None
        out = fut.result()
        self._raise_failed_push()
        return out if s == step else None

    def wait(self) -> float:
        """Wait until nothing is in flight (the engine is idle: evaluate, save); seconds waited. A failed push's
        error is raised here (the push stays queued: :meth:`pushed` raises it again)."""
        t0 = time.perf_counter()
        if self._pending is not None:
            try:
                self._pending[1].result()
            except BaseException:
                self._pending = None  # raised here once; the step that takes it would raise it again
                raise
        for f in self._pushes:
            f.result()
        return time.perf_counter() - t0

    def held(self) -> tuple[int, RolloutBatch, list[Pushed]] | None:
        """(step, batch, queued pushes) of the batch generated ahead, after waiting for everything; None when
        there is no batch."""
        self.wait()
        if self._pending is None:
            return None
        return self._pending[0], self._pending[1].result()[0], [f.result() for f in self._pushes]

    def restore(self, step: int, batch: RolloutBatch, pushed: list[Pushed] = ()) -> None:
        """A checkpoint's batch in flight, taken at ``step`` as if generated ahead, and its queued pushes, done."""
        self._pending = (step, _done((batch, 0.0)))
        self._pushes = [_done(Pushed(*p)) for p in pushed]

    def close(self) -> None:
        """Close the thread, raising nothing: a normal end has waited first (:meth:`wait`, refit.learner.ppo.cycle's
        ``finish``, which raises a failed push's error); an end unwinding on another error keeps that error."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the run is ending (perhaps on this very error); close the thread
            pass
        self._pending, self._pushes = None, []
        self._pool.shutdown(wait=True)
