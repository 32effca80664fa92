"""The one decode loop (gpt-fast's shape: prefill, sample, decode one token) and its in-flight scheduler.

:func:`decode_loop` runs a static batch on any backend's :class:`StepState`: 1. prefill the prompts,
2. sample one token per row from its own random stream, 3. mask rows that stopped, 4. stop bookkeeping,
5. feed the tokens back through the KV cache. Every caller drives it: ``Engine.generate`` on every backend,
the export parity gate (refit.rollout.parity), the benchmarks.

In-flight (continuous) batching: a fixed number of slots; when a row stops, the next waiting row
(the next prompt, or the next sample of a prompt) is prefilled into its slot while the others keep
decoding. vLLM's and SGLang's schedulers do this per step; here the slot count is the engine's
batch, and the rows wait in prompt-major order.

A row's result does not depend on the slot count or the arrival order: its random stream is keyed
by (prompt, sample) (:class:`refit.rollout.row_streams.RowStreams`), its KV positions are its own (a fused
engine's rows are compact, refit/rollout/ort_fused.py), and its position ids are its own token count.
The output is the same record as the static loop's (:func:`refit.rollout.engine.decode_loop`): rows in
input order, responses right-padded to the longest, log-probs 0.0 on padding.

A state that supports slots has, besides ``extend``, ``open(slots)`` (buffers for that many rows,
all idle) and ``admit(slots list, ids (k, Tp), mask (k, Tp)) -> (k, V)`` (prefill k left-padded prompts
into those slots; the logits after each one's last token). An idle slot is fed mask 0 and keeps its
cache.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch

from refit.rollout.processors import SeenTokens
from refit.rollout.row_streams import RowStreams
from refit.rollout.sampling import StepBuffers, one_thread, sample_step
from refit.rollout.types import ModelSpec, SamplingParams


class StepEvent(NamedTuple):
    """One phase of a ``generate`` call, as an ``on_step`` hook sees it."""

    phase: str  # "prefill": prompt forward + first sample (time to first token); "decode": one cached step + sample
    step: int  # the response position this phase produced: 0 for "prefill", 1.. for "decode"
    seconds: float  # wall time of the phase (time.perf_counter); logits are on the host by then, device work done
    tokens: int  # response tokens it produced: rows still generating (finished rows are fed pad, not counted)


StepHook = Callable[[StepEvent], None]  # N response positions -> one "prefill" then N-1 "decode" events


class StepState(Protocol):
    """One batch's model state on a backend (KV cache, encoder output)."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, Tp) prompt (padded by the rule) -> (B, V) float32 logits for the first response token."""

    def extend(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, c) next tokens, (B, c) their 0/1 mask -> (B, c, V) float32 logits after each."""


class _PhaseClock:
    """Times the loop's phases for an ``on_step`` hook; the hook's own time is left out of the next phase."""

    def __init__(self, hook: StepHook):
        self.hook, self.t = hook, time.perf_counter()

    def tick(self, step: int, alive: torch.Tensor) -> None:
        seconds = time.perf_counter() - self.t
        self.hook(StepEvent("prefill" if step == 0 else "decode", step, seconds, int(alive.sum())))
        self.t = time.perf_counter()


def row_keys(index: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """(prompt, sample) of each prompt-major row: the key of its random stream (refit.rollout.row_streams.RowStreams)."""
    return [(int(p), i % n) for i, p in enumerate(index.tolist())]


def stop_table(vocab: int, spec: ModelSpec, params: SamplingParams) -> np.ndarray:
    """Token id -> whether it ends its row (EOS and ``params.stop_ids``), a bool array covering the vocabulary and
    every special id, so that ``table[tokens]`` is the stop test of a step."""
    table = np.zeros(max(vocab, spec.pad_id, spec.eos_id, *params.stop_ids) + 1, dtype=bool)
    table[[t for t in (spec.eos_id, *params.stop_ids) if t >= 0]] = True
    return table


def decode_loop(state: StepState, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                spec: ModelSpec, on_step: StepHook | None = None,
                keys: list[tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Generate up to ``max_new_tokens`` per row; finished rows are fed pad with mask 0.

    Returns response_ids/mask and both log-prob kinds (B, Tr), plus top-k (B, Tr, k) if asked.
    ``on_step`` gets a :class:`StepEvent` per response position (no clock is read without it).
    ``keys`` (default: row i is (i, 0)) key each row's random stream (refit.rollout.row_streams.RowStreams).
    """
    b, steps = ids.shape[0], params.max_new_tokens
    clock = _PhaseClock(on_step) if on_step is not None else None
    gen = RowStreams(params.seed, keys or [(i, 0) for i in range(b)])
    scratch = StepBuffers()  # the sampler's (B, V) temporaries, reused by every step
    # the step bookkeeping in numpy on preallocated (B, max_new_tokens) outputs, a column per step: no per-step
    # column lists to stack, no torch dispatch (the loop's own work halved: docs/performance.md)
    alive = np.ones(b, dtype=bool)
    out_ids = np.full((b, steps), spec.pad_id, dtype=np.int64)
    out_mask, out_proc, out_plain = (np.zeros((b, steps), np.float32) for _ in range(3))
    tk_lp = tk_ids = None
    # 1. prefill: the whole prompt through the model, logits for the first response token
    logits = state.prefill(ids, mask)
    is_stop = stop_table(logits.shape[-1], spec, params)
    seen = seen_tokens(params, b, logits.shape[-1], ids, mask, spec)
    for step in range(steps):
        # 2. sample (one draw per row per step from the row's own stream); the (B, V)
        #    host work runs on one thread, see refit.rollout.sampling.one_thread
        with one_thread():
            tok, proc, plain, top = _sample(logits, params, gen, scratch, seen)
        # 3. mask rows that stopped earlier: pad id, 0.0 log-probs
        tok = np.where(alive, tok.numpy(), spec.pad_id)
        if seen is not None:
            seen.add(tok, alive)
        keep = alive.astype(np.float32)
        out_ids[:, step], out_mask[:, step] = tok, keep
        np.multiply(proc.float().numpy(), keep, out=out_proc[:, step])
        np.multiply(plain.float().numpy(), keep, out=out_plain[:, step])
        if top is not None:
            if tk_lp is None:
                tk_lp = np.zeros((b, steps, top[0].shape[-1]), np.float32)
                tk_ids = np.full((b, steps, top[0].shape[-1]), spec.pad_id, dtype=np.int64)
            tk_lp[:, step] = top[0].float().numpy() * keep[:, None]
            tk_ids[:, step] = np.where(alive[:, None], top[1].numpy(), spec.pad_id)
        if clock is not None:  # position `step` is sampled: its phase (prefill or one decode step) ends
            clock.tick(step, torch.from_numpy(alive))
        # 4. stop bookkeeping: the stop token itself stays inside the mask
        alive &= ~is_stop[tok]
        if not alive.any() or step == steps - 1:
            break
        # 5. decode one token: feed what was emitted (finished rows: pad, masked out)
        logits = state.extend(torch.from_numpy(tok[:, None]), torch.from_numpy(keep[:, None].astype(np.int64)))[:, -1]
    n = step + 1
    out = {"response_ids": torch.from_numpy(out_ids[:, :n].copy()),
           "response_mask": torch.from_numpy(out_mask[:, :n].copy()),
           "rollout_logprobs": torch.from_numpy(out_proc[:, :n].copy()),
           "rollout_plain_logprobs": torch.from_numpy(out_plain[:, :n].copy())}
    if tk_lp is not None:
        out["topk_logprobs"] = torch.from_numpy(tk_lp[:, :n].copy())
        out["topk_ids"] = torch.from_numpy(tk_ids[:, :n].copy())
    return out


