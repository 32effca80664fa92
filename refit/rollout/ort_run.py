"""Running an ONNX Runtime session bound to memory the engine owns: the stepping code both ORT states share.

:func:`run_bound` is the one ``run_with_iobinding`` call (host arrays and OrtValues in, logits to the host).
The fused-attention graphs (refit/export/fused.py, refit/export/fused_seq2seq.py) keep their KV cache in
:class:`KVBuffers`, bound as both ``past`` and ``present`` so GroupQueryAttention writes in place; rows are
compact in them (:func:`compact`) and each step's host inputs come from :func:`step_inputs`; a decode step
(one token per row) reruns one :class:`StepBinding` instead, its inputs rewritten in place.
"""

from __future__ import annotations

import numpy as np


def run_bound(sess, device: str, host: dict[str, np.ndarray], bound: dict, outputs: list[str],
              inplace: dict | None = None) -> dict:
    """One ``run_with_iobinding``: host arrays and OrtValues (``bound``) in; logits to the host, the other
    ``outputs`` on ``device``. ``inplace`` ({past name: OrtValue}) is bound as both that input and its
    ``present`` output: the fused graphs' KV buffers, written in place by the op."""
    io = sess.io_binding()
    for name, arr in host.items():
        io.bind_cpu_input(name, np.ascontiguousarray(arr))
    for name, val in bound.items():
        io.bind_ortvalue_input(name, val)
    for name, val in (inplace or {}).items():
        io.bind_ortvalue_input(name, val)
        io.bind_ortvalue_output(name.replace("past", "present", 1), val)
    for name in outputs:
        io.bind_output(name, "cpu" if name == "logits" else device)
    sess.run_with_iobinding(io)
    return dict(zip([*(n.replace("past", "present", 1) for n in inplace or {}), *outputs], io.get_outputs()))


