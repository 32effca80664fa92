"""Distillation losses: generalized JSD (GKD), forward/reverse KL, sequence-level KD, top-k KL.

Pure torch functions; shapes: ``B`` batch, ``T`` tokens, ``V`` vocab, ``k`` top-k.
``student_logits`` / ``teacher_logits`` are (B, T, V) and position-aligned
(``[:, t]`` predicts the same token for both).  ``mask`` is (B, T), 1 for real
response tokens.  Every loss is a per-token divergence summed over the vocab
and reduced with the masked token mean (``num_tokens`` for micro-batching, see
:func:`refit.learner.losses.token_mean`).  Each loss returns ``(loss, stats)`` with
detached stats.

``temperature`` here is the *loss* temperature (both distributions are
``softmax(logits / temperature)``), independent of the sampling temperature
used to generate the sequences.  Teacher tensors are not detached: compute
them under ``torch.no_grad()``.  Logits must be finite; computation happens in
the input dtype (upcast bf16 logits first if needed).
"""

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from refit.learner.losses.common import chunked_apply, logprobs_from_logits, masked_mean, token_mean

Stats = Dict[str, torch.Tensor]
Number = Union[float, int, torch.Tensor]


def _ones_mask(logits: torch.Tensor) -> torch.Tensor:
    return torch.ones(logits.shape[:2], dtype=logits.dtype, device=logits.device)


