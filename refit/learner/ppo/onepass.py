"""The on-policy update in one learner pass: the old log-probs come from the update's own forward, micro-batch by
micro-batch, and the reference is scored per micro-batch (on a thread one micro-batch ahead with ``reference_ahead``).

With one epoch and one minibatch the update's forward of a row runs before the only optimizer step, so its
log-probs ARE the pre-update ("old") ones: TRL's GRPO takes them the same way (``old_per_token_logps =
per_token_logps.detach()`` at ``num_iterations`` 1). The run takes this route when its config allows it
(refit.learner.ppo.route.StreamingUpdate, chosen once by ``choose_route``); everything else keeps the separate scoring
pass (:func:`refit.learner.ppo.experience.make_experience`):

- a value head (GAE): the advantages need every row's values before any row's loss;
- several epochs or minibatches: later passes need the pre-update log-probs of rows already stepped on;
- a KL penalty in the reward (``kl_penalty: reward`` at ``kl_coef`` > 0): the group advantages need every row's KL;
- ``mismatch_correction: seq_mask``: the loss's token count needs every row's drop decision;
- LoRA dropout > 0: the update's forward has dropout, the old log-probs must not;
- torchrun (rank 0 scores rows that other ranks update).

Under bf16 autocast (refit.learner.run.precision) each micro-batch's forward and its reference run under it.

The loss, gradients and metrics equal the two-pass update's within fp32 summation noise (tests/test_onepass.py), and
the probe check of an unchecked push runs after every row's forward and before the optimizer step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from refit.learner import losses as L
from refit.learner.ppo.objective import Norm, clip_scores, loss_mask
from refit.learner.ppo.experience import (corrections, experience_stats, group_advantages, needs_reference,
                                          per_token_rewards, reference_logits)
from refit.learner.ppo.update import Experience, UpdateSettings, _combine, micro_objective
from refit.learner.run.policy import response_forward, vocab_size


def streamable_loss(s: UpdateSettings) -> bool:
    """The loss splits over any rows in batch order: not TRL's ``bnpo``, entropy mask, entropy bonus (fixed or
    adaptive) or router loss, whose normalisers are those of TRL's gradient-accumulation slices
    (refit/learner/ppo/objective.py)."""
    bonus = s.entropy_coef or (s.entropy_ctrl is not None and s.entropy_ctrl.adaptive)
    return s.loss_type == "token" or (s.loss_type != "bnpo" and s.top_entropy_quantile >= 1 and not bonus
                                      and not s.router_aux_loss_coef)


class ReferenceAhead:
    """The reference's logits of each micro-batch (``parts``: RolloutBatch each), scored one micro-batch ahead of the
    learner: on a thread when the reference is an engine (ONNX Runtime releases the GIL, so it runs on the engine's
    threads while the learner's forward and backward run on PyTorch's), inline for a PyTorch reference (one thread
    pool; nothing to overlap). Scored at the temperature the rollout was sampled at (``rollout.sampling``)."""

    def __init__(self, ref, parts: list, vocab: int, ahead: bool):
        self.ref, self.parts, self.vocab = ref, parts, vocab
        threaded = ahead and not isinstance(ref, torch.nn.Module)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="refit-ref") if threaded else None
        self.pending: dict[int, Future] = {}
        self._submit(0)

    def _score(self, j: int) -> torch.Tensor:
        return reference_logits(self.ref, self.parts[j], slice(None), self.vocab)

    def _submit(self, j: int) -> None:
        if self.pool is not None and j < len(self.parts):
            self.pending[j] = self.pool.submit(self._score, j)

    def take(self, j: int) -> torch.Tensor:
        """Micro-batch ``j``'s reference logits (b, Tr, V); micro-batch ``j + 1``'s are started."""
        if self.pool is None:
            return self._score(j)
        out = self.pending.pop(j).result()
        self._submit(j + 1)
        return out

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending.values():
                f.cancel()
            self.pool.shutdown(wait=True)


WIDTH_STEP = 8  # each forward's prompt and response widths are multiples of this (RolloutBatch.trimmed): a few shapes
# over a run, so oneDNN's primitive cache (one entry per shape) and the heap's blocks are reused instead of growing
# step after step (small-gpt2 GRPO, 30 steps: resident set 898 -> 1493 MB and rising at exact widths, flat at 1121
# MB from step 16 at multiples of 8; docs/fast-by-default.md, "Micro-batches")


def micro_batches(rollout, per: int) -> list[torch.Tensor]:
    """The update's row groups of at most ``per`` rows: the rows by response length, longest first (ties in batch
    order), so that each group, cut to its own longest row rounded up to :data:`WIDTH_STEP`
    (:meth:`RolloutBatch.trimmed`), forwards little of the padding a batch-wide width carries; each group's rows in
    batch order. The widest group comes first, so the largest forward's blocks are the ones the later forwards
    reuse."""
    order = torch.argsort(rollout.response_mask.sum(1), descending=True, stable=True)
    return [order[a:a + per].sort().values for a in range(0, len(order), per)]


def onepass_update(cfg, s: UpdateSettings, model, optimizer, scheduler, rollout, scores: torch.Tensor, ref,
                   kl_coef: float, before_step: Callable[[dict[str, float]], None] | None = None,
                   per_func: list | None = None) -> tuple[Experience, dict[str, float], dict[str, float]]:
    """The step's one optimizer step over micro-batches of at most ``s.micro_rows`` rows (and at least
    ``s.gradient_accumulation_steps`` of them; rows grouped by length, :func:`micro_batches`), each forwarded once
    without its all-padding columns: its detached log-probs are the old log-probs, the truncated importance weights
    and the reference's KL term are made from them, then its loss is backpropagated. The loss is a sum over tokens
    normalised by the batch's, so the grouping changes nothing but fp32 summation order. ``before_step(stats)``
    (the probe check of an unchecked push) runs once every row has been forwarded, before the optimizer step.

    Returns (experience, the experience stats as :func:`make_experience` gives them, the update stats as
    :func:`ppo_update` gives them)."""
    b = rollout.num_rows
    per = -(-b // s.gradient_accumulation_steps)  # gradient_accumulation_steps: a floor on the forwards
    per = min(per, s.micro_rows) if s.micro_rows else per
    rollout = rollout.padded(WIDTH_STEP)  # every group's width a multiple of WIDTH_STEP, within the batch's
    exp, adv_stats = _experience_shell(cfg, rollout, scores, per_func)
    groups = micro_batches(rollout, per)
    parts = [rollout.rows(r).trimmed(WIDTH_STEP) for r in groups]
    with_ref = needs_reference(cfg, kl_coef)
    refs = ReferenceAhead(ref, parts, vocab_size(model), cfg.reference_ahead) if with_ref else None
    n_tokens = exp.mask.sum().clamp(min=1.0)
    norm = n_tokens if s.loss_type == "token" else Norm(tokens=n_tokens, dapo_tokens=n_tokens, seqs=b,
                                                        micro_tokens=n_tokens, scale=1)
    ent, exact = torch.zeros_like(exp.old_logprobs), torch.zeros_like(exp.old_logprobs) if with_ref else None
    params = [p for p in model.parameters() if p.requires_grad]
    dev = next(model.parameters()).device.type
    optimizer.zero_grad(set_to_none=True)
    mb: dict[str, list[float]] = {}
    try:
        for j, (r, part) in enumerate(zip(groups, parts)):
            w = part.response_ids.shape[1]
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=s.autocast_bf16):  # the reference's too
                out = response_forward(model, part.prompt_ids, part.prompt_mask, part.response_ids,
                                       rollout.is_seq2seq, exp.temperature)
                ref_logits = refs.take(j).to(out.logits.device) if refs is not None else None
            ids = part.response_ids.to(out.logits.device)
            st = L.token_stats(out.logits, ids, ref_logits)
            old = st.logprobs.detach().cpu()
            exp.old_logprobs[r, :w] = old
            ent[r, :w] = st.entropy.detach().cpu()
            if ref_logits is not None:
                exp.ref_logprobs[r, :w] = L.token_stats(ref_logits, ids).logprobs.cpu()
                exact[r, :w] = st.exact_kl.detach().cpu()
            del ref_logits
            wts, _, _ = corrections(cfg, part, old, slice(None), exp.mask[r, :w])
            if wts is not None:
                exp.is_weights[r, :w] = wts
            loss, stats = micro_objective(out, st, exp.part(r, part), slice(None), norm, s)
            loss.backward()
            del out, st, loss
            for key, v in stats.items():
                mb.setdefault(key, []).append(float(v))
    finally:
        if refs is not None:
            refs.close()
    ref_lp = exp.ref_logprobs if with_ref else None
    stats = {**experience_stats(cfg, rollout, exp.old_logprobs, ent, ref_lp, exact, exp.is_weights), **adv_stats}
    if before_step is not None:
        before_step(stats)
    upd = {key: _combine(key, v, over_micro_batches=True) for key, v in mb.items()}
    upd["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm))
    optimizer.step()
    scheduler.step()
    return exp, stats, upd


def _experience_shell(cfg, rollout, scores: torch.Tensor, per_func: list | None = None
                      ) -> tuple[Experience, dict[str, float]]:
    """The batch's :class:`Experience` with its advantages (from the scores alone: no KL in the reward) and room
    for the log-probs and weights that the micro-batches fill in; (experience, the advantage stats)."""
    mask, trunc_stats = loss_mask(cfg, rollout)
    zeros = torch.zeros_like(mask)
    rewards = per_token_rewards(clip_scores(cfg, scores), zeros, rollout.response_mask, 0.0)  # every row's score
    adv, gstats = group_advantages(rewards, mask, cfg.advantage_estimator, cfg.num_generations, cfg.scale_rewards,
                                   cfg.normalize_advantages, per_func)
    exp = Experience(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, response_ids=rollout.response_ids,
                     mask=mask, old_logprobs=zeros.clone(), ref_logprobs=zeros.clone(), values=zeros.clone(),
                     advantages=adv, returns=zeros.clone(),
                     is_weights=zeros.clone() if cfg.correction == "tis" else None,
                     temperature=rollout.sampling.temperature)
    return exp, {**{f"advantage/{k}": float(v) for k, v in gstats.items()}, **trunc_stats}


__all__ = ["ReferenceAhead", "micro_batches", "onepass_update", "streamable_loss"]
