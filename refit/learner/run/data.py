"""Prompt order and response text, shared by both jobs.

Every random choice of step ``s`` is a pure function of ``(seed, s)`` (no iterator state), so a run
resumed from a checkpoint at step ``s`` draws the same prompts as the uninterrupted run.
"""

from __future__ import annotations

import random

from refit.rollout.types import RolloutBatch


def prompt_indices(n_prompts: int, position: int, count: int, seed: int) -> list[int]:
    """The ``count`` prompt indices from data position ``position`` on: epochs of a seeded permutation.

    A run keeps its position (prompts consumed so far) in each checkpoint, so a resumed run goes on
    from there even with another batch size.
    """
    out = []
    for pos in range(position, position + count):
        epoch, i = divmod(pos, n_prompts)
        perm = list(range(n_prompts))
        random.Random(seed * 7919 + epoch).shuffle(perm)
        out.append(perm[i])
    return out


def decode_responses(tok, batch: RolloutBatch) -> list[str]:
    """Response text without the stop token and padding."""
    stops = batch.stop_set()
    out = []
    for ids, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
        kept = [t for t, k in zip(ids, m) if k and t not in stops]
        out.append(tok.decode(kept, skip_special_tokens=True))
    return out
