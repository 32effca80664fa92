"""Logit processors: the step from a model's logits to the distribution the engine samples from.

transformers' order (``GenerationMixin._get_logits_processor``, do_sample): the repetition penalty on the raw
logits (``RepetitionPenaltyLogitsProcessor``), then ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` ->
``TopPLogitsWarper`` -> ``MinPLogitsWarper``. Each function here computes what its HF class computes (ties at the
k-th value kept; top-p keeps the smallest set reaching ``top_p`` and always the most likely token; min-p drops the
tokens whose probability is below ``min_p`` times the most likely one's, after top-k/top-p);
tests/test_processors.py checks them against those classes on the same logits.

The repetition penalty depends on the tokens a row has seen, as transformers (>= 5) counts them: ``generate``'s
``input_ids`` less the left padding (``prompt_ignore_length``), so a decoder-only model's real prompt tokens and
its sampled ones, and an encoder-decoder's decoder ids (its start token and the sampled ones; the encoder input is
``encoder_repetition_penalty``'s, which Refit does not take). A seen token's logit ``x`` becomes ``x / penalty``
when ``x > 0``, else ``x * penalty``. :class:`SeenTokens` holds that set per row in the decode loop;
:func:`seen_per_position` builds it for every position of given responses (the learner-side recomputation and
the ``hf`` backend's log-probs).

Refit's learner scores at the temperature alone, as TRL 1.16's GRPO/RLOO/Distillation trainers do; the
processors are the sampler's, and the engine's ``rollout_logprobs`` are those of the processed distribution
(docs/design.md, "Logit processors and the learner").
"""

from __future__ import annotations

import numpy as np
import torch

from refit.rollout.types import ModelSpec, SamplingParams

NEG_INF = float("-inf")


def plain_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 log_softmax(logits / temperature), no processing."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """-inf below the k-th largest score per row (ties kept); k <= 0 or k >= V is a no-op."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter, HF ``TopPLogitsWarper``: drop the tail whose mass is <= 1 - top_p."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p)
    drop[..., -1] = False  # always keep the most likely token
    return scores.masked_fill(drop.scatter(-1, order, drop), NEG_INF)


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """HF ``MinPLogitsWarper``: -inf where softmax(scores) < min_p x the row's largest probability (the most likely
    token always stays: its probability is the largest); min_p 0 is a no-op. (..., V) -> (..., V)."""
    if min_p <= 0.0:
        return scores
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | np.ndarray | None, penalty: float) -> torch.Tensor:
    """HF ``RepetitionPenaltyLogitsProcessor`` on float32 logits (..., V): where ``seen`` (..., V) bool, ``x / penalty``
    for ``x > 0`` and ``x * penalty`` otherwise (a seen token becomes less likely for penalty > 1); elsewhere
    unchanged. penalty 1 or no ``seen``: the logits themselves."""
    x = logits.float()
    if penalty == 1.0 or seen is None:
        return x
    seen = (torch.from_numpy(seen) if isinstance(seen, np.ndarray) else seen).to(x.device)
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def processes(params: SamplingParams, vocab: int) -> bool:
    """True when the sampled distribution differs from softmax(logits / temperature): top-k below V, top-p < 1,
    min-p > 0 or a repetition penalty != 1 (greedy aside)."""
    return (0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0
            or params.repetition_penalty != 1.0)


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   seen: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 log-probs of the distribution actually sampled from.

    The repetition penalty over ``seen`` (..., V) bool (None: no token seen), then temperature, top-k, top-p and
    min-p, renormalised; removed tokens are -inf. For greedy the distribution is a point mass on the argmax of the
    penalised logits (log-prob 0 there, -inf elsewhere), as HF's greedy search applies the penalty too.
    """
    x = repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        out = torch.full_like(x, NEG_INF)
        return out.scatter_(-1, x.argmax(-1, keepdim=True), 0.0)
    scores = x / params.temperature
    scores = min_p_filter(top_p_filter(top_k_filter(scores, params.top_k), params.top_p), params.min_p)
    return torch.log_softmax(scores, dim=-1)


class SeenTokens:
    """(rows, V) bool, numpy: the tokens each row (or slot) of a decode loop has seen, for the repetition penalty.

    :meth:`reset` starts rows from their prompts (a decoder's real tokens, an encoder-decoder's decoder start
    token), :meth:`add` marks each step's sampled tokens. Ids >= V (special tokens past the output layer) are
    never sampled and carry no penalty (transformers drops them too).
    """

    def __init__(self, rows: int, vocab: int):
        self.vocab = vocab
        self.mask = np.zeros((rows, vocab), dtype=bool)

    def reset(self, slots, ids: torch.Tensor, mask: torch.Tensor, spec: ModelSpec) -> None:
        """Rows ``slots`` (a list or array of k indices) now hold the prompts ``ids`` / ``mask`` (k, Tp)."""
        slots = np.asarray(slots, dtype=np.int64)
        self.mask[slots] = False
        if spec.kind == "seq2seq":  # decoder ids: the start token, then the sampled ones
            start = spec.decoder_start_id if spec.decoder_start_id is not None else spec.pad_id
            if 0 <= start < self.vocab:
                self.mask[slots, start] = True
            return
        r, c = np.nonzero(mask.cpu().numpy() != 0)
        tok = ids.cpu().numpy()[r, c]
        keep = tok < self.vocab
        self.mask[slots[r[keep]], tok[keep]] = True

    def add(self, tok: np.ndarray, rows: np.ndarray) -> None:
        """Mark ``tok[i]`` seen for every row i where ``rows`` (bool, (rows,)) is set."""
        r = np.nonzero(rows)[0]
        t = tok[r]
        keep = (t >= 0) & (t < self.vocab)
        self.mask[r[keep], t[keep]] = True


def seen_per_position(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, vocab: int,
                      spec: ModelSpec) -> torch.Tensor:
    """(B, Tr, V) bool: the tokens seen before each response position (what :class:`SeenTokens` holds when that
    position is sampled): the prompt's (as :meth:`SeenTokens.reset`) and the response's earlier tokens. On the host
    (:func:`repetition_penalty` moves it to the logits' device)."""
    prompt_ids, prompt_mask, response_ids = prompt_ids.cpu(), prompt_mask.cpu(), response_ids.cpu()
    b, tr = response_ids.shape
    start = SeenTokens(b, vocab)
    start.reset(np.arange(b), prompt_ids, prompt_mask, spec)
    seen = torch.from_numpy(start.mask)[:, None, :].repeat(1, tr, 1)  # (B, Tr, V)
    if tr > 1:
        prev = response_ids[:, :-1].clamp(min=0)  # (B, Tr-1): the token sampled at position t-1
        hit = torch.zeros(b, tr - 1, vocab + 1, dtype=torch.int32)  # column V absorbs ids past the output layer
        hit.scatter_(-1, prev.clamp(max=vocab)[..., None], 1)
        seen[:, 1:] |= hit[..., :vocab].cumsum(1) > 0  # seen at position t: sampled at some s < t
    return seen
