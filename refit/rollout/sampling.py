"""Logit processing and sampling, shared by every backend (gpt-fast style small functions).

Every backend feeds its float32 logits through these functions with one random stream per row
(:class:`refit.rollout.row_streams.RowStreams`, keyed by (prompt, sample)), so the same seed gives the same tokens on any
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
import threading

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.rollout.processors import NEG_INF, plain_logprobs, process_logits, processes, repetition_penalty
from refit.rollout.row_streams import RowStreams
from refit.rollout.types import SamplingParams


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
