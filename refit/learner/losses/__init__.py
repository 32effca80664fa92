"""Pure tensor losses and estimators (torch only): shapes in the docstrings, papers cited, ``(loss, stats)``.

- :mod:`refit.learner.losses.common`: masked reductions, log-probs, entropy, KL estimators k1/k2/k3, exact KL
- :mod:`refit.learner.losses.ppo`: GAE, clipped PPO policy/value losses, mismatch corrections, adaptive KL
- :mod:`refit.learner.losses.distill`: generalized JSD (GKD), forward/reverse KL, top-k KL, sequence-level KD CE
- :mod:`refit.learner.losses.advantages`: group baselines without a critic (RLOO leave-one-out, GRPO group mean/std)
- :mod:`refit.learner.losses.grpo`: TRL 1.16's GRPO loss types, GSPO, two-sided clipping, entropy and off-policy masks, RLOO's sequence loss
- :mod:`refit.learner.losses.chunked`: log-prob, entropy and exact KL in one pass chunked over tokens (large vocabularies)

Everything is re-exported here, so ``from learner import losses as L`` reads ``L.kl_k3``, ``L.compute_gae``.
A ``temperature`` here is a plain float argument, as every other number of a pure tensor function; the jobs pass
the temperature the engine sampled at (``RolloutBatch.sampling``, the PPO ``Experience``), never one of their own.
"""

from refit.learner.losses.common import *  # noqa: F401,F403
from refit.learner.losses.distill import *  # noqa: F401,F403
from refit.learner.losses.ppo import *  # noqa: F401,F403
from refit.learner.losses.advantages import *  # noqa: F401,F403
from refit.learner.losses.grpo import *  # noqa: F401,F403
from refit.learner.losses.chunked import *  # noqa: F401,F403
