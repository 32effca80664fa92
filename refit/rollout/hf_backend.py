"""``HFGenerateEngine``: rollouts from transformers' ``generate()``, what TRL-style trainers run today.

It exists as the baseline of ``refit bench ppo`` (same learner, rollouts from ``generate()``)
and implements the Engine protocol so the cycle can run on it unchanged. Log-probs come from
``generate``'s own per-step raw logits (``output_logits``), processed by the same functions as
every Refit backend. Scoring and weight updates go through the PyTorch reference backend.
The ``on_step`` hook is fed by :class:`HFStepClock`, a pass-through logits processor.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from refit.rollout.engine import ModelSpec, StepEvent, StepHook, check_prompts, pad_prompts
from refit.rollout.processors import seen_per_position
from refit.rollout.sampling import chosen_logprobs, process_logits, topk_logprobs
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import RolloutBatch, SamplingParams


class HFStepClock(LogitsProcessor):
    """A pass-through logits processor that reports ``generate()``'s steps as ``StepEvent`` records.

    HF calls it once per position, after that position's forward and before its sample, so an event
    covers the previous sample plus this forward (the first: from construction to the prefill's
    logits). ``start``: where the response begins in HF's ``input_ids`` (the padded prompt length
    for decoder-only models, 1 for T5's decoder ids after the start token); ``stops``: the ids that
    end a row, to count the rows still generating.
    """

    def __init__(self, hook: StepHook, start: int, stops: torch.Tensor):
        self.hook, self.start, self.stops, self.t = hook, start, stops, time.perf_counter()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        seconds = time.perf_counter() - self.t
        done = torch.isin(input_ids[:, self.start:], self.stops).any(-1)  # (B,) stopped before this position
        step = input_ids.shape[1] - self.start
        self.hook(StepEvent("prefill" if step == 0 else "decode", step, seconds, int((~done).sum())))
        self.t = time.perf_counter()
        return scores


class HFGenerateEngine(TorchEngine):
    """Generation with ``model.generate`` (KV cache, HF sampling); score/update as the torch reference."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams = SamplingParams(),
                 on_step: StepHook | None = None) -> RolloutBatch:
        spec: ModelSpec = self.spec
        check_prompts(prompts, spec.max_len, sampling.max_new_tokens, spec.vocab_size)
        ids, mask, index = pad_prompts(prompts, sampling.n, spec)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        stops = torch.tensor(sorted({spec.eos_id, *sampling.stop_ids}))
        kw = dict(do_sample=not sampling.greedy, max_new_tokens=sampling.max_new_tokens,
                  temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p,
                  min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
                  pad_token_id=spec.pad_id, eos_token_id=stops.tolist(), output_logits=True,
                  return_dict_in_generate=True)
        if on_step is not None:
            start = 1 if spec.kind == "seq2seq" else ids.shape[1]
            kw["logits_processor"] = LogitsProcessorList([HFStepClock(on_step, start, stops)])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
        resp = out.sequences if spec.kind == "seq2seq" else out.sequences[:, ids.shape[1]:]
        if spec.kind == "seq2seq":
            resp = resp[:, 1:]  # drop decoder_start
        logits = torch.stack(out.logits, 1).float()  # (B, Tr, V) raw
        seen = (seen_per_position(ids, mask, resp, logits.shape[-1], spec)
                if sampling.repetition_penalty != 1.0 else None)  # HF's penalty set at each position
        proc, plain = chosen_logprobs(logits, process_logits(logits, sampling, seen), resp, sampling.temperature)
        is_stop = torch.isin(resp, stops)
        before = torch.cumsum(is_stop.long(), 1) - is_stop.long()  # stops strictly before each position
        rmask = (before == 0).float()
        resp = torch.where(rmask.bool(), resp, spec.pad_id)
        top = topk_logprobs(logits, sampling.return_topk, sampling.temperature) if sampling.return_topk else None
        batch = RolloutBatch(
            prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=rmask,
            rollout_logprobs=proc * rmask, rollout_plain_logprobs=plain * rmask, prompt_index=index,
            weights_version=self._version, sampling=sampling, is_seq2seq=spec.kind == "seq2seq",
            topk_logprobs=None if top is None else top[0] * rmask[..., None],
            topk_ids=None if top is None else torch.where(rmask.bool()[..., None], top[1], spec.pad_id),
            pad_id=spec.pad_id, eos_id=spec.eos_id)
        return batch.check()
