"""Refit: PPO-KL and distillation for language models with generation on exported inference engines.

The public face: about a dozen names, imported lazily (``import refit`` loads neither torch nor
onnxruntime until a name is used), in the manner of TRL's and torchtune's package faces. Everything
else is reachable under its room (``refit.core``, ``refit.export``, ``refit.rollout``,
``refit.learner``, ``refit.bench``) but not promised.

    import refit
    refit.build_engine("models/tiny", "engines/tiny")            # HF folder -> parity-gated engine folder
    engine = refit.create_engine("onnxruntime", "engines/tiny")   # generate / score / update_weights
    batch = engine.generate([[5, 6, 7]], refit.SamplingParams(max_new_tokens=8))
    refit.run_ppo(refit.PPOConfig(...), reward_funcs=[my_reward])  # the PPO-KL job (as `refit ppo`)
    refit.GRPOTrainer(model=..., reward_funcs=[...], args=refit.GRPOConfig(...)).train()  # TRL's names
    refit.DistillationTrainer(model=..., teacher_model=..., args=refit.DistillationConfig(...)).train()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "RefitError": "refit.core.errors",
    "Manifest": "refit.core.manifest",
    "ExportOptions": "refit.export.options",
    "build_engine": "refit.rollout.build",
    "create_engine": "refit.rollout.engine",
    "Engine": "refit.rollout.engine",
    "SamplingParams": "refit.rollout.types",
    "RolloutBatch": "refit.rollout.types",
    "PPOConfig": "refit.learner.ppo.config",
    "run_ppo": "refit.learner.api",
    "DistillConfig": "refit.learner.distill.config",
    "run_distill": "refit.learner.api",
    "RunResult": "refit.learner.api",
    "GRPOConfig": "refit.learner.trl",
    "GRPOTrainer": "refit.learner.trl",
    "RLOOConfig": "refit.learner.trl",
    "RLOOTrainer": "refit.learner.trl",
    "DistillationConfig": "refit.learner.trl",
    "DistillationTrainer": "refit.learner.trl",
    "GKDConfig": "refit.learner.trl",
    "GKDTrainer": "refit.learner.trl",
}
_ALIASES = {"build_engine": "build"}  # public name -> the defining module's name

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from refit.core.errors import RefitError
    from refit.core.manifest import Manifest
    from refit.rollout.build import build as build_engine
    from refit.export.options import ExportOptions
    from refit.learner.api import RunResult, run_distill, run_ppo
    from refit.learner.distill.config import DistillConfig
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.trl import (DistillationConfig, DistillationTrainer, GKDConfig, GKDTrainer, GRPOConfig,
                                   GRPOTrainer, RLOOConfig, RLOOTrainer)
    from refit.rollout.engine import Engine, create_engine
    from refit.rollout.types import RolloutBatch, SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _ALIASES.get(name, name))
    globals()[name] = value  # cached: the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
