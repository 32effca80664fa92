"""Logit processing and sampling, shared by every backend (gpt-fast style small functions).

Every backend feeds its float32 logits through these functions with one random stream per row
(:class:`RowStreams`, keyed by (prompt, sample)), so the same seed gives the same tokens on any
backend whose logits agree, and a row's tokens do not depend on the batch it is decoded in.
The logit processors (repetition penalty, temperature, top-k, top-p, min-p, in HF's order and with HF's
semantics) are :mod:`refit.rollout.processors`.

Sampling is an exponential race (argmax of ``log p - log E``, ``E ~ Exp(1)``, as gpt-fast's
``multinomial_sample_one_no_sync``) run in two levels over blocks of ``RACE_BLOCK`` tokens:
first a block, weighted by its probability mass, then a token inside it. That draws exactly
from softmax, with B * (V / 256 + 256) draws per step (~14k at 32 x 50257) instead of B * V
(1.6M). A fixed number of draws per step,
whatever the row state, keeps the random stream row-state free. A race, unlike an inverse CDF,
keeps the same seed on the same tokens across backends whose logits differ by ~1e-6: a token's
key depends on its own score (and its block's mass), not on the running sum of every token
before it (an inverse CDF moved rows onto other tokens between ONNX Runtime and PyTorch logits; the
race did not).

Per step on (B, V) the untruncated path reads the logits twice (max, then exp into a reused
buffer) and sums the blocks: the plain log-partition is the sum of the block masses, so no
log_softmax is materialised and the token's processed and plain log-probs are one number.
The processors (top-k/top-p/min-p, a repetition penalty) add their work and one log_softmax of the processed
scores. With :class:`RowStreams` the float64 race itself runs in numpy (:func:`_race_np`, same tokens and log-probs bit for bit): at small shapes a
step is ~25 tiny ops, where torch's per-op dispatch outweighs the arithmetic.
"""

from __future__ import annotations

import contextlib
import math
import threading

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.rollout.processors import NEG_INF, plain_logprobs, process_logits, processes, repetition_penalty
from refit.rollout.types import SamplingParams


