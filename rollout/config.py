"""The rollout's config sections: ``Sampling`` (temperature, top-k, top-p, min-p, repetition penalty), shared by
``refit generate``, ``refit ppo`` and ``refit distill``, and the one place a job's :class:`~refit.rollout.types.SamplingParams` is made; and
``RolloutSection``, the jobs' engines (backend, threads, weight pushes and the probe after each).

Every job holds ``Sampling`` as a :data:`refit.core.parsing.FLAT` section, so its fields are spelled without a prefix:
``--temperature 0.7 --top_k 20`` on the command line, ``temperature: 0.7`` in YAML and in a saved
``config.yaml``. (``rollout.temperature``, where PPO and distill kept it before, is read as a deprecated name.)
PPO's learner scores at the same ``temperature`` the engine sampled with; top-k/top-p/min-p and the repetition
penalty are the sampler's alone, as in TRL (the engine's ``rollout_logprobs`` are those of the processed
distribution; PPO corrects for the difference with ``mismatch_correction: tis``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refit.core.parsing import check, opt
from refit.rollout.types import SamplingParams

Backend = Literal["onnxruntime", "torch", "tensorrt", "hf"]  # a job's engine backend


@dataclass(frozen=True)
class Sampling:
    """How the sampler draws tokens (HF's order: repetition penalty, temperature, top-k, top-p, min-p)."""

    temperature: float = opt(1.0, "divide the logits by this before sampling (> 0); PPO's learner scores at it too")
    top_k: int = opt(0, "sample among the k most likely tokens only (0: off); PPO corrects for the truncation "
                        "with mismatch_correction")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens with this much probability (1: off)")
    min_p: float = opt(0.0, "drop tokens less likely than min_p x the most likely one, after top-k/top-p (0: off; "
                            "HF's MinPLogitsWarper)")
    repetition_penalty: float = opt(1.0, "a token already in the prompt or the completion has its logit x divided "
                                         "by this (x > 0) or multiplied by it (x < 0) before the temperature (1: off; "
                                         "HF's RepetitionPenaltyLogitsProcessor). Like top-k/top-p/min-p it is the "
                                         "sampler's alone: the learner scores at the temperature, as TRL")

    def params(self, max_new_tokens: int, **kw) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this section; ``kw`` sets the call's own fields (``seed``,
        ``n``, ``stop_ids``, ``return_topk``, ``greedy``)."""
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty, **kw)


@dataclass(frozen=True)
class RolloutSection:
    """The rollout engines: backend, threads, weight pushes and the probe after each (sampling: :class:`Sampling`)."""

    backend: Backend = opt("onnxruntime", "engine backend ('hf': transformers generate(), the PPO baseline)")
    engine_threads: int = opt(0, "engine intra-op threads (0 = runtime default)")
    engine_shards: int = opt(0, "onnxruntime: a generate call's rows cut at prompt boundaries into this many shards, "
                                "each decoded on a thread of its own over the same sessions (engine_threads shared "
                                "out among them, at least one each; rows unchanged); the reference engine scores "
                                "in as many row ranges. 0 = auto: one per engine thread for a small model at 16+ "
                                "rows a shard, else 1 (refit.rollout.decode.auto_shards; its data: "
                                "docs/engine-step.md)")
    sync_every: int = opt(1, "push weights into the engine every N steps (on-policy batches lag by at most N-1 "
                             "updates)")
    probe_tol: float = opt(1e-3, "max |logprob diff| engine vs learner on the probe batch after a push")
    quantize: Literal["none", "int8"] = opt(
        "none", "rollout engine precision: int8 runs the engine's linear layers in int8 (export --quantize int8; "
                "onnxruntime: int8 matmuls; tensorrt: int8 weights through Q/DQ, fp32 matmuls), pushes re-quantized; the probe then compares the engine with the learner's "
                "weights quantized the same way, the reference and KL stay fp32, and PPO's mismatch_correction "
                "'auto' becomes tis")
    push_via: Literal["memory", "file"] = opt(
        "memory", "onnxruntime: how a weight push reaches the engine. memory: the mapped weights handed to ONNX "
                  "Runtime, which copies them (fastest; the push briefly holds ~2x the model more); file: written "
                  "one tensor at a time to a scratch graph beside the engine folder, which ONNX Runtime maps (a "
                  "write of the model per push, and far less memory: docs/families.md)")
    probe_size: int = opt(4, "rows in the fixed probe batch")
    probe_tokens: int = opt(16, "response tokens per probe row (0: the full response length). The probe's learner "
                                "forward is most of a push's cost; a short probe still runs every weight and checks "
                                "every push")
    max_staleness: int = opt(
        0, "PPO: 0 = generate, then update (synchronous); k >= 1 = generate the next batch on a background thread "
           "while the learner updates on this one (one batch in flight, so a batch is one weight push behind the "
           "learner); a batch more than k pushes older than the learner's weights is refused in one line. The "
           "engine gets rollout.engine_threads intra-op threads (0: half of torch's), the learner the rest; every "
           "push waits for the generation in flight and is checked on the probe batch; mismatch_correction 'auto' "
           "becomes tis (the engine's log-probs are the behaviour policy)")

    def __post_init__(self):
        check([(self.engine_shards > 1 and self.backend != "onnxruntime",  # (0, auto: 1 on other backends)
                f"rollout.engine_shards = {self.engine_shards} needs rollout.backend onnxruntime (the {self.backend} "
                "backend decodes a call's rows in one loop)")])
