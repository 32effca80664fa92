"""``Sampling``: the sampler's config section (temperature, top-k, top-p), shared by ``refit generate``,
``refit ppo`` and ``refit distill``, and the one place a job's :class:`~refit.rollout.types.SamplingParams` is made.

Every job holds it as a :data:`refit.core.parsing.FLAT` section, so its fields are spelled without a prefix:
``--temperature 0.7 --top_k 20`` on the command line, ``temperature: 0.7`` in YAML and in a saved
``config.yaml``. (``rollout.temperature``, where PPO and distill kept it before, is read as a deprecated name.)
PPO's learner scores at the same ``temperature`` the engine sampled with; top-k/top-p are the sampler's alone
(PPO corrects for the truncation with ``mismatch_correction``).
"""

from __future__ import annotations

from dataclasses import dataclass

from refit.core.parsing import opt
from refit.rollout.types import SamplingParams


@dataclass(frozen=True)
class Sampling:
    """How the sampler draws tokens (HF's order: temperature, then top-k, then top-p)."""

    temperature: float = opt(1.0, "divide the logits by this before sampling (> 0); PPO's learner scores at it too")
    top_k: int = opt(0, "sample among the k most likely tokens only (0: off); PPO corrects for the truncation "
                        "with mismatch_correction")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens with this much probability (1: off)")

    def params(self, max_new_tokens: int, **kw) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this section; ``kw`` sets the call's own fields (``seed``,
        ``n``, ``stop_ids``, ``return_topk``, ``greedy``)."""
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, **kw)