def row_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of row (prompt, sample) of a call seeded with ``seed``: a SeedSequence hash, 63 bits."""
    return int(np.random.SeedSequence([int(seed), int(prompt), int(sample)]).generate_state(1, np.uint64)[0] >> 1)


MT_N, MT_M = 624, 397  # MT19937: state words, twist offset
_MT_A, _MT_UPPER, _MT_LOWER = np.uint32(0x9908B0DF), np.uint32(0x80000000), np.uint32(0x7FFFFFFF)
PER_ROW_MAX = 24  # RowStreams of up to this many rows step one numpy MT19937 per row (cheaper than the twist)


def _mt_twist(state: np.ndarray) -> None:
    """MT19937's state update on (R, 624) uint32 rows at once, in place (each row its own generator).

    Word i needs words i+1 and i+397 (mod 624), the latter already updated past i = 226: done in
    chunks whose inputs are all final, [0, 227), [227, 454), [454, 623), 623.
    """
    for lo, hi in ((0, MT_N - MT_M), (MT_N - MT_M, 2 * (MT_N - MT_M)), (2 * (MT_N - MT_M), MT_N - 1)):
        # state[i+M] ^ (y >> 1) ^ (y & 1) * A, y = upper bit of word i | lower bits of word i+1, with in-place
        # temporaries (two allocations instead of eight)
        y = state[:, lo:hi] & _MT_UPPER
        t = state[:, lo + 1:hi + 1] & _MT_LOWER
        y |= t
        t &= np.uint32(1)  # y & 1: bit 0 is word i+1's
        t *= _MT_A
        y >>= np.uint32(1)
        y ^= t
        j = lo + MT_M - MT_N if lo >= MT_N - MT_M else lo + MT_M
        y ^= state[:, j:j + hi - lo]
        state[:, lo:hi] = y
    y = (state[:, MT_N - 1] & _MT_UPPER) | (state[:, 0] & _MT_LOWER)
    state[:, MT_N - 1] = state[:, MT_M - 1] ^ (y >> np.uint32(1)) ^ ((y & np.uint32(1)) * _MT_A)


def _mt_temper(state: np.ndarray) -> np.ndarray:
    """The 624 outputs per row of a freshly twisted state."""
    y = state ^ (state >> np.uint32(11))
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    return y ^ (y >> np.uint32(18))


def _mt_seeded(seed: int) -> np.ndarray:
    """The (624,) uint32 MT19937 state of ``torch.Generator().manual_seed(seed)`` (PyTorch keeps the low 32
    bits: ``init_genrand(seed & 0xffffffff)``, the same as numpy's legacy ``RandomState`` seeding)."""
    return np.random.RandomState(int(seed) & 0xFFFFFFFF).get_state()[1].astype(np.uint32)


def _exp_exact(u: np.ndarray) -> np.ndarray:
    """-log1p(-u) through the C library's scalar log1p: PyTorch's CPU ``exponential_`` bit for bit."""
    log1p = math.log1p
    return np.array([-log1p(-x) for x in u.ravel().tolist()], np.float64).reshape(u.shape)


class RowStreams:
    """One random stream per row, keyed by (prompt, sample), so a row's tokens do not depend on the batch.

    Row i's stream is the one ``torch.Generator().manual_seed(row_seed(base, *key))`` gives to
    ``Tensor.exponential_`` (float64): MT19937 seeded with the seed's low 32 bits, two 32-bit words per
    draw (``random64``), ``u = (w64 & (2^53 - 1)) * 2^-53``, ``E = -log1p(-u)`` (PyTorch 2.x's CPU kernel;
    tests/test_sampling.py checks it against ``exponential_`` itself). Beyond :data:`PER_ROW_MAX` rows all are stepped at once,
    vectorised in numpy: one twist of (rows, 624) words per 312 draws instead of one ``exponential_`` call
    per row per step.
    The k-th sampled token of a row uses the k-th draws of its stream whatever the slot it sits in, the
    other rows, or the order rows arrive in (in-flight batching, rollout/decode.py). ``seed=None`` picks a
    random base seed once per call. A slot's stream is replaced when a new row takes the slot.

    Up to :data:`PER_ROW_MAX` rows, each row's stream is instead numpy's own ``MT19937`` bit generator set to
    the same state (the same words: tested), whose C loop beats the vectorised twist's ~40 numpy calls while
    the rows are few.

    ``log1p`` is numpy's vectorised one, which differs from the C library's scalar ``log1p`` (what
    ``exponential_`` calls) in the last bit for ~8% of draws; the race (:func:`_race_np`) keeps the old tokens exactly by
    redoing, with the C library's values (:meth:`exact`), any row whose winning key is within
    ``EXACT_MARGIN`` of the runner-up (never seen at 1e-9: the keys differ by ~1e-15 at most).
    """

    def __init__(self, seed: int | None, keys: list[tuple[int, int]]):
        self.base = seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        n = self.n = len(keys)
        # few rows: one numpy MT19937 per row; else the vectorised state of every row
        self.gens: list | None = [None] * n if n <= PER_ROW_MAX else None
        if self.gens is None:
            self.state = np.empty((n, MT_N), np.uint32)
            self.out = np.empty((n, 2 * MT_N), np.uint32)  # tempered words: this block, then the next
            self.pos = np.zeros(n, np.int64)  # next unread word of each row, in [0, 624)
        self._u: np.ndarray | None = None  # the last draw's uniforms, for exact()
        if n:
            self._reset(np.arange(n), [self._seed(k) for k in keys])

    def _seed(self, key: tuple[int, int]) -> int:
        return row_seed(self.base, *key)

    def _reset(self, rows: np.ndarray, seeds: list[int]) -> None:
        if self.gens is not None:
            for r, s in zip(rows.tolist(), seeds):
                g = self.gens[r] = np.random.MT19937(0)
                g.state = {"bit_generator": "MT19937", "state": {"key": _mt_seeded(s), "pos": MT_N}}
            return
        self.state[rows] = np.stack([_mt_seeded(s) for s in seeds])
        st = self.state[rows]
        _mt_twist(st)
        self.out[rows, :MT_N] = _mt_temper(st)
        _mt_twist(st)
        self.out[rows, MT_N:] = _mt_temper(st)
        self.state[rows] = st
        self.pos[rows] = 0

    def assign(self, slot: int, key: tuple[int, int]) -> None:
        """Slot ``slot`` now holds row ``key``: a fresh stream for it."""
        self._reset(np.array([slot]), [self._seed(key)])

    def _words(self, k: int) -> np.ndarray:
        """(rows, k) uint32 (uint64 holding them, per-row generators): the next k words of every row's MT19937
        stream (each stream advances by k)."""
        if self.gens is not None:
            w = np.empty((self.n, k), np.uint64)
            for i, g in enumerate(self.gens):
                w[i] = g.random_raw(k)
            return w
        parts = []
        if not self.n:
            return np.empty((0, k), np.uint32)
        while k > 0:
            c = min(k, MT_N)
            p = self.pos
            if (p == p[0]).all():  # rows in step (a static batch): a slice
                parts.append(self.out[:, p[0]:p[0] + c].copy())
            else:
                parts.append(np.take_along_axis(self.out, p[:, None] + np.arange(c), 1))
            self.pos = p = p + c
            full = np.nonzero(p >= MT_N)[0]
            if full.size == len(p):  # every row's block is used up (a static batch): in place, no row copies
                _mt_twist(self.state)
                self.out[:, :MT_N] = self.out[:, MT_N:]
                self.out[:, MT_N:] = _mt_temper(self.state)
                self.pos -= MT_N
            elif full.size:  # their current block is used up: the next one moves down, a new one is made
                st = self.state[full]
                _mt_twist(st)
                self.out[full, :MT_N] = self.out[full, MT_N:]
                self.out[full, MT_N:] = _mt_temper(st)
                self.state[full] = st
                self.pos[full] -= MT_N
            k -= c
        return parts[0] if len(parts) == 1 else np.concatenate(parts, 1)

    def exponential(self, n: int) -> torch.Tensor:
        """(rows, n) float64 Exp(1) draws, row i from stream i (each stream advances by n); see the class
        note on the last bit (:meth:`exact` gives the C library's values of the same draws)."""
        w = self._words(2 * n)
        # ((hi << 32 | lo) & (2^53 - 1)) * 2^-53, as the exact float64 sum of its two parts (no uint64 temporaries)
        u = (w[:, 0::2] & np.uint32(0x1FFFFF)).astype(np.float64) * 2.0**-21
        u += w[:, 1::2].astype(np.float64) * 2.0**-53
        self._u = u
        e = np.log1p(-u)
        return torch.from_numpy(np.negative(e, out=e))

    def exact(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), n) float64: the last draw of those rows, exactly as ``exponential_`` gives it."""
        return torch.from_numpy(_exp_exact(self._u[rows.numpy()]))


EXACT_MARGIN = 1e-9  # race keys closer than this are recomputed with the C library's log1p (RowStreams)


class StepBuffers:
    """(B, V) scratch tensors reused by every step of one decode loop, so sampling allocates nothing.

    A fresh (B, V) temporary per op costs its page faults every step, more than the arithmetic: the
    allocator hands such blocks back to the OS on free.
    """

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        t = self._bufs.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self._bufs[name] = torch.empty(shape, dtype=dtype)
        return t


@contextlib.contextmanager
def one_thread():
    """Run the (B, V) host work on one intra-op thread, then restore the setting.

    These ops are memory-bound and short; on cores shared with other work a second OpenMP thread is often
    descheduled and every parallel region waits for it.

    Only on the main thread: torch's intra-op setting is process-wide, not per thread (``torch.set_num_threads(1)``
    on a worker thread sets the main thread's ``get_num_threads()`` to 1 and slows its matmuls), so a decode loop on another thread (a shard, the overlapped PPO
    engine's) leaves it alone and samples with the count the main thread set; before this, the overlapped
    engine's every step flipped the learner's torch threads to 1 and back.
    """
    n = torch.get_num_threads()
    if n == 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


RACE_BLOCK = 256  # tokens per block of the two-level race (~sqrt(V) for a 50k vocabulary)


def _race(scores: torch.Tensor, generator: "torch.Generator | RowStreams",
          buffers: StepBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw from softmax(scores) (B, V), -inf = never: (ids (B,), row max (B, 1), float64 sum of exp (B, 1)).

    Level 1 races the blocks on log(mass), level 2 the chosen block's tokens on their scores;
    P(token) = mass_b / total * exp(score - m) / mass_b. Draws: one float64 Exp(1) per block
    and per block slot, per row. With :class:`RowStreams` the float64 race runs in numpy
    (:func:`_race_np`), else in torch (:func:`_race_keys`).
    """
    b, v = scores.shape
    n_blocks = -(-v // RACE_BLOCK)
    m, mass = _block_mass(scores, buffers)
    if isinstance(generator, RowStreams):
        ids, total = _race_np(scores, mass, generator, n_blocks)
        return ids, m, total
    mass = mass.double()
    e = torch.empty(b, n_blocks + RACE_BLOCK, dtype=torch.float64).exponential_(generator=generator)
    ids = _race_keys(_padded(scores, n_blocks, buffers), mass, e, n_blocks, False)[0]
    return ids, m, mass.sum(-1, keepdim=True)


def _block_mass(scores: torch.Tensor, buffers: StepBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) float32 scores -> (row max (B, 1), float32 mass of each block of exp(scores - max) (B, n_blocks)).

    The block sums are written into one buffer (``out=``, the same reduction as a plain ``sum``: tested
    bit for bit), not concatenated."""
    b, v = scores.shape
    full, n_blocks = v - v % RACE_BLOCK, -(-v // RACE_BLOCK)
    m = scores.amax(-1, keepdim=True)  # (B, 1)
    w = torch.sub(scores, m, out=buffers.get("w", scores.shape, torch.float32)).exp_()  # (B, V) in [0, 1]
    mass = buffers.get("mass", (b, n_blocks), torch.float32)
    if full:
        torch.sum(w[:, :full].view(b, full // RACE_BLOCK, RACE_BLOCK), -1, out=mass[:, :full // RACE_BLOCK])
    if full < v:
        torch.sum(w[:, full:], -1, out=mass[:, -1])
    return m, mass


def _padded(scores: torch.Tensor, n_blocks: int, buffers: StepBuffers) -> torch.Tensor:
    """The scores as float64 in a (B, n_blocks * RACE_BLOCK) buffer, -inf past V (never drawn)."""
    b, v = scores.shape
    padded = buffers.get("padded", (b, n_blocks * RACE_BLOCK), torch.float64)
    padded[:, :v] = scores
    padded[:, v:] = NEG_INF
    return padded


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.detach() if t.requires_grad else t).numpy()


def _race_np(scores: torch.Tensor, mass: torch.Tensor, streams: RowStreams,
             n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both race levels in numpy float64 from the float32 block masses: (ids (B,), float64 total mass (B, 1)).

    Today's tokens bit for bit: numpy's float64 ``log`` may differ from torch's in the last bit (keys of
    magnitude < 1e3: < 1e-12 apart), far inside ``EXACT_MARGIN``; a row whose winning key at either level is
    within the margin of the runner-up is redone by the torch race (:func:`_race_keys`) on ``exponential_``'s
    own values, exactly as before, and any other row has the same winner either way. numpy's small-array ops
    cost a fraction of torch's dispatch each. The total mass stays a torch sum (its order, hence its bits, is torch's).
    """
    b, v = scores.shape
    e = _as_numpy(streams.exponential(n_blocks + RACE_BLOCK))  # (B, n_blocks + RACE_BLOCK), one stream per row
    log_e = np.log(np.maximum(e, 1e-300, out=e), out=e)  # an E of exactly 0 would make a -inf key NaN
    mass64 = _as_numpy(mass).astype(np.float64)
    block_keys = np.full_like(mass64, NEG_INF)  # an empty block (all -inf) has mass 0: key -inf
    np.log(mass64, out=block_keys, where=mass64 > 0)
    block_keys -= log_e[:, :n_blocks]
    block = block_keys.argmax(-1)  # (B,)
    rows, sc, n_full = np.arange(b), _as_numpy(scores), v // RACE_BLOCK
    # the chosen blocks' scores (B, RACE_BLOCK) as float64: whole blocks picked from a (B, blocks, RACE_BLOCK)
    # view; rows that chose the partial last block get its scores, -inf past V (never drawn)
    if n_full:
        keys = sc[:, :n_full * RACE_BLOCK].reshape(b, n_full, RACE_BLOCK)[rows, np.minimum(block, n_full - 1)]
        keys = keys.astype(np.float64)
    else:
        keys = np.empty((b, RACE_BLOCK))
    if n_full < n_blocks:
        last = np.nonzero(block == n_full)[0]
        if last.size:
            keys[last, :v - n_full * RACE_BLOCK] = sc[last, n_full * RACE_BLOCK:]
            keys[last, v - n_full * RACE_BLOCK:] = NEG_INF
    keys -= log_e[:, n_blocks:]
    slot = keys.argmax(-1)
    ids = block * RACE_BLOCK + slot
    # a runner-up within the margin (at least two keys >= top - margin): the best of the others, the winner
    # set to -inf, is >= top - margin (the keys are not used after this)
    top = keys[rows, slot]
    keys[rows, slot] = NEG_INF
    close = keys.max(-1) >= top - EXACT_MARGIN
    if n_blocks > 1:
        top = block_keys[rows, block]
        block_keys[rows, block] = NEG_INF
        close |= block_keys.max(-1) >= top - EXACT_MARGIN
    ids = torch.from_numpy(ids)
    mass64 = torch.from_numpy(mass64)
    if close.any():  # a near tie: decide those rows as before, with exponential_'s own values
        r = torch.from_numpy(np.nonzero(close)[0])
        ids[r] = _race_keys(_padded(scores[r], n_blocks, StepBuffers()), mass64[r], streams.exact(r), n_blocks,
                            False)[0]
    if n_blocks <= 2:  # a sum of one or two numbers is fl(a + b) in any order: numpy's is torch's
        return ids, torch.from_numpy(mass64.numpy().sum(-1, keepdims=True))
    return ids, mass64.sum(-1, keepdim=True)


def _race_keys(padded: torch.Tensor, mass: torch.Tensor, e: torch.Tensor, n_blocks: int,
               margins: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both race levels from float64 scores ``padded`` (B, n_blocks * RACE_BLOCK; -inf past V) and the Exp(1)
    draws ``e`` (B, n_blocks + RACE_BLOCK): (ids (B,), rows whose winning key at either level is within
    EXACT_MARGIN of the runner-up, or None when ``margins`` is off). ``e`` is overwritten."""
    b = padded.shape[0]
    log_e = e.clamp_(min=1e-300).log_()  # an E of exactly 0 would make a -inf key NaN
    block_keys = mass.log().sub_(log_e[:, :n_blocks])
    block = block_keys.argmax(-1)  # (B,)
    keys = padded.view(b, n_blocks, RACE_BLOCK)[torch.arange(b), block].sub_(log_e[:, n_blocks:])  # (B, RACE_BLOCK)
    top, slot = keys.max(-1)
    ids = block * RACE_BLOCK + slot
    close = None
    if margins:  # a runner-up within the margin: at least two keys >= top - margin (-inf keys never are)
        close = (keys >= (top - EXACT_MARGIN)[:, None]).sum(-1) > 1
        if n_blocks > 1:
            close |= (block_keys >= (block_keys.max(-1).values - EXACT_MARGIN)[:, None]).sum(-1) > 1
    return ids, close


def sample(processed_logprobs: torch.Tensor, generator: torch.Generator, greedy: bool = False) -> torch.Tensor:
    """(B, V) processed log-probs -> (B,) int64 token ids (argmax when greedy; no draw then)."""
    if greedy:
        return processed_logprobs.argmax(-1)
    return _race(processed_logprobs, generator, StepBuffers())[0]


def _log_partition(scores: torch.Tensor, buffers: StepBuffers | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1) float32 logsumexp, as max + log(sum exp(scores - max))."""
    m = scores.amax(-1, keepdim=True)
    w = torch.sub(scores, m, out=(buffers or StepBuffers()).get("w", scores.shape, torch.float32)).exp_()
    return m + w.sum(-1, keepdim=True).log()


def chosen_logprobs(logits: torch.Tensor, processed: torch.Tensor, ids: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``ids`` (B,): (under the processed distribution, under plain softmax(logits/T))."""
    idx = ids.long().unsqueeze(-1)
    proc = processed.gather(-1, idx).squeeze(-1)
    plain = plain_logprobs(logits, temperature).gather(-1, idx).squeeze(-1)
    return proc, plain


def topk_logprobs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits -> top-k plain log-probs (..., k) float32 and their ids (..., k) int64."""
    values, ids = torch.topk(plain_logprobs(logits, temperature), k, dim=-1)
    return values, ids


def _scaled(logits: torch.Tensor, temperature: float, buffers: StepBuffers) -> torch.Tensor:
    """float32 logits / temperature, in a reused buffer (the logits themselves when T = 1)."""
    x = logits.float()
    if temperature == 1.0:
        return x
    return torch.div(x, temperature, out=buffers.get("scores", x.shape, torch.float32))


def _check_finite(log_z: torch.Tensor) -> None:
    """One line when a row's logits hold a NaN or +inf (its log-partition is then not finite): a broken model or
    push (e.g. NaN weights from a diverged update) must stop generation, not sample from garbage."""
    bad = ~np.isfinite(_as_numpy(log_z).reshape(-1))
    if bad.any():
        rows = np.nonzero(bad)[0].tolist()
        raise RefitError(f"sampling: non-finite logits (NaN or inf) in {len(rows)} of {len(bad)} rows "
                         f"(first: {rows[:8]}); the engine's weights or inputs are broken (a NaN weight push?)")


def sample_step(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                buffers: StepBuffers | None = None, seen: np.ndarray | None = None):
    """One decode step on (B, V) logits: (ids, processed log-probs, plain log-probs, top-k or None).

    Without processors (:func:`refit.rollout.processors.processes`) the processed distribution is the plain
    one, and one pass both draws the token and gives its log-prob, scores - log Z with Z the race's total mass.
    ``buffers`` (one per decode loop) lets consecutive steps reuse their scratch memory. ``seen`` (B, V) bool: the
    tokens each row has seen (:class:`refit.rollout.processors.SeenTokens`), which a repetition penalty acts on.
    The plain log-probs are always softmax(logits / temperature)'s, the learner's view.
    """
    buffers = buffers or StepBuffers()
    scores = _scaled(logits, params.temperature, buffers)  # (B, V)
    top = None
    if params.greedy or processes(params, logits.shape[-1]):
        log_z = _log_partition(scores, buffers)  # (B, 1)
        if params.greedy:
            ids = repetition_penalty(logits, seen, params.repetition_penalty).argmax(-1)
            proc = torch.zeros(ids.shape)
        else:
            processed = process_logits(logits, params, seen)
            ids = _race(processed, generator, buffers)[0]
            proc = processed.gather(-1, ids[:, None]).squeeze(-1)
    else:
        ids, m, total = _race(scores, generator, buffers)
        # float32 max + float32(torch's log of the float64 total), in numpy: the same IEEE ops as torch's
        log_z = torch.from_numpy(_as_numpy(m) + _as_numpy(total.log_()).astype(np.float32))
        proc = None
    _check_finite(log_z)  # before any of this step's results leave
    # the chosen token's score - log Z (float32), gathered in numpy (cheaper than torch's dispatch here)
    plain = torch.from_numpy(_as_numpy(scores)[np.arange(len(ids)), _as_numpy(ids)] - _as_numpy(log_z)[:, 0])
    if params.return_topk:  # log_softmax is monotone per row: top-k of the scores, shifted by log Z
        values, top_ids = torch.topk(scores, params.return_topk, dim=-1)
        top = (values - log_z, top_ids)
    return ids, plain.clone() if proc is None else proc, plain, top