def compact(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-padded (B, T) prompts -> right-padded ids (B, T), positions (B, T) and lengths (B,) int32.

    Row b's ``n_b`` real tokens move to ``[0, n_b)``; its positions are ``0..n_b-1``, the plain graph's
    ``cumsum(mask) - 1`` at those tokens.
    """
    n = mask.sum(1).astype(np.int32)
    t = ids.shape[1]
    src = (t - n)[:, None] + np.arange(t)[None, :]  # (B, T): where token j of the compact row comes from
    valid = np.arange(t)[None, :] < n[:, None]
    out = np.where(valid, np.take_along_axis(ids, np.minimum(src, t - 1), 1), 0).astype(np.int64)
    pos = np.where(valid, np.arange(t)[None, :], 0).astype(np.int64)
    return out, pos, n


class KVBuffers:
    """One (B, H_kv, C, D) buffer per layer and K/V, as numpy arrays and the OrtValues over their memory.

    Bound as both ``past`` and ``present`` of every run, so GroupQueryAttention writes in place.
    Positions at or beyond a row's length are never read (the op bounds each row by ``seqlens_k``),
    so a buffer is reused across batches without clearing it.
    """

    def __init__(self, names: list[str], batch: int, n_kv_heads: int, capacity: int, head_dim: int, dtype):
        import onnxruntime as ort

        self.batch, self.capacity = batch, capacity
        self.arrays = {n: np.zeros((batch, n_kv_heads, capacity, head_dim), dtype) for n in names}
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.arrays.items()}

    def head(self, batch: int) -> "KVBuffers":
        """Rows [0, batch) of every buffer as buffers of their own (views: same memory, nothing allocated); a
        leading-axis slice of a C-contiguous array is C-contiguous, laid out as a fresh (batch, ...) set."""
        import onnxruntime as ort

        view = object.__new__(KVBuffers)
        view.batch, view.capacity = batch, self.capacity
        view.arrays = {n: a[:batch] for n, a in self.arrays.items()}
        view.values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in view.arrays.items()}
        return view

    def rows(self, start: int, stop: int) -> dict:
        """OrtValues over rows [start, stop) of every buffer (a view: same memory)."""
        import onnxruntime as ort

        return {n: ort.OrtValue.ortvalue_from_numpy(a[start:stop]) for n, a in self.arrays.items()}


_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


class StepBinding:
    """One IOBinding for a fused graph's decode steps (one new token per row), built once per batch and rerun.

    The KV buffers (as ``past`` and ``present``), the OrtValues in ``bound`` (cross K/V), the constant host
    inputs ``consts`` (encoder mask), ``logits_index`` (0) and a preallocated logits output are bound once;
    the per-step inputs are arrays bound once as OrtValues over their memory and rewritten in place by
    :meth:`run` (ORT reads them at each run, as it does the KV buffers). A fresh binding per step (6 host
    inputs, 16 KV bindings, ``get_outputs``) plus ``step_inputs`` made a decode step's host work several times
    what it is now.
    """

    def __init__(self, sess, kv: KVBuffers, bound: dict, consts: dict[str, np.ndarray] | None = None,
                 total: int | None = None):
        import onnxruntime as ort

        b = kv.batch
        out = next(o for o in sess.get_outputs() if o.name == "logits")
        self.sess, self.kv, self.fixed_total, self.io = sess, kv, total, sess.io_binding()
        self.ids, self.pos = np.zeros((b, 1), np.int64), np.zeros((b, 1), np.int64)
        self.seqlens, self.qlen, self.total = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((), np.int32)
        self.logits = np.empty((b, 1, out.shape[-1]), _NP_TYPES[out.type])
        self._arrays = {"input_ids": self.ids, "position_ids": self.pos, "seqlens_k": self.seqlens,
                        "query_seqlens": self.qlen, "total_sequence_length": self.total,
                        "logits_index": np.zeros((b, 1), np.int64), **{n: np.ascontiguousarray(a)
                                                                       for n, a in (consts or {}).items()}}
        self._values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._arrays.items()}  # kept alive
        for name, val in self._values.items():
            self.io.bind_ortvalue_input(name, val)
        for name, val in bound.items():
            self.io.bind_ortvalue_input(name, val)
        for name, val in kv.values.items():
            self.io.bind_ortvalue_input(name, val)
            self.io.bind_ortvalue_output(name.replace("past", "present", 1), val)
        self._out = ort.OrtValue.ortvalue_from_numpy(self.logits)
        self.io.bind_ortvalue_output("logits", self._out)

    @staticmethod
    def fits(sess) -> bool:
        """True when the graph's logits have a static vocabulary and a numpy dtype (the output is preallocated)."""
        out = next(o for o in sess.get_outputs() if o.name == "logits")
        return isinstance(out.shape[-1], int) and out.type in _NP_TYPES

    def run(self, tok: np.ndarray, start: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Tokens ``tok`` (B,) at rows holding ``start`` (B,) tokens, ``valid`` (B,) 0/1 -> the logits buffer
        (B, 1, V), overwritten by the next run (the inputs of :func:`step_inputs` with a chunk of 1)."""
        self.ids[:, 0] = tok
        self.pos[:, 0] = start
        total = start + valid
        np.maximum(total - 1, 0, out=self.seqlens)
        self.qlen[...] = valid
        self.total[...] = self.fixed_total if self.fixed_total is not None else max(int(total.max()), 1)
        self.sess.run_with_iobinding(self.io)
        return self.logits


def step_inputs(ids: np.ndarray, start: np.ndarray, n_new: np.ndarray, keep: np.ndarray) -> dict[str, np.ndarray]:
    """Host inputs of one fused step: chunk ``ids`` (B, S) right-padded, rows holding ``start`` (B,) tokens
    before it and ``n_new`` (B,) valid new ones (0: idle row), logits at ``keep`` (B, K) chunk positions."""
    s = ids.shape[1]
    total = start + n_new
    return {"input_ids": ids.astype(np.int64), "position_ids": (start[:, None] + np.arange(s)[None, :]).astype(np.int64),
            "seqlens_k": np.maximum(total - 1, 0).astype(np.int32), "query_seqlens": n_new.astype(np.int32),
            # an upper bound of every row's total (query_seqlens given); the op also wants it >= the chunk length
            "total_sequence_length": np.array(max(int(total.max()), s), np.int32), "logits_index": keep.astype(np.int64)}


def seq2seq_step_inputs(ids, start, n_new, keep, enc_mask, capacity: int) -> dict[str, np.ndarray]:
    """Host inputs of one fused seq2seq decoder step (:func:`step_inputs` plus the encoder mask);
    ``total_sequence_length`` is the buffer's ``capacity``, the bias's key length."""
    host = step_inputs(ids, start, n_new, keep)
    host["total_sequence_length"] = np.array(capacity, np.int32)
    host["encoder_attention_mask"] = enc_mask.astype(np.int64)
    return host
