"""``Sampling``: the sampler's config section, shared by ``refit generate`` and ``refit ppo``.

Both jobs hold it as a :data:`refit.core.parsing.FLAT` section, so its fields keep the spelling they had
as the jobs' own fields: ``--top_k 20``, ``top_k: 20`` in YAML and in a saved ``config.yaml``. The
temperature is not in it: PPO and distill keep theirs in ``rollout.temperature``, where the learner
reads it too (``refit generate`` has its own ``--temperature``).
"""

from __future__ import annotations

from dataclasses import dataclass

from refit.core.parsing import opt


@dataclass(frozen=True)
class Sampling:
    """How the sampler truncates the distribution (HF's order: temperature, then top-k, then top-p)."""

    top_k: int = opt(0, "sample among the k most likely tokens only (0: off); PPO corrects for the truncation "
                        "with mismatch_correction")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens with this much probability (1: off)")