def _gjsd_per_token(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """(B, c, V) x 2 -> (B, c) generalized JSD, TRL ``GKDTrainer.generalized_jsd_loss`` math."""
    if temperature != 1.0:
        student, teacher = student / temperature, teacher / temperature
    s_lp = F.log_softmax(student, dim=-1)
    t_lp = F.log_softmax(teacher, dim=-1)
    # F.kl_div(input=log q, target=log p, log_target=True) = p * (log p - log q) -> KL(p || q).
    if beta == 0.0:
        jsd = F.kl_div(s_lp, t_lp, reduction="none", log_target=True)  # KL(teacher || student)
    elif beta == 1.0:
        jsd = F.kl_div(t_lp, s_lp, reduction="none", log_target=True)  # KL(student || teacher)
    else:
        b = torch.tensor(beta, dtype=s_lp.dtype, device=s_lp.device)
        mix_lp = torch.logsumexp(torch.stack([s_lp + torch.log1p(-b), t_lp + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mix_lp, t_lp, reduction="none", log_target=True)  # KL(teacher || M)
        kl_student = F.kl_div(mix_lp, s_lp, reduction="none", log_target=True)  # KL(student || M)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(dim=-1)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         mask: Optional[torch.Tensor] = None, beta: float = 0.5, temperature: float = 1.0,
                         chunk_size: Optional[int] = None,
                         num_tokens: Optional[Number] = None) -> Tuple[torch.Tensor, Stats]:
    """Generalized Jensen-Shannon divergence per token, masked token mean.

    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), Sec. 2, generalized JSD:
    ``JSD(beta)(P || Q) = beta * KL(P || M) + (1 - beta) * KL(Q || M)``,
    ``M = beta * P + (1 - beta) * Q`` with P = teacher, Q = student.

    Convention (identical to TRL's ``generalized_jsd_loss``):

    * ``beta == 0``: forward KL, ``KL(teacher || student)`` =
      ``F.kl_div(student_logprobs, teacher_logprobs, log_target=True).sum(-1)``.
    * ``beta == 1``: reverse KL, ``KL(student || teacher)``.
    * ``0 < beta < 1``: the JSD above.  The endpoints are special cases: the JSD
      formula itself tends to 0 as beta -> 0 or 1 (it behaves like
      ``beta * KL(teacher || student)`` near 0 and ``(1 - beta) * KL(student || teacher)``
      near 1).  ``beta = 0.5`` is symmetric in student/teacher.

    Args:
        student_logits, teacher_logits: (B, T, V).
        mask: (B, T) or None (all tokens valid).
        beta: in [0, 1].
        temperature: loss temperature applied to both logits.
        chunk_size: compute in chunks of T so only a few (B, chunk, V) temporaries
            exist (checkpointed per chunk when grad is needed); equals unchunked.
        num_tokens: full-batch valid-token count for micro-batching.
    Returns:
        ``(loss, {"jsd": ...})``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    beta = float(beta)
    per_token = chunked_apply(
        lambda s, t: _gjsd_per_token(s, t, beta, temperature), [student_logits, teacher_logits], chunk_size
    )
    mask = _ones_mask(per_token) if mask is None else mask
    loss = token_mean(per_token, mask, num_tokens)
    return loss, {"jsd": loss.detach()}


def _jsd_end(beta: float, stat: str, name: str, doc: str):
    """``generalized_jsd_loss`` at one end of beta, its loss under its own stat name: the two plain KLs."""

    def loss_fn(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: Optional[torch.Tensor] = None,
                temperature: float = 1.0, chunk_size: Optional[int] = None,
                num_tokens: Optional[Number] = None) -> Tuple[torch.Tensor, Stats]:
        loss, _ = generalized_jsd_loss(student_logits, teacher_logits, mask, beta, temperature, chunk_size, num_tokens)
        return loss, {stat: loss.detach()}

    loss_fn.__name__ = loss_fn.__qualname__ = name
    loss_fn.__doc__ = f"{doc}\n\n``generalized_jsd_loss(beta={beta:g})``; shapes as there.  Stats: ``{stat}``."
    return loss_fn


forward_kl_loss = _jsd_end(0.0, "forward_kl", "forward_kl_loss",
                           "Forward KL(teacher || student) per token (mode-covering; standard KD, Hinton et al. 2015).")
reverse_kl_loss = _jsd_end(1.0, "reverse_kl", "reverse_kl_loss",
                           "Reverse KL(student || teacher) per token (mode-seeking; MiniLLM, Gu et al. 2024).")


def teacher_token_ce_loss(student_logits: torch.Tensor, teacher_token_ids: torch.Tensor, mask: torch.Tensor,
                          temperature: float = 1.0, chunk_size: Optional[int] = None,
                          num_tokens: Optional[Number] = None) -> Tuple[torch.Tensor, Stats]:
    """Sequence-level knowledge distillation (Kim & Rush 2016, "Sequence-Level Knowledge Distillation").

    Cross-entropy of the student on teacher-generated tokens:
    ``loss = token_mean(-log softmax(student_logits / temperature)[teacher_token_ids])``.

    Args:
        student_logits: (B, T, V) aligned with ``teacher_token_ids`` (B, T).
        mask: (B, T).
    Returns:
        ``(loss, stats)``: ``teacher_token_ce`` and ``teacher_token_acc`` (masked
        fraction where the student's argmax equals the teacher token).
    """
    nll = -chunked_apply(
        lambda z, ids: logprobs_from_logits(z, ids, temperature), [student_logits, teacher_token_ids], chunk_size
    )
    loss = token_mean(nll, mask, num_tokens)
    with torch.no_grad():
        hits = (student_logits.argmax(dim=-1) == teacher_token_ids).to(nll.dtype)
        acc = masked_mean(hits, mask)
    return loss, {"teacher_token_ce": loss.detach(), "teacher_token_acc": acc.detach()}


def _topk_kl_per_token(
    student: torch.Tensor, t_lp: torch.Tensor, ids: torch.Tensor, temperature: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B,c,V), (B,c,k), (B,c,k) -> KL, teacher tail mass, student tail mass, each (B, c)."""
    z = student / temperature if temperature != 1.0 else student
    s_lp = z.gather(-1, ids.long()) - torch.logsumexp(z, dim=-1, keepdim=True)  # (B, c, k)
    # Entries with teacher log-prob -inf are padding: they belong to the tail for both
    # distributions.  Use a finite floor instead of -inf so no inf*0 / nan gradients appear.
    valid = t_lp > float("-inf")
    floor = torch.finfo(s_lp.dtype).min
    t_safe = torch.where(valid, t_lp.to(s_lp.dtype), torch.full_like(s_lp, floor))
    s_safe = torch.where(valid, s_lp, torch.full_like(s_lp, floor))
    p = torch.exp(t_safe)
    head = torch.where(valid, p * (t_safe - s_safe), torch.zeros_like(p)).sum(dim=-1)
    # Tail masses: 1 - sum(exp(lp)) = -expm1(logsumexp(lp)); clamp >= 0 against rounding.
    p_tail = (-torch.expm1(torch.logsumexp(t_safe, dim=-1))).clamp_min(0.0)
    q_tail = (-torch.expm1(torch.logsumexp(s_safe, dim=-1))).clamp_min(0.0)
    tiny = torch.finfo(s_lp.dtype).tiny
    log_ratio_tail = torch.log(p_tail.clamp_min(tiny)) - torch.log(q_tail.clamp_min(tiny))
    tail = torch.where(p_tail > 0, p_tail * log_ratio_tail, torch.zeros_like(p_tail))
    return (head + tail).clamp_min(0.0), p_tail, q_tail


def topk_kl_loss(student_logits: torch.Tensor, teacher_topk_logprobs: torch.Tensor, teacher_topk_ids: torch.Tensor,
                 mask: torch.Tensor, temperature: float = 1.0, chunk_size: Optional[int] = None,
                 num_tokens: Optional[Number] = None) -> Tuple[torch.Tensor, Stats]:
    """Forward KL(teacher || student) on the teacher's top-k tokens plus one tail bucket.

    For each token, both distributions are coarse-grained to k + 1 outcomes: the k
    teacher ids and "everything else".  Teacher tail mass ``1 - sum_i exp(t_i)``,
    student tail mass ``1 - sum_i q(id_i)``;
    ``KL = sum_i p_i log(p_i / q_i) + p_tail log(p_tail / q_tail)``.
    This is a true KL between two (k+1)-way distributions, hence >= 0, and by the
    data-processing inequality <= the full-vocab KL, with equality when k == V.
    The result is clamped at 0 only against rounding (teacher top-k mass slightly > 1).

    Args:
        student_logits: (B, T, V); divided by ``temperature`` before the softmax.
        teacher_topk_logprobs: (B, T, k) teacher log-probs, normalised over the full
            vocab at the intended loss temperature (the caller's job; they are not
            re-tempered here).  ``-inf`` entries are treated as padding (their ids
            go to the tail bucket for both distributions).
        teacher_topk_ids: (B, T, k) distinct token ids.
        mask: (B, T).
        chunk_size, num_tokens: as in :func:`generalized_jsd_loss`.
    Returns:
        ``(loss, stats)``: ``topk_kl``, ``teacher_tail_mass``, ``student_tail_mass``
        (masked means).
    """

    def _fn(s: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kl, p_tail, q_tail = _topk_kl_per_token(s, t, ids, temperature)
        return torch.stack([kl, p_tail.detach(), q_tail.detach()], dim=-1)  # (B, c, 3)

    out = chunked_apply(_fn, [student_logits, teacher_topk_logprobs, teacher_topk_ids], chunk_size)
    per_token, p_tail, q_tail = out.unbind(dim=-1)
    loss = token_mean(per_token, mask, num_tokens)
    with torch.no_grad():
        stats = {
            "topk_kl": loss.detach(),
            "teacher_tail_mass": masked_mean(p_tail, mask).detach(),
            "student_tail_mass": masked_mean(q_tail, mask).detach(),
        }
    return loss, stats


__all__ = ["generalized_jsd_loss", "forward_kl_loss", "reverse_kl_loss", "teacher_token_ce_loss", "topk_kl_loss"]
