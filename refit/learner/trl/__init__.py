"""TRL's trainers on Refit: a TRL script runs by changing its import line (``from refit import ...``).

:mod:`~refit.learner.trl.grpo` (GRPO, RLOO on the PPO job), :mod:`~refit.learner.trl.distill` (Distillation, GKD on
the distillation job), :mod:`~refit.learner.trl.events` (transformers' callbacks, ``state``, TRL's log names),
:mod:`~refit.learner.trl.field_tables` (every TRL field: honoured, accepted or refused; docs/trl-facade.md),
:mod:`~refit.learner.trl.common` (models, tokenizers, ``peft_config``), :mod:`~refit.learner.trl.face` (the surface
the trainers share).
"""

from refit.learner.trl.common import DEMO_CHAT_MODEL, lora_values
from refit.learner.trl.distill import (DEMO_STUDENT, DEMO_TEACHER, DistillationConfig, DistillationTrainer, GKDConfig,
                                       GKDTrainer, to_distill_config)
from refit.learner.trl.face import TrainOutput
from refit.learner.trl.grpo import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, batch_shape, to_ppo_config

__all__ = ["DEMO_CHAT_MODEL", "DEMO_STUDENT", "DEMO_TEACHER", "DistillationConfig", "DistillationTrainer", "GKDConfig",
           "GKDTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer", "TrainOutput", "batch_shape",
           "lora_values", "to_distill_config", "to_ppo_config"]
