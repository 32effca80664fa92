"""Generation overlapped with the update: ``rollout.max_staleness`` k >= 1 (0, the default, is the synchronous loop).

The protocol (one engine, one rollout in flight, on one background thread)::

    step s   take batch s: generated in the background during step s-1 (step 1, and the first step of a resumed
             run without a saved batch: generated now, in the foreground)
             its age: learner version - batch.weights_version must be in [0, k] pushes, else one RefitError line
             submit batch s+1: the prompts and the seed of step s+1, exactly those the synchronous loop uses
             rewards, learner scores, PPO update on batch s      ||  the engine generates batch s+1
             a push due: the probe's learner half (the new weights' log-probs on the probe batch), then wait
             for batch s+1, then push + the probe's engine half   (a push never meets a generation)

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
weights version) (refit.rollout.sampling.RowStreams; the engines draw from no global generator, but the 'hf'
baseline seeds torch's, which the learner does not use: eval-mode models, a generator of its own per step). A
checkpoint holds the batch in flight (``pending_rollout.pt``, written after waiting for it): the weights it was
generated with are not in the checkpoint, so a resumed run reads it back rather than regenerating it, and logs
what the uninterrupted run logs.

Threads: ONNX Runtime releases the GIL in ``run()`` and torch in its kernels. The engine gets
``rollout.engine_threads`` intra-op threads (0: half of torch's, at least one), the learner's torch keeps the rest
(at least one); the background thread runs the decode loop's host work (sampling) on one torch thread (torch's
intra-op setting is per thread). The decode loop's Python shares the GIL with the learner's; with ``scale.workers``
>= 2 (a RayEnginePool) the background thread only waits on the actors, whose processes generate.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from refit.core.errors import RefitError
from refit.rollout.types import RolloutBatch, SamplingParams

PENDING_FILE = "pending_rollout.pt"  # the checkpoint's batch in flight: {"step": s, "batch": RolloutBatch}


def split_threads(engine_threads: int, total: int) -> tuple[int, int]:
    """(engine intra-op threads, learner torch threads) for an overlapped run on ``total`` threads:
    ``engine_threads`` (0: half of ``total``, at least 1) and the rest for the learner (at least 1)."""
    engine = engine_threads or max(1, total // 2)
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


class RolloutAhead:
    """One rollout generated ahead on a background thread (the protocol above); ``close`` waits for it."""

    def __init__(self, engine):
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-rollout",
                                        initializer=torch.set_num_threads, initargs=(1,))
        self._pending: tuple[int, Future] | None = None  # (the step it is for, its (batch, seconds))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> tuple[RolloutBatch, float]:
        """Generate now, in the foreground (nothing may be in flight); (batch, seconds)."""
        self.wait()
        return _timed_generate(self.engine, prompts, sampling)

    def submit(self, step: int, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if self._pending is not None:
            raise RefitError(f"rollout for step {self._pending[0]} is still in flight; cannot start step {step}'s")
        self._pending = (step, self._pool.submit(_timed_generate, self.engine, prompts, sampling))

    def take(self, step: int) -> tuple[RolloutBatch, float] | None:
        """The batch generated ahead for ``step`` and its generation seconds (0.0: read from a checkpoint), or None
        when none was (one for another step is dropped). A generation's error is raised here."""
        if self._pending is None:
            return None
        s, fut = self._pending
        self._pending = None
        out = fut.result()
        return out if s == step else None

    def wait(self) -> float:
        """Wait until no generation is in flight (the engine is idle: push, evaluate, save); seconds waited."""
        t0 = time.perf_counter()
        if self._pending is not None:
            try:
                self._pending[1].result()
            except BaseException:
                self._pending = None  # raised here once; the step that takes it would raise it again
                raise
        return time.perf_counter() - t0

    def held(self) -> tuple[int, RolloutBatch] | None:
        """(step, batch) of the batch generated ahead, after waiting for it; None when there is none."""
        self.wait()
        return None if self._pending is None else (self._pending[0], self._pending[1].result()[0])

    def restore(self, step: int, batch: RolloutBatch) -> None:
        """A checkpoint's batch in flight, taken at ``step`` as if generated ahead."""
        fut: Future = Future()
        fut.set_result((batch, 0.0))
        self._pending = (step, fut)

    def close(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the run is ending (perhaps on this very error); close the thread
            pass
        self._pending = None
        self._pool.shutdown(wait=True)
