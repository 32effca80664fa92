"""Stepping a fused-attention engine (refit/export/fused.py; T5, BART, Marian: refit/export/fused_seq2seq.py) on ONNX
Runtime: one preallocated KV buffer per layer and K/V, written in place by GroupQueryAttention, reused from batch to
batch.

Rows are compact in the buffer: row b's tokens sit at positions ``[0, n_b)``. A left-padded prompt
batch (the padding rule every caller keeps) is compacted on the way in; its positions are
``0..n_b-1``, the plain graph's ``cumsum(mask) - 1``. A step's chunk (B, c) carries, per row, the
count of valid tokens (its mask's sum; the mask is right-padded): 0 makes the row idle, its cache
untouched, so a finished row costs no cache position. Logits at chunk positions past a row's valid
count are unspecified by the op and set to 0 here, so a masked position is never NaN. Decode steps (one
token per row) rerun one IOBinding per batch (:class:`refit.rollout.ort_run.StepBinding`).

The buffer is sized per call (longest prompt + new tokens, rounded up to ``CAPACITY_STEP``) and kept
by the engine while batches fit in it (a batch of fewer rows runs in its first rows: :class:`KVPool`); stale
positions beyond a row's length are never read (tested: a batch after a longer one gives the same tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.rollout.ort_run import KVBuffers, StepBinding, compact, run_bound, seq2seq_step_inputs, step_inputs

CAPACITY_STEP = 64  # buffer capacity granularity: fewer reallocations across calls of similar lengths


def _run_fused(sess, host: dict[str, np.ndarray], kv: dict, bound: dict | None = None) -> np.ndarray:
    """One fused step with ``kv`` written in place; the logits (B, K, V) on the host."""
    return run_bound(sess, "cpu", host, bound or {}, ["logits"], inplace=kv)["logits"].numpy()


DEDUP_MIN = 2  # prefill each distinct prompt once when rows repeat prompts at least this many times on average


def distinct_rows(cids: np.ndarray, n: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Compact prompts (B, T) and lengths (B,) -> (the first row of each distinct prompt (k,), each row's index
    into those (B,)), or (None, None) when rows repeat prompts fewer than :data:`DEDUP_MIN` times on average.

    Running each distinct prompt once and copying its K/V to the rows that share it makes a group-sampled
    prefill several times cheaper (docs/performance.md). A row's logits and K/V do not
    depend on the other rows of a run (tested: the same tokens and log-probs either way).
    """
    if len(n) < 2 * DEDUP_MIN - 1:
        return None, None
    key = np.concatenate([n[:, None].astype(np.int64), cids], 1)
    _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    if len(first) * DEDUP_MIN > len(n):
        return None, None
    return first, inverse.reshape(-1)


