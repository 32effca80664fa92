"""Per-row random streams: :class:`RowStreams`, one MT19937 stream per row keyed by (prompt, sample).

The sampler (:mod:`refit.rollout.sampling`) draws its exponential race keys from these, so the same seed gives the
same tokens on any backend whose logits agree and a row's tokens do not depend on the batch it is decoded in or
the slot it sits in (in-flight batching, refit/rollout/decode.py). Each stream is the one
``torch.Generator().manual_seed(row_seed(...))`` gives to ``Tensor.exponential_``, reproduced in numpy: MT19937's
twist and tempering on every row at once (:func:`_mt_twist`, :func:`_mt_temper`), or numpy's own ``MT19937`` per
row while the rows are few (:data:`PER_ROW_MAX`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

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
    other rows, or the order rows arrive in (in-flight batching, refit/rollout/decode.py). ``seed=None`` picks a
    random base seed once per call. A slot's stream is replaced when a new row takes the slot.

    Up to :data:`PER_ROW_MAX` rows, each row's stream is instead numpy's own ``MT19937`` bit generator set to
    the same state (the same words: tested), whose C loop beats the vectorised twist's ~40 numpy calls while
    the rows are few.

    ``log1p`` is numpy's vectorised one, which differs from the C library's scalar ``log1p`` (what
    ``exponential_`` calls) in the last bit for ~8% of draws; the race (:func:`refit.rollout.sampling._race_np`)
    keeps the old tokens exactly by redoing, with the C library's values (:meth:`exact`), any row whose winning
    key is within ``refit.rollout.sampling.EXACT_MARGIN`` of the runner-up (never seen at 1e-9: the keys differ
    by ~1e-15 at most).
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