def seen_tokens(params: SamplingParams, rows: int, vocab: int, ids: torch.Tensor, mask: torch.Tensor,
                spec: ModelSpec) -> SeenTokens | None:
    """The rows' seen tokens for a repetition penalty (None without one), started from the prompts ``ids``."""
    if params.repetition_penalty == 1.0:
        return None
    seen = SeenTokens(rows, vocab)
    seen.reset(np.arange(rows), ids, mask, spec)
    return seen


def _sample(logits, params: SamplingParams, gen, scratch: StepBuffers, seen: SeenTokens | None):
    """:func:`refit.rollout.sampling.sample_step`, given the seen tokens only with a repetition penalty."""
    if seen is None:
        return sample_step(logits, params, gen, scratch)
    return sample_step(logits, params, gen, scratch, seen.mask)


def supports_slots(state) -> bool:
    return hasattr(state, "admit") and hasattr(state, "open")


SHARD_MIN_ROWS = 16  # rows per shard below which a shard's fixed per-step cost outweighs its share of the work
SHARD_MAX_LAYER_WEIGHTS = 8_000_000  # layer weights per token above which intra-op threads split the matmuls well


def auto_shards(rows: int, layer_weights: int, threads: int) -> int:
    """``rollout.engine_shards`` 0 (auto): how many loops decode a generate call's ``rows`` on ``threads`` threads:
    one shard per thread, at most one per ``SHARD_MIN_ROWS`` rows, and only for models under
    ``SHARD_MAX_LAYER_WEIGHTS`` layer weights a token, whose matmuls are too small for intra-op threads to split
    well. The rule's data (shards against intra-op threads, by rows and model size): docs/engine-step.md, "Shards:
    the auto rule"."""
    if layer_weights > SHARD_MAX_LAYER_WEIGHTS:
        return 1
    return max(1, min(threads, rows // SHARD_MIN_ROWS))


def auto_decode_threads(rows: int, layer_weights: int, threads: int) -> int:
    """The intra-op threads a single decode loop (one shard) uses of the engine's ``threads`` under
    ``rollout.engine_shards`` auto: one for a model under ``SHARD_MAX_LAYER_WEIGHTS`` layer weights a token decoding at
    most ``SHARD_MIN_ROWS`` rows (too few rows for a second shard, matmuls too small for a second intra-op thread to
    repay its hand-offs at every node), else all of them. Scoring keeps them all. The data: docs/engine-step.md,
    "Shards: the auto rule"."""
    if threads > 1 and layer_weights <= SHARD_MAX_LAYER_WEIGHTS and rows <= SHARD_MIN_ROWS:
        return 1
    return threads


def layer_weights(text_cfg) -> int:
    """Weights a token meets in the decoder layers (attention 4 d^2, MLP 2 or 3 d x ff), from a transformers
    text config (embeddings left out: a lookup and one output matmul)."""
    d = getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd", None) or text_cfg.d_model
    ff = getattr(text_cfg, "intermediate_size", None) or getattr(text_cfg, "n_inner", None) or getattr(
        text_cfg, "d_ff", None) or 4 * d
    layers = getattr(text_cfg, "num_hidden_layers", None) or getattr(text_cfg, "n_layer", None) or text_cfg.num_layers
    gated = 3 if getattr(text_cfg, "hidden_act", "") in ("silu", "swiglu") else 2
    return layers * (4 * d * d + gated * d * ff)


def shard_bounds(keys: list[tuple[int, int]], shards: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of at most ``shards`` shards of prompt-major rows, as even in rows as whole prompts allow.

    A cut falls only where the prompt changes (``keys[r][0]``), so a prompt's samples stay in one shard and its
    prefill is still shared (refit/rollout/ort_fused.py ``distinct_rows``); each shard ends at the prompt boundary
    nearest its even share of the rows. Fewer prompts than shards: one shard per prompt."""
    n = len(keys)
    starts = [r for r in range(n) if r == 0 or keys[r][0] != keys[r - 1][0]]  # each prompt's first row
    cuts, prev = [0], 0
    for i in range(1, shards):
        target = round(i * n / shards)
        best = min(starts, key=lambda r: (abs(r - target), r))
        if prev < best < n:
            cuts.append(best)
            prev = best
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


def on_threads(calls: list[Callable[[], object]]) -> list:
    """Run ``calls`` at once, one thread each (the first on the caller's thread), under ``torch.no_grad`` (grad mode
    is per thread: a new thread starts with autograd on), torch's intra-op threads set to one while they run
    when the caller is the main thread (the threads are the parallelism; ``one_thread``); their results in order.
    The first failure is raised once every call has ended."""
    import threading

    outs: list = [None] * len(calls)
    errors: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            with torch.no_grad():
                outs[i] = calls[i]()
        except BaseException as e:  # raised on the caller's thread once every call has ended
            errors[i] = e

    with one_thread():
        workers = [threading.Thread(target=run, args=(i,), name=f"refit-shard-{i}", daemon=True)
                   for i in range(1, len(calls))]
        for w in workers:
            w.start()
        run(0)
        for w in workers:
            w.join()
    for err in errors:
        if err is not None:
            raise err
    return outs


def _sharded(new_state, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, spec,
             keys: list[tuple[int, int]], slots: int | None, inflight: bool, on_step,
             bounds: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Each shard's rows decoded by :func:`schedule` on a thread of its own (:func:`on_threads`), on a state of its
    own (``new_state(shard)``), and concatenated in row order. Shard 0 runs on the calling thread and alone
    reports to ``on_step`` (its events are its rows' phases; the others run beside it). ``slots`` is split in
    proportion to the shards' rows."""
    n = ids.shape[0]

    def call(i: int, a: int, b: int):
        share = None if not slots else max(1, round(slots * (b - a) / n))
        return lambda: schedule(lambda: new_state(i), ids[a:b], mask[a:b], params, spec, keys[a:b], share, inflight,
                                on_step if i == 0 else None)

    return _concat(on_threads([call(i, a, b) for i, (a, b) in enumerate(bounds)]), spec.pad_id)


def schedule(new_state, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, spec,
             keys: list[tuple[int, int]], slots: int | None, inflight: bool = True,
             on_step=None, shards: int = 1) -> dict[str, torch.Tensor]:
    """Decode rows (N, Tp) with at most ``slots`` at once: one static batch when ``slots`` is None or >= N;
    in flight when ``inflight`` and the backend's state supports slots; else consecutive static batches
    of ``slots`` rows, each decoded until its longest row ends (rows keep their keys either way).
    ``on_step`` (refit.rollout.engine.StepHook) is called by the static loop; the in-flight loop mixes prefills
    and decode steps in one step, so it reports nothing.

    ``shards`` > 1: the rows are cut at prompt boundaries into that many shards (:func:`shard_bounds`), each
    decoded on its own thread over its own state, ``new_state(shard)`` (:func:`_sharded`): a backend whose run
    releases the GIL (ONNX Runtime) then decodes on that many cores at once. A row's tokens and log-probs are
    the same either way (its stream, positions and cache are its own)."""
    n = ids.shape[0]
    if shards > 1:
        bounds = shard_bounds(keys, shards)
        if len(bounds) > 1:
            return _sharded(new_state, ids, mask, params, spec, keys, slots, inflight, on_step, bounds)
    if not slots or slots >= n:
        return decode_loop(new_state(), ids, mask, params, spec, on_step, keys)
    state = new_state()
    if inflight and supports_slots(state):
        return inflight_loop(state, ids, mask, params, spec, slots, keys)
    outs = [decode_loop(state if i == 0 else new_state(), ids[i:i + slots], mask[i:i + slots], params, spec,
                        on_step, keys[i:i + slots]) for i in range(0, n, slots)]
    return _concat(outs, spec.pad_id)


def _concat(outs: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Row-wise concatenation of decode-loop dicts, right-padding each to the longest response."""
    tr = max(o["response_ids"].shape[1] for o in outs)
    fill = {"response_ids": pad_id, "topk_ids": pad_id}
    res = {}
    for k in outs[0]:
        parts = []
        for o in outs:
            t = o[k]
            pad = torch.full((t.shape[0], tr - t.shape[1], *t.shape[2:]), fill.get(k, 0), dtype=t.dtype)
            parts.append(torch.cat([t, pad], 1))
        res[k] = torch.cat(parts)
    return res


def inflight_loop(state, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, spec, slots: int,
                  keys: list[tuple[int, int]], admit_min: int | None = None) -> dict[str, torch.Tensor]:
    """Decode every row of the left-padded ``ids``/``mask`` (N, Tp) through ``slots`` slots.

    ``keys[r]`` = (prompt, sample) of row r seeds its stream. Freed slots are refilled together, in one
    prefill run, once ``admit_min`` (default ``slots // 8``, at least 1) are free or no row is left
    decoding: a run costs a fixed overhead besides its rows, which a small model's step is mostly made
    of. When rows are admitted changes no row (their streams and positions are their own). Returns the
    decode loop's dict.
    """
    admit_min = admit_min or max(1, slots // 8)
    n_rows = ids.shape[0]
    streams = RowStreams(params.seed, [keys[0]] * slots)
    scratch = StepBuffers()
    waiting = deque(range(n_rows))
    # the slots' bookkeeping in numpy, as in decode_loop (no torch dispatch per op)
    row = np.full(slots, -1, dtype=np.int64)  # row held by each slot; -1 = idle
    length = np.zeros(slots, dtype=np.int64)  # tokens the slot's row has emitted
    log: list[tuple[np.ndarray, ...]] = []  # per step: (rows, step index, tok, proc, plain, top lp, top ids)

    def admit(free: list[int]) -> None:
        free = free[:len(waiting)]
        rs = [waiting.popleft() for _ in free]
        for s, r in zip(free, rs):
            row[s], length[s] = r, 0
            streams.assign(s, keys[r])
        if seen is not None:
            seen.reset(free, ids[rs], mask[rs], spec)
        logits[free] = state.admit(free, ids[rs], mask[rs])

    state.open(slots)
    logits = torch.zeros(slots, spec.vocab_size)
    is_stop = stop_table(spec.vocab_size, spec, params)
    seen = SeenTokens(slots, spec.vocab_size) if params.repetition_penalty != 1.0 else None
    # 1. fill the slots with waiting rows (a prefill gives the logits of each row's first token)
    admit(list(range(slots)))
    while (row >= 0).any():
        live = row >= 0
        # 2. sample every slot (idle ones too: their draws go unused), one stream per row
        with one_thread():
            tok, proc, plain, top = _sample(logits, params, streams, scratch, seen)
        tok = tok.numpy()
        if seen is not None:
            seen.add(tok, live)
        log.append((row[live], length[live], tok[live], proc.float().numpy()[live], plain.float().numpy()[live],
                    None if top is None else top[0].float().numpy()[live], None if top is None else top[1].numpy()[live]))
        # 3. stop bookkeeping: the stop token stays inside the mask; a row also ends at max_new_tokens
        length += live
        done = live & (is_stop[tok] | (length >= params.max_new_tokens))
        row[done] = -1
        cont = row >= 0
        # 4. decode one token for the rows that go on; the others idle (mask 0, cache untouched)
        if cont.any():
            logits = state.extend(torch.from_numpy(np.where(cont, tok, spec.pad_id)[:, None]),
                                  torch.from_numpy(cont[:, None].astype(np.int64)))[:, -1].clone()
        # 5. refill the free slots from the queue, together (the other slots' caches stay untouched)
        free = np.nonzero(row < 0)[0].tolist()
        if waiting and (len(free) >= admit_min or not cont.any()):
            admit(free)
    return _assemble(log, n_rows, spec.pad_id, params.return_topk)


def _assemble(log: list, n_rows: int, pad_id: int, k: int) -> dict[str, torch.Tensor]:
    """Per-step records (numpy) -> (N, Tr) tensors in row order, right-padded (pad id, mask 0, log-probs 0)."""
    tr = max(int(steps.max()) + 1 for _, steps, *_ in log)
    out = {"response_ids": np.full((n_rows, tr), pad_id, dtype=np.int64),
           "response_mask": np.zeros((n_rows, tr), np.float32), "rollout_logprobs": np.zeros((n_rows, tr), np.float32),
           "rollout_plain_logprobs": np.zeros((n_rows, tr), np.float32)}
    if k:
        out["topk_logprobs"] = np.zeros((n_rows, tr, k), np.float32)
        out["topk_ids"] = np.full((n_rows, tr, k), pad_id, dtype=np.int64)
    for rows, steps, tok, proc, plain, tk_lp, tk_ids in log:
        at = (rows, steps)
        out["response_ids"][at], out["response_mask"][at] = tok, 1.0
        out["rollout_logprobs"][at], out["rollout_plain_logprobs"][at] = proc, plain
        if k:
            out["topk_logprobs"][at], out["topk_ids"][at] = tk_lp, tk_ids
    return {name: torch.from_numpy(a) for name, a in out.items()}
