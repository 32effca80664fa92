"""The padding rule, stated once.

- Decoder-only models: prompts are LEFT-padded. ``attention_mask`` is 1 on real tokens;
  ``position_ids`` count real tokens only (:func:`position_ids_from_mask`), so a prompt gets the
  same positions alone or inside a padded batch. Generated tokens follow on the right.
- Encoder-decoder models: the encoder input is padded on the model's native side, the side its
  tokenizer pads on (right for T5, BART, Marian: the encoder takes no position ids, so learned
  positions would shift under left padding; forcing left padding is the TRL negative-KL bug,
  TRL PR "[t5] Fix negative kl issue", https://github.com/huggingface/trl/pull/262, fixing TRL
  issue #256). The exporter's probe checks the side (refit.export.capabilities). The decoder starts
  from ``decoder_start_token_id`` (Marian: the pad id), no padding.
- Responses are RIGHT-padded: ``response_mask`` is 1 up to and including the first stop token.

Everything here works on numpy arrays and torch tensors alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

DECODER_ONLY_SIDE = "left"
DEFAULT_ENCODER_SIDE = "right"  # transformers' tokenizer default, and every seq2seq family's in it


def native_padding_side(is_encoder_decoder: bool, model_dir: str | Path | None = None) -> str:
    """Prompt padding side: left for decoder-only; for an encoder, the side its tokenizer pads on.

    Read from ``tokenizer_config.json`` in ``model_dir`` (``padding_side``), else transformers'
    default (right). No model type is consulted.
    """
    if not is_encoder_decoder:
        return DECODER_ONLY_SIDE
    f = Path(model_dir) / "tokenizer_config.json" if model_dir else None
    if f is not None and f.is_file():
        try:
            side = json.loads(f.read_text()).get("padding_side")
        except json.JSONDecodeError:
            side = None
        if side in ("left", "right"):
            return side
    return DEFAULT_ENCODER_SIDE


def position_ids_from_mask(mask):
    """(B, T) 0/1 mask -> (B, T) positions: cumsum - 1 on real tokens, 1 on padding (HF's rule)."""
    pos = mask.cumsum(-1) - 1
    if isinstance(pos, np.ndarray):
        return np.where(mask == 0, 1, pos).astype(np.int64)
    return pos.masked_fill(mask == 0, 1).long()


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """Pad int sequences to (B, T_max) on ``side``; return (ids, mask) as int64 arrays."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    t = max(len(s) for s in seqs)
    ids = np.full((len(seqs), t), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), t), dtype=np.int64)
    for i, s in enumerate(seqs):
        if side == "left":
            ids[i, t - len(s):], mask[i, t - len(s):] = s, 1
        else:
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


def check_left_padded(mask) -> None:
    """Raise ValueError unless every row is 0...0 1...1 (left padding, at least one real token)."""
    m = np.asarray(mask)
    if (m.sum(-1) == 0).any():
        raise ValueError("a row has no real tokens (empty prompt)")
    if (np.diff(m, axis=-1) < 0).any():
        raise ValueError("mask is not left-padded: a real token is followed by padding")


def check_right_padded(mask) -> None:
    """Raise ValueError unless every row is 1...1 0...0 (right padding)."""
    m = np.asarray(mask)
    if (np.diff(m, axis=-1) > 0).any():
        raise ValueError("mask is not right-padded: padding is followed by a real token")
