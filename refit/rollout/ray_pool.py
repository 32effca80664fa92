"""RayEnginePool: the Engine protocol over N Ray actors, each holding one engine of any backend.

    generate(prompts)  -> prompts cut into fixed chunks of ``chunk`` prompts; chunk k is sampled with
                          seed ``chunk_seed(seed, k)``; chunks go to workers round-robin; the chunk
                          batches are merged back in prompt order (padding rule re-applied)
    score(rows)        -> contiguous row shards, one per worker, concatenated
    update_weights()   -> the named tensors go into Ray's object store ONCE (``ray.put``); every
                          worker loads from that one ref and reports the version it now holds

Why chunks and not one shard per worker: the decode loop draws one (B, V) sample per step for
the whole batch from one generator, so a row's random stream depends on the batch it sits in.
A chunk's rows, padding and seed do not depend on the number of workers, so 1 worker and N
workers produce the same tokens and log-probs. A batch that fits in one chunk (chunk 0 keeps the
caller's seed) samples exactly like a single engine given the same seed.

Versions: the pool numbers its pushes 1, 2, ... like a single engine; each worker stamps its
batches with the pool version it holds, and the pool refuses (RefitError) a batch or a push
reply whose version is not the expected one, so a stale worker can never feed the learner.

Fault tolerance: a worker whose actor dies (``ray.exceptions.RayActorError``) is replaced by a
new actor on a fresh engine, which first loads the last pushed weights from the object store
(so its weights and version match the others), and its shard is retried once. A second failure
raises RefitError naming the last checkpoint when the caller told the pool how to find it.

Ray is imported only when a pool is made (``pip install 'refit[dist]'``).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from refit.core.errors import RefitError
from refit.core.manifest import MANIFEST, Manifest
from refit.rollout import engine as _engine
from refit.rollout.engine import (DEFAULT_SCORE_CHUNK, Engine, check_prompts, create_engine, next_version,
                                  register_backend)
from refit.rollout.types import RolloutBatch, SamplingParams, ScoreResult

DEFAULT_CHUNK = 8  # prompts per generate() chunk: the unit of sharding and of seeding


# ----------------------------------------------------------------------------- pure helpers


def chunk_seed(seed: int | None, k: int) -> int | None:
    """Seed of chunk ``k``: ``seed`` itself for chunk 0, a hash of ``(seed, k)`` after; None stays None."""
    if seed is None or k == 0:
        return seed
    digest = hashlib.blake2b(f"refit-chunk:{int(seed)}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int64


def plan_chunks(n_prompts: int, chunk: int, workers: int) -> list[list[int]]:
    """Chunk indices per worker, round-robin: worker w gets chunks w, w + workers, ..."""
    n_chunks = math.ceil(n_prompts / chunk)
    return [list(range(w, n_chunks, workers)) for w in range(workers)]


def _pad_cols(t: torch.Tensor | None, width: int, value, left: bool) -> torch.Tensor | None:
    """Pad dim 1 of ``t`` (B, T, ...) to ``width`` with ``value`` on the left or the right."""
    if t is None or t.shape[1] == width:
        return t
    fill = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([fill, t] if left else [t, fill], 1)


def merge_batches(batches: list[RolloutBatch], prompt_offsets: list[int], sampling: SamplingParams) -> RolloutBatch:
    """Concatenate chunk batches in order, re-padding to the widest chunk by the padding rule.

    Prompts: left-padded (decoder-only) or right-padded (seq2seq encoder input); responses and
    their per-token fields: right-padded with pad_id / 0.0. ``prompt_index`` gets each chunk's
    prompt offset added. All batches must carry one weights_version.
    """
    first = batches[0]
    versions = {b.weights_version for b in batches}
    if len(versions) != 1:
        raise RefitError(f"merge_batches: chunks were generated with different weights versions {sorted(versions)}")
    tp = max(b.prompt_ids.shape[1] for b in batches)
    tr = max(b.response_ids.shape[1] for b in batches)
    left = not first.is_seq2seq
    cols: dict[str, list[torch.Tensor]] = {}
    for b, off in zip(batches, prompt_offsets):
        parts = {"prompt_ids": _pad_cols(b.prompt_ids, tp, b.pad_id, left),
                 "prompt_mask": _pad_cols(b.prompt_mask, tp, 0, left),
                 "response_ids": _pad_cols(b.response_ids, tr, b.pad_id, False),
                 "response_mask": _pad_cols(b.response_mask, tr, 0.0, False),
                 "rollout_logprobs": _pad_cols(b.rollout_logprobs, tr, 0.0, False),
                 "rollout_plain_logprobs": _pad_cols(b.rollout_plain_logprobs, tr, 0.0, False),
                 "prompt_index": b.prompt_index + off}
        if sampling.return_topk:
            parts["topk_logprobs"] = _pad_cols(b.topk_logprobs, tr, 0.0, False)
            parts["topk_ids"] = _pad_cols(b.topk_ids, tr, b.pad_id, False)
        for name, t in parts.items():
            cols.setdefault(name, []).append(t)
    merged = {name: torch.cat(ts, 0) for name, ts in cols.items()}
    return replace(first, sampling=sampling, **merged).check()


def split_rows(n_rows: int, parts: int) -> list[slice]:
    """Contiguous row slices, sizes differing by at most one; empty slices dropped."""
    base, extra = divmod(n_rows, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        if size:
            out.append(slice(start, start + size))
        start += size
    return out


# ----------------------------------------------------------------------------- the actor


class EngineWorker:
    """One engine inside one Ray actor. ``version`` is the pool's push count it holds."""

    def __init__(self, backend: str, target: str | None, path: str, engine_kw: dict, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        if target is not None:  # backends registered at run time in the driver (e.g. "hf")
            register_backend(backend, target)
        self.engine = create_engine(backend, path, **engine_kw)
        self.version = 0

    def ready(self) -> tuple[int | None, int | None]:
        """(max_len, vocab_size) of the engine's model, for checking prompts before sharding."""
        spec = getattr(self.engine, "spec", None)
        return getattr(spec, "max_len", None), getattr(spec, "vocab_size", None)

    def generate_chunks(self, chunks: list[tuple[int, list[list[int]]]],
                        sampling: SamplingParams) -> list[RolloutBatch]:
        """Each ``(k, prompts)`` generated on its own with seed ``chunk_seed(sampling.seed, k)``."""
        out = []
        for k, prompts in chunks:
            batch = self.engine.generate(prompts, replace(sampling, seed=chunk_seed(sampling.seed, k)))
            batch.weights_version = self.version
            out.append(batch)
        return out

    def score(self, *args, **kw) -> tuple[int, ScoreResult]:
        return self.version, self.engine.score(*args, **kw)

    def load_weights(self, named: dict[str, torch.Tensor], version: int) -> int:
        # the pool's version is the authority (a restarted or planted-stale worker takes it as given)
        self.engine.update_weights(named)
        self.version = version
        return self.version

    def weights_version(self) -> int:
        return self.version

    def close(self) -> None:
        self.engine.close()


# ----------------------------------------------------------------------------- the pool


def ensure_ray(address: str = "", num_cpus: int | None = None) -> bool:
    """``ray.init`` unless Ray is already up: ADDRESS (or $RAY_ADDRESS) joins a cluster, else a local one.

    Returns True when this call started Ray (the pool then shuts it down on close()).
    """
    try:
        import ray
    except ImportError:
        raise RefitError("rollout_workers > 1 needs Ray: pip install 'refit[dist]'") from None
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:  # an existing cluster decides its own resources
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    return True


class RayEnginePool:
    """Engine protocol over ``workers`` Ray actors, each ``create_engine(backend, path, **engine_kw)``.

    ``cpus_per_worker``/``gpus_per_worker`` are the Ray resources of one actor; its engine gets
    ``threads=max(1, int(cpus_per_worker))`` unless ``engine_kw`` sets threads. ``last_checkpoint``
    is a callable naming where the learner's last checkpoint is (for the error message).
    """

    def __init__(self, backend: str, path, workers: int = 2, chunk: int = DEFAULT_CHUNK, ray_address: str = "",
                 cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 last_checkpoint: Callable[[], Any] | None = None, log: Callable[[str], None] = print,
                 start_timeout_s: float = 300.0, **engine_kw):
        if workers < 1 or chunk < 1:
            raise RefitError(f"RayEnginePool: need workers >= 1 and chunk >= 1 (got {workers}, {chunk})")

        self.backend, self.path, self.chunk = backend, str(path), chunk
        # Engine.manifest: the workers' engine folder's; None over a model folder (torch, hf workers)
        self.manifest = Manifest.read(path) if (Path(path) / MANIFEST).is_file() else None
        self._target = _engine._BACKENDS.get(backend)
        if self._target is None:
            raise RefitError(f"unknown backend {backend!r}; known: {', '.join(_engine.backends())}")
        self._engine_kw = dict(engine_kw)
        if self._engine_kw.get("threads") is None and cpus_per_worker >= 1:
            self._engine_kw["threads"] = int(cpus_per_worker)
        self._options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "max_restarts": 0}
        self._last_checkpoint, self._log = last_checkpoint, log
        self._owns_ray = ensure_ray(ray_address, max(os.cpu_count() or 1, math.ceil(workers * cpus_per_worker)))
        import ray

        self._ray, self._start_timeout_s = ray, start_timeout_s
        self._version = 0
        self._last_push = None  # (ObjectRef of the named tensors, version) of the last successful push
        self._workers = []
        self._check_resources(workers, cpus_per_worker, gpus_per_worker)
        self._workers = [self._spawn(i) for i in range(workers)]
        self._max_len, self._vocab = self._wait_ready(list(range(workers)))

    def _check_resources(self, workers: int, cpus: float, gpus: float) -> None:
        """Fail at once, in one line, when the whole cluster could never hold the actors (Ray would wait forever)."""
        total = self._ray.cluster_resources()
        for kind, each in (("CPU", cpus), ("GPU", gpus)):
            if workers * each > total.get(kind, 0.0) + 1e-9:
                raise RefitError(f"RayEnginePool: {workers} workers x {each:g} {kind} = {workers * each:g} "
                                 f"{kind}s, but the Ray cluster has {total.get(kind, 0.0):g} in all; use fewer workers, smaller "
                                 f"rollout_worker_{kind.lower()}s, or a larger cluster (ray_address)")

    def _wait_ready(self, which: list[int]) -> tuple[int | None, int | None]:
        """Wait for workers ``which`` to hold their engines; a clear error when Ray cannot place them in time."""
        from ray.exceptions import GetTimeoutError

        try:
            return self._get([self._workers[i].ready.remote() for i in which], self._start_timeout_s)[0]
        except GetTimeoutError:
            free = self._ray.available_resources()
            raise RefitError(f"rollout workers {which} did not start within {self._start_timeout_s:g} s: Ray has "
                             f"{free.get('CPU', 0.0):g} CPUs / {free.get('GPU', 0.0):g} GPUs free and each worker "
                             f"asks {self._options['num_cpus']:g} / {self._options['num_gpus']:g} (other actors "
                             f"hold the rest?)") from None

    def _get(self, refs, timeout: float | None = None):
        """ray.get, with an engine's own error (RefitError, ValueError) re-raised as itself."""
        from ray.exceptions import RayTaskError

        try:
            return self._ray.get(refs, timeout=timeout)
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    # --- actors

    def _spawn(self, i: int):
        cls = self._ray.remote(EngineWorker).options(**self._options)
        return cls.remote(self.backend, self._target, self.path, self._engine_kw, self._engine_kw.get("threads"))

    def _restart(self, i: int) -> None:
        """Replace worker ``i`` by a fresh actor holding the last pushed weights and version."""
        try:
            self._ray.kill(self._workers[i], no_restart=True)
        except Exception:  # already gone
            pass
        self._workers[i] = self._spawn(i)
        self._wait_ready([i])
        if self._last_push is not None:
            ref, version = self._last_push
            self._ray.get(self._workers[i].load_weights.remote(ref, version))

    def _where_checkpoint(self) -> str:
        ck = self._last_checkpoint() if self._last_checkpoint is not None else None
        return f"last checkpoint: {ck} (resume from it with --resume)" if ck else "no checkpoint known to the pool"

    def _run(self, what: str, calls: dict[int, Callable[[Any], Any]]) -> dict[int, Any]:
        """Submit ``calls[i](actor_i)`` for all i at once, gather; a dead actor: restart, retry once."""
        from ray.exceptions import RayActorError

        refs = {i: call(self._workers[i]) for i, call in calls.items()}
        out, failed = {}, []
        for i, ref in refs.items():
            try:
                out[i] = self._get(ref)
            except RayActorError as e:
                failed.append((i, e))
        for i, first in failed:
            self._log(f"refit: rollout worker {i} died during {what} ({type(first).__name__}); "
                      f"restarting it and retrying its shard once")
            try:
                self._restart(i)
                out[i] = self._get(calls[i](self._workers[i]))
            except RayActorError as second:
                raise RefitError(f"rollout worker {i} failed twice in a row during {what} "
                                 f"({type(first).__name__}, then {type(second).__name__}); giving up. "
                                 f"{self._where_checkpoint()}") from None
        return out

    def _check(self, who: int, version: int, what: str) -> None:
        if version != self._version:
            raise RefitError(f"stale rollout worker {who}: its {what} carries weights_version {version}, the pool "
                             f"expects {self._version}; refusing it (push weights again)")

    # --- Engine protocol

    manifest: Manifest | None = None  # the workers' engine folder's manifest (set in __init__); None: a model folder
    adapter = None  # the workers' adapter inputs are not in this process: a LoRA policy's push carries merged layers

    def adapter_off(self) -> Engine:
        """Engine.adapter_off: refused, a pool's workers keep their adapters in their own processes."""
        raise RefitError("adapter_off: a Ray engine pool has no adapter-off view (its workers hold the adapters)")

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def weights_version(self) -> int:
        """The version every worker holds (checked at every push and on every result)."""
        return self._version

    def worker_versions(self) -> list[int]:
        return self._ray.get([w.weights_version.remote() for w in self._workers])

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, on_step=None) -> RolloutBatch:
        if not isinstance(sampling, SamplingParams):
            raise RefitError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if on_step is not None:  # the steps run inside the actors; a callable would not reach back here
            raise RefitError("generate(on_step=...) is not available on a Ray engine pool: time the pool's "
                             "generate() call, or one worker's engine")
        check_prompts(prompts, self._max_len, sampling.max_new_tokens, self._vocab)  # with the caller's indices
        c = self.chunk
        plan = plan_chunks(len(prompts), c, len(self._workers))
        calls = {}
        for w, ks in enumerate(plan):
            if ks:
                shard = [(k, [list(p) for p in prompts[k * c:(k + 1) * c]]) for k in ks]
                calls[w] = lambda actor, shard=shard: actor.generate_chunks.remote(shard, sampling)
        results = self._run("generate", calls)
        by_chunk = {}
        for w, batches in results.items():
            for k, b in zip(plan[w], batches):
                self._check(w, b.weights_version, "rollout batch")
                by_chunk[k] = b
        order = sorted(by_chunk)
        return merge_batches([by_chunk[k] for k in order], [k * c for k in order], sampling)

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor, temperature: float = 1.0, topk: int = 0,
              chunk_size: int = DEFAULT_SCORE_CHUNK) -> ScoreResult:
        shards = split_rows(int(prompt_ids.shape[0]), len(self._workers))
        calls = {w: (lambda actor, s=s: actor.score.remote(prompt_ids[s], prompt_mask[s], response_ids[s],
                                                           response_mask[s], temperature, topk, chunk_size))
                 for w, s in enumerate(shards)}
        if not calls:  # zero rows: let one engine give the empty result (or its error)
            calls = {0: lambda actor: actor.score.remote(prompt_ids, prompt_mask, response_ids, response_mask,
                                                         temperature, topk, chunk_size)}
        results = self._run("score", calls)
        parts = []
        for w in sorted(results):
            version, res = results[w]
            self._check(w, version, "score result")
            parts.append(res)
        fields = {}
        for name in ("logprobs", "topk_logprobs", "topk_ids"):
            fields[name] = None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
        return ScoreResult(**fields)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """One ``ray.put`` of the tensors; every worker loads that ref and must report the new version."""
        named = {k: v.detach().to("cpu").contiguous() for k, v in named_tensors.items()}
        ref = self._ray.put(named)
        target = next_version(self._version, version)
        replies = self._run("update_weights", {i: (lambda actor: actor.load_weights.remote(ref, target))
                                               for i in range(len(self._workers))})
        versions = sorted(set(replies.values()))
        if versions != [target]:
            raise RefitError(f"weight push: workers report versions {versions}, expected {target} on every worker")
        self._version, self._last_push = target, (ref, target)

    def close(self) -> None:
        """Kill the actors (and Ray itself when this pool started it)."""
        for w in getattr(self, "_workers", []):
            try:
                self._ray.kill(w, no_restart=True)
            except Exception:
                pass
        self._workers, self._last_push = [], None
        if getattr(self, "_owns_ray", False):
            self._ray.shutdown()
            self._owns_ray = False


__all__ = ["DEFAULT_CHUNK", "EngineWorker", "RayEnginePool", "chunk_seed", "ensure_ray", "merge_batches",
           "plan_chunks", "split_rows"]