class KVPool:
    """The engine's buffer set: one :class:`KVBuffers`, reallocated only when a call needs more rows or length
    than it holds; a call with fewer rows runs in its first rows (a PPO step alternates a rollout of B x n rows
    with an evaluation or a score of fewer: each used to allocate a set of its own)."""

    def __init__(self, names: list[str], n_kv_heads: int, head_dim: int, dtype, max_len: int):
        self.names, self.h, self.d, self.dtype, self.max_len = names, n_kv_heads, head_dim, dtype, max_len
        self.held: KVBuffers | None = None  # the allocated set: the most rows and positions asked for so far
        self.kv: KVBuffers | None = None  # the last set handed out: ``held`` or a view of its first rows
        self._views: dict[int, KVBuffers] = {}  # rows -> the view of ``held`` handed out for that many

    def get(self, batch: int, capacity: int) -> KVBuffers:
        """Buffers of exactly ``batch`` rows and at least ``capacity`` positions (contents: stale, never read).

        A new set holds the most rows and positions asked for so far (the larger of the held set's and this
        call's, positions rounded up to :data:`CAPACITY_STEP`, at most ``max_len``), so calls that alternate
        (many rows and short, few rows and long) allocate at most twice. A row's output does not depend on
        the buffer's other rows or on positions past its own (tested against a fresh engine)."""
        held = self.held
        if held is None or held.batch < batch or held.capacity < capacity:
            cap = min(-(-capacity // CAPACITY_STEP) * CAPACITY_STEP, max(self.max_len, capacity))
            rows = batch if held is None else max(batch, held.batch)
            cap = cap if held is None else max(cap, held.capacity)
            self.held = self.kv = held = None  # free the old set (and its views) before allocating the new one
            self._views.clear()
            self.held = KVBuffers(self.names, rows, self.h, cap, self.d, self.dtype)
        if batch == self.held.batch:
            self.kv = self.held
        else:
            if batch not in self._views:
                self._views[batch] = self.held.head(batch)
            self.kv = self._views[batch]
        return self.kv


class _FusedSteps:
    """What both fused states share: the buffers, each row's token count, one run, ``extend``."""

    def __init__(self, sess, pool: KVPool, capacity: int):
        self.sess, self.pool, self.capacity = sess, pool, capacity
        self.kv: KVBuffers | None = None
        self.n: np.ndarray | None = None  # (B,) int32 tokens held per row
        self._sb: StepBinding | None = None  # the decode steps' binding (extend with one token per row)
        self._fits: bool | None = None  # whether the graph allows one (StepBinding.fits)

    def _host(self, ids: np.ndarray, valid: np.ndarray, keep: np.ndarray) -> dict[str, np.ndarray]:
        return step_inputs(ids, self.n, valid, keep)

    def _bound(self) -> dict:
        return {}  # OrtValues bound as inputs besides the KV buffers

    def _check(self, chunk: int) -> None:
        if int(self.n.max()) + chunk > self.kv.capacity:
            raise RefitError(f"fused engine: {int(self.n.max())} + {chunk} tokens exceed the KV buffer "
                             f"({self.kv.capacity} positions)")

    def _run(self, ids: np.ndarray, valid: np.ndarray, keep: np.ndarray) -> torch.Tensor:
        """One step: chunk ``ids`` (B, S), ``valid`` (B,) new tokens per row, logits at ``keep`` (B, K)."""
        self._check(ids.shape[1])
        out = _run_fused(self.sess, self._host(ids, valid, keep), self.kv.values, self._bound())
        self.n = self.n + valid.astype(np.int32)
        bad = keep >= valid[:, None]  # (B, K) positions the op leaves unspecified
        if bad.any():  # numpy, in place on ORT's output: torch's masked_fill_ ran on 2 OpenMP threads, slow
            out[bad] = 0  # on shared cores
        return torch.from_numpy(out).float()  # (B, K, V), from the engine dtype (fp32: ORT's output itself)

    def _step_binding(self) -> StepBinding:
        """The decode-step binding of the current buffers (rebuilt when they or the bound inputs change)."""
        if self._sb is None or self._sb.kv is not self.kv:
            self._sb = StepBinding(self.sess, self.kv, self._bound(), *self._step_consts())
        return self._sb

    def _step_consts(self) -> tuple[dict, int | None]:
        return {}, None  # constant host inputs besides the step's own; a fixed total_sequence_length

    def extend(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, c) tokens, (B, c) right-padded 0/1 mask -> (B, c, V) logits (0 where the mask is 0).

        One token per row (a decode step) reruns one :class:`StepBinding`; the logits come back as a copy of
        its buffer (B x V floats), so a caller may keep them past the next step."""
        b, c = ids.shape
        if self._fits is None:
            self._fits = StepBinding.fits(self.sess)
        if c == 1 and self._fits:
            self._check(1)
            valid = mask.numpy()[:, 0].astype(np.int32)
            out = self._step_binding().run(ids.numpy()[:, 0], self.n, valid).astype(np.float32)  # a copy
            self.n = self.n + valid
            if not valid.all():
                out[valid == 0] = 0  # idle rows: unspecified by the op, 0 here
            return torch.from_numpy(out)
        valid = mask.numpy().sum(1).astype(np.int32)
        keep = np.broadcast_to(np.arange(c, dtype=np.int64), (b, c))
        return self._run(ids.numpy(), valid, keep)


class FusedDecoderState(_FusedSteps):
    """:class:`refit.rollout.engine.StepState` over a fused decoder-only graph, with slots (in-flight batching)."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, Tp) left-padded prompt -> (B, V) logits after each row's last token.

        Rows that repeat a prompt (``n`` samples of it: a PPO/GRPO group) are prefilled once: the distinct
        prompts run into a scratch buffer whose K/V are then copied to every row holding them (see
        :func:`distinct_rows`).
        """
        self.kv = self.pool.get(ids.shape[0], self.capacity)
        cids, _, n = compact(ids.numpy(), mask.numpy())
        self.n = np.zeros(ids.shape[0], np.int32)
        cids = cids[:, :int(n.max())]  # a slice of a wider padded batch may be all padding on the left
        first, inverse = distinct_rows(cids, n)
        if first is None or cids.shape[1] > self.kv.capacity:  # (too long: _run raises the one-line error)
            return self._run(cids, n, (n - 1)[:, None].astype(np.int64))[:, -1]
        k, t, a = len(first), cids.shape[1], next(iter(self.kv.arrays.values()))
        tmp = KVBuffers(list(self.kv.arrays), k, a.shape[1], t, a.shape[3], a.dtype)
        u = n[first]
        out = _run_fused(self.sess, step_inputs(cids[first], np.zeros(k, np.int32), u, (u - 1)[:, None]), tmp.values)
        for name, buf in self.kv.arrays.items():
            np.take(tmp.arrays[name], inverse, axis=0, out=buf[:, :, :t])
        self.n = n.astype(np.int32)
        return torch.from_numpy(out[:, -1]).float()[torch.from_numpy(inverse)]

    def open(self, slots: int) -> None:
        """In-flight batching (refit/rollout/decode.py): buffers for ``slots`` rows, every one idle."""
        self.kv = self.pool.get(slots, self.capacity)
        self.n = np.zeros(slots, np.int32)

    def admit(self, slots: list[int], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Prefill k left-padded prompts (k, Tp) into ``slots`` -> (k, V) logits after each one's last token.

        One run: a single slot is prefilled in place (a view of its rows of the buffers); several into
        a scratch buffer of k rows, whose positions are then copied into their slots (per row
        2 x layers x H_kv x n x D values). The other slots' caches are not touched.
        """
        cids, _, n = compact(ids.numpy(), mask.numpy())
        cids = cids[:, :int(n.max())]
        host = step_inputs(cids, np.zeros(len(slots), np.int32), n, (n - 1)[:, None])
        if len(slots) == 1:
            out = _run_fused(self.sess, host, self.kv.rows(slots[0], slots[0] + 1))
        else:
            k, a = len(slots), next(iter(self.kv.arrays.values()))
            tmp = KVBuffers(list(self.kv.arrays), k, a.shape[1], cids.shape[1], a.shape[3], a.dtype)
            out = _run_fused(self.sess, host, tmp.values)
            for name, buf in self.kv.arrays.items():
                for j, s in enumerate(slots):
                    buf[s, :, :n[j]] = tmp.arrays[name][j, :, :n[j]]
        self.n[slots] = n
        return torch.from_numpy(out[:, -1]).float()


class FusedSeq2SeqState(_FusedSteps):
    """:class:`refit.rollout.engine.StepState` over an encoder-decoder engine with the fused decoder graph
    (refit/export/fused_seq2seq.py: T5, BART, Marian): the encoder runs once per batch as on the plain engine; its cross
    K/V (OrtValues) and mask feed every decoder step; the decoder's self-attention K/V live in the shared
    buffers, compact from position 0 (the decoder start token). A finished row is fed mask 0 and idles.

    No slots: the cross K/V are one encoder run's, (B, H, Se, D) for that batch, so rows cannot be
    admitted into a running batch; ``slots`` gives static batches (refit/rollout/decode.py) that reuse the buffers.
    """

    def __init__(self, eng, pool: KVPool, capacity: int):
        super().__init__(eng.sessions["decoder"], pool, capacity)
        self.eng = eng
        self.cross: dict = {}
        self.enc_mask: np.ndarray | None = None

    def _host(self, ids, valid, keep):
        return seq2seq_step_inputs(ids, self.n, valid, keep, self.enc_mask, self.kv.capacity)

    def _bound(self) -> dict:
        return self.cross

    def _step_consts(self) -> tuple[dict, int | None]:
        return {"encoder_attention_mask": self.enc_mask}, self.kv.capacity

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, Se) encoder input (padded on its native side) -> (B, V) logits after the decoder start token."""
        self.enc_mask = mask.numpy().astype(np.int64)
        enc = run_bound(self.eng.sessions["encoder"], self.eng.device,
                        {"input_ids": ids.numpy(), "attention_mask": self.enc_mask}, {},
                        self.eng.manifest.graphs["encoder"].outputs)
        self.cross = {n: v for n, v in enc.items() if n.startswith("cross.")}
        self._sb = None  # binds the previous batch's cross K/V and encoder mask
        b = ids.shape[0]
        self.kv, self.n = self.pool.get(b, self.capacity), np.zeros(b, np.int32)
        start = np.full((b, 1), self.eng.spec.decoder_start_id, dtype=np.int64)
        return self._run(start, np.ones(b, np.int32), np.zeros((b, 1), np.int64))[:, -1]
