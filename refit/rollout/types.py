"""Typed records at the rollout boundary: what generation is asked for, and what it returns.

Padding rule (stated once; the source of truth is :mod:`refit.core.padding`):

- ``prompt_ids`` / ``prompt_mask`` (B, Tp): decoder-only prompts are LEFT-padded, with
  positions counted over real tokens only; encoder-decoder (T5, BART, Marian) prompts are the
  encoder input, padded on the model's native side, its tokenizer's (RIGHT for all three --
  forcing left there is the TRL negative-KL bug: TRL PR "[t5] Fix negative kl issue",
  https://github.com/huggingface/trl/pull/262).
- ``response_ids`` / ``response_mask`` (B, Tr): RIGHT-padded with the pad id; the mask is 1 up
  to AND INCLUDING the first stop token (EOS or ``SamplingParams.stop_ids``), then 0. A row that
  never stops is all ones. Every per-token float field is 0.0 where the mask is 0.

Three log-prob sources are kept apart by name: the engine's ``rollout_logprobs``
(this file), the learner's ``old_logprobs`` and ``ref_logprobs`` (computed in PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from refit.core.manifest import Manifest
from refit.core.padding import check_left_padded, check_right_padded, native_padding_side
from refit.rollout.config import SamplingParams  # noqa: F401 - the request record, kept torch-free in config.py


@dataclass
class RolloutBatch:
    """One generate() call's output: B = len(prompts) * n rows, all torch CPU tensors."""

    prompt_ids: torch.Tensor  # (B, Tp) int64, padded per the rule above (left / native encoder side)
    prompt_mask: torch.Tensor  # (B, Tp) int64, 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, Tr) int64, right-padded with pad_id
    response_mask: torch.Tensor  # (B, Tr) float32, 1 up to and including the first stop token
    rollout_logprobs: torch.Tensor  # (B, Tr) float32, log-prob under the distribution sampled from
    #   (repetition penalty -> /temperature -> top-k -> top-p -> min-p, renormalised); 0.0 when greedy
    rollout_plain_logprobs: torch.Tensor  # (B, Tr) float32, log_softmax(logits/temperature), no truncation
    prompt_index: torch.Tensor  # (B,) int64, row -> prompt; prompt-major (p0 s0..s(n-1), p1 s0, ...)
    weights_version: int  # engine weights_version the batch was generated with
    sampling: SamplingParams  # the params used
    is_seq2seq: bool  # True: prompt_ids are the encoder input (encoder-decoder model)
    topk_logprobs: torch.Tensor | None = None  # (B, Tr, k) float32, top-k plain log-probs, k = return_topk
    topk_ids: torch.Tensor | None = None  # (B, Tr, k) int64, their token ids (pad_id where masked)
    pad_id: int = 0  # the pad token of response_ids / prompt_ids
    eos_id: int | None = None  # model EOS; with sampling.stop_ids the stop set that check() verifies

    @property
    def num_rows(self) -> int:
        return int(self.prompt_ids.shape[0])

    def stop_set(self) -> set[int]:
        return set(self.sampling.stop_ids) | ({self.eos_id} if self.eos_id is not None else set())

    def check(self) -> "RolloutBatch":
        """Raise ValueError (one line) unless shapes, dtypes and the padding rule hold; return self."""
        b, tp = self.prompt_ids.shape
        tr = self.response_ids.shape[1]
        specs = [("prompt_ids", (b, tp), torch.int64), ("prompt_mask", (b, tp), torch.int64),
                 ("response_ids", (b, tr), torch.int64), ("response_mask", (b, tr), torch.float32),
                 ("rollout_logprobs", (b, tr), torch.float32), ("rollout_plain_logprobs", (b, tr), torch.float32),
                 ("prompt_index", (b,), torch.int64)]
        k = self.sampling.return_topk
        if k:
            specs += [("topk_logprobs", (b, tr, k), torch.float32), ("topk_ids", (b, tr, k), torch.int64)]
        for name, shape, dtype in specs:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"RolloutBatch.{name}: expected {shape} {dtype}, got {got}")
        if self.is_seq2seq:
            check_right_padded(self.prompt_mask)
            if (self.prompt_mask.sum(-1) == 0).any():
                raise ValueError("a row has no real tokens (empty prompt)")
        else:
            check_left_padded(self.prompt_mask)
        self._check_response()
        return self

    def _check_response(self) -> None:
        m = self.response_mask
        if not ((m == 0) | (m == 1)).all():
            raise ValueError("response_mask must be 0/1")
        check_right_padded(m)
        off = m == 0
        if (self.response_ids[off] != self.pad_id).any():
            raise ValueError("response_ids must hold pad_id where response_mask is 0")
        for name in ("rollout_logprobs", "rollout_plain_logprobs"):
            if (getattr(self, name)[off] != 0).any():
                raise ValueError(f"{name} must be 0.0 where response_mask is 0")
        if (self.rollout_plain_logprobs > 1e-5).any() or (self.rollout_logprobs > 1e-5).any():
            raise ValueError("log-probs must be <= 0")
        stops = self.stop_set()
        if not stops:
            return
        is_stop = torch.zeros_like(off)
        for s in stops:
            is_stop |= self.response_ids == s
        lengths = m.sum(-1).long()
        inside = is_stop & (m == 1)
        last = torch.zeros_like(off)
        rows = torch.nonzero(lengths > 0).flatten()
        last[rows, lengths[rows] - 1] = True
        if (inside & ~last).any():
            raise ValueError("response_mask continues past a stop token")
        short = lengths < m.shape[1]
        if (short & ~(inside & last).any(-1)).any():
            raise ValueError("a response ends (mask 0) without a stop token")

    def rows(self, idx) -> "RolloutBatch":
        """A batch of the selected rows (index list, slice or bool mask); padding columns kept."""
        idx = torch.as_tensor(idx) if not isinstance(idx, slice) else idx
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return replace(self, **{f: pick(getattr(self, f)) for f in _ROW_FIELDS})

    def trimmed(self, multiple: int = 1) -> "RolloutBatch":
        """The same rows without the columns that are padding on every row: a decoder-only prompt's leading ones
        (left-padded), an encoder prompt's trailing ones (right-padded), the response's past its longest row (one
        column kept at least). ``multiple``: each width rounded up to a multiple of it (the prompt with padding
        columns on its padding side, the response with masked ones on the right; see :meth:`padded`), so that the
        forwards of many batches take a few shapes. Each row's tokens, mask and positions (``cumsum(mask) - 1``)
        are unchanged, so a forward gives the same logits at every real response position."""
        tp = self.prompt_mask.shape[1]
        cols = torch.nonzero(self.prompt_mask.sum(0) > 0).flatten()
        used = (int(cols[-1]) + 1 if self.is_seq2seq else tp - int(cols[0])) if len(cols) else 1
        want = _round_up(used, multiple)
        p = slice(0, min(want, tp)) if self.is_seq2seq else slice(max(0, tp - want), tp)
        ids, mask = self.prompt_ids[:, p], self.prompt_mask[:, p]
        if want > tp:  # more columns than the batch has: padding ones on the prompt's padding side
            ids, mask = (_pad_cols(t, want - tp, v, left=not self.is_seq2seq) for t, v in ((ids, self.pad_id),
                                                                                          (mask, 0)))
        w = max(1, int(self.response_mask.sum(1).max())) if self.num_rows else 1
        out = self.padded(multiple) if multiple > 1 else self
        w = min(_round_up(w, multiple), out.response_ids.shape[1])
        resp = {f: getattr(out, f)[:, :w] for f in _RESPONSE_FIELDS if getattr(out, f) is not None}
        return replace(self, prompt_ids=ids, prompt_mask=mask, **resp)

    def padded(self, multiple: int) -> "RolloutBatch":
        """The batch with its response widened to a multiple of ``multiple`` columns: masked ones on the right (pad
        id, mask 0, log-probs 0), as a batch whose every row stopped earlier holds them."""
        extra = _round_up(self.response_ids.shape[1], multiple) - self.response_ids.shape[1]
        if not extra:
            return self
        pad = {"response_ids": self.pad_id, "topk_ids": self.pad_id}
        return replace(self, **{f: _pad_cols(getattr(self, f), extra, pad.get(f, 0), left=False)
                                for f in _RESPONSE_FIELDS if getattr(self, f) is not None})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_cols(t: torch.Tensor, n: int, value, left: bool) -> torch.Tensor:
    """``t`` (B, T, ...) with ``n`` columns of ``value`` added on the left or the right."""
    cols = torch.full((t.shape[0], n, *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([cols, t] if left else [t, cols], 1)


_ROW_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs",
               "rollout_plain_logprobs", "prompt_index", "topk_logprobs", "topk_ids")
_RESPONSE_FIELDS = ("response_ids", "response_mask", "rollout_logprobs", "rollout_plain_logprobs", "topk_logprobs",
                    "topk_ids")


@dataclass
class ScoreResult:
    """Engine.score() output: the plain policy's view of given responses (teacher / reference)."""

    logprobs: torch.Tensor  # (B, Tr) float32, log_softmax(logits/temperature) at each response token; 0 where masked
    topk_logprobs: torch.Tensor | None = field(default=None)  # (B, Tr, k) float32, top-k of the same distribution
    topk_ids: torch.Tensor | None = field(default=None)  # (B, Tr, k) int64, their token ids
    # k == V (the whole vocabulary): topk_logprobs in vocabulary order, topk_ids a broadcast arange(V), no sort


@dataclass(frozen=True)
class ModelSpec:
    """What the shared loops need to know about a model, from a manifest or an HF config."""

    kind: str  # "decoder" | "seq2seq"
    pad_id: int
    eos_id: int
    decoder_start_id: int | None  # seq2seq only
    prompt_side: str  # "left" (decoder-only) or the encoder's native side
    vocab_size: int
    max_len: int | None  # largest prompt + response length accepted; None = unchecked

    @classmethod
    def from_manifest(cls, m: Manifest) -> "ModelSpec":
        s, d = m.special_ids, m.dims
        limits = [x for x in (d.max_len, d.max_positions) if x]  # learned positions cap it too
        return cls(kind=m.kind, pad_id=s.pad, eos_id=s.eos, decoder_start_id=s.decoder_start,
                   prompt_side=m.padding.prompt_side, vocab_size=d.vocab_size,
                   max_len=min(limits) if limits else None)

    @classmethod
    def from_config(cls, cfg, max_len: int | None = None, model_dir=None,
                    decoder_start: int | None = None) -> "ModelSpec":
        """From an HF config; the encoder's padding side is its tokenizer's (``model_dir``, else the
        folder the config was loaded from), as the exporter decides it (refit.core.padding).
        ``decoder_start`` overrides the config's (refit.export.capabilities.decoder_start_id)."""
        seq2seq = bool(getattr(cfg, "is_encoder_decoder", False))
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        side = native_padding_side(seq2seq, model_dir or getattr(cfg, "_name_or_path", None) or None)
        limit = max_len or getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
        return cls(kind="seq2seq" if seq2seq else "decoder", pad_id=cfg.pad_token_id or 0, eos_id=eos,
                   decoder_start_id=(decoder_start if decoder_start is not None
                                     else getattr(cfg, "decoder_start_token_id", None)) if seq2seq else None,
                   prompt_side=side, vocab_size=cfg.vocab_size, max_len=limit)
