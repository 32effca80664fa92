"""Logit processing and sampling, shared by every backend (gpt-fast style small functions).

Every backend feeds its float32 logits through these functions with one ``torch.Generator``
per ``generate`` call, so the same seed gives the same tokens on any backend whose logits
agree. Semantics follow HF's ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` ->
``TopPLogitsWarper`` (ties at the k-th value are kept; top-p keeps the smallest set whose
cumulative probability reaches ``top_p`` and always the most likely token).

Sampling uses the exponential-race trick (gpt-fast ``multinomial_sample_one_no_sync``):
``argmax(logp - log(E))`` with ``E ~ Exp(1)`` draws exactly from ``softmax(logp)``, one (B, V)
draw per step whatever the row state, so the random stream never depends on which rows stopped.
"""

from __future__ import annotations

import torch

from rollout.types import SamplingParams

NEG_INF = float("-inf")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from ``seed`` (nondeterministic when None)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def plain_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 log_softmax(logits / temperature), no truncation."""
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


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) float32 log-probs of the distribution actually sampled from.

    Temperature, then top-k, then top-p, renormalised; removed tokens are -inf. For greedy the
    distribution is a point mass on the argmax (log-prob 0 there, -inf elsewhere).
    """
    if params.greedy:
        out = torch.full_like(logits, NEG_INF, dtype=torch.float32)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    scores = logits.float() / params.temperature
    scores = top_p_filter(top_k_filter(scores, params.top_k), params.top_p)
    return torch.log_softmax(scores, dim=-1)


def sample(processed_logprobs: torch.Tensor, generator: torch.Generator, greedy: bool = False) -> torch.Tensor:
    """(B, V) processed log-probs -> (B,) int64 token ids (argmax when greedy; no draw then)."""
    if greedy:
        return processed_logprobs.argmax(-1)
    race = torch.empty_like(processed_logprobs).exponential_(1.0, generator=generator)
    return (processed_logprobs - race.log()).argmax(-1)


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


def sample_step(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """One decode step on (B, V) logits: (ids, processed log-probs, plain log-probs, top-k or None)."""
    processed = process_logits(logits, params)
    ids = sample(processed, generator, params.greedy)
    proc, plain = chosen_logprobs(logits, processed, ids, params.temperature)
    top = topk_logprobs(logits, params.return_topk, params.temperature) if params.return_topk else None
    return ids, proc, plain, top
