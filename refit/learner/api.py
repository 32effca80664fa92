"""Refit from Python: run a PPO or distillation job from a config object, a dataset object and callables.

Thin over the jobs the CLI runs (:func:`refit.learner.ppo.cycle.ppo_job`, :data:`refit.learner.distill.cycle.DISTILL_JOB`,
both driven by :func:`refit.learner.run.loop.run_job`)::

    from datasets import Dataset
    from refit.learner.api import run_ppo
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.run.config import ModelSection, OptimSection, RunSection

    def correct(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    cfg = PPOConfig(run=RunSection(output_dir="runs/py", steps=20, batch_size=8),
                    model=ModelSection(model_dir="models/policy"), optim=OptimSection(learning_rate=1e-4),
                    advantage_estimator="grpo", num_generations=4)
    result = run_ppo(cfg, reward_funcs=[correct], train_dataset=Dataset.from_list(rows))
    result.metrics[-1]["reward/mean"], result.run_dir

``train_dataset`` (a ``datasets.Dataset``) is written to ``OUTPUT_DIR/train_dataset`` with ``save_to_disk`` and
the run reads it from there, so the saved ``config.yaml`` names data that exists and ``--resume`` works.
Callables are recorded in ``config.yaml`` as ``module:name`` (``reward_funcs``); a spec string there loads back
as it is.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from refit.core.errors import RefitError
from refit.core.parsing import with_values
from refit.learner.distill.cycle import run_distill as run_cycle
from refit.learner.distill.pair import build_models
from refit.learner.ppo.cli import summary
from refit.learner.ppo.cycle import ppo_job
from refit.learner.ppo.rewards import load_rewards, spec_of
from refit.learner.run.config import flat_names
from refit.learner.run.loop import StepHooks, run_job
from refit.learner.run.metrics import read_metrics


@dataclass(frozen=True)
class RunResult:
    """What a job left behind."""

    run_dir: Path  # the run folder: config.yaml, metrics.jsonl, tb/, curves.png, checkpoints/, engine(s)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl, one dict per step (step 0: evaluation)
    summary: dict = field(default_factory=dict)  # the CLI's one-line summary (reward start/end, min exact KL, ...)
    final_dir: Path | None = None  # OUTPUT_DIR/final (from_pretrained) when export_final wrote it


def dataset_path(train_dataset: Any, run_dir: Path) -> str:
    """A ``datasets.Dataset`` saved under ``run_dir`` (its path), or a path as a string; else one line."""
    if isinstance(train_dataset, (str, Path)):
        return str(train_dataset)
    import datasets

    if isinstance(train_dataset, datasets.DatasetDict):
        raise RefitError("train_dataset: give one split (a datasets.Dataset, e.g. dataset['train']), not a "
                         f"DatasetDict of {sorted(train_dataset)}")
    if not isinstance(train_dataset, datasets.Dataset):
        raise RefitError(f"train_dataset must be a datasets.Dataset or a path, got {type(train_dataset).__name__} "
                         "(an IterableDataset: save it as a file first)")
    out = run_dir / "train_dataset"
    if out.exists():
        shutil.rmtree(out)  # a previous run's copy (this folder is the run's own)
    run_dir.mkdir(parents=True, exist_ok=True)
    train_dataset.save_to_disk(str(out))
    return str(out)


def run_ppo(config, reward_funcs: Sequence[Callable | str] | None = None, train_dataset: Any = None,
            reward_weights: Sequence[float] | None = None, resume: bool = False, log=print,
            hooks: StepHooks | None = None) -> RunResult:
    """Run the PPO-KL job of ``config`` (a :class:`refit.learner.ppo.config.PPOConfig`).

    ``reward_funcs``: callables in TRL's signature and/or spec strings (``'path.py:fn'``, ``'module:fn'``, a
    classifier folder), replacing ``config.reward_funcs``; ``reward_weights`` one per function.
    ``train_dataset``: a ``datasets.Dataset`` with a prompt column (and any columns the rewards read) or a
    dataset path, replacing ``config.data.dataset``. ``hooks``: called around each step
    (:class:`refit.learner.run.loop.StepHooks`; the TRL facade's callbacks).
    """
    run_dir = Path(config.run.output_dir)
    if not config.model.model_dir:
        raise RefitError("PPOConfig.model.model_dir is required (a policy HF checkpoint folder)")
    rewards = None
    if reward_funcs is not None:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise RefitError("reward_funcs is empty: give at least one reward function")
        weights = tuple(float(w) for w in reward_weights) if reward_weights is not None else config.reward_weights
        if weights and len(weights) != len(funcs):
            raise RefitError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        rewards = load_rewards(funcs, list(weights))
        config = replace(config, reward_funcs=tuple(spec_of(f) for f in funcs), reward_weights=weights)
    if train_dataset is not None:
        config = with_values(config, **{"data.dataset": dataset_path(train_dataset, run_dir)})
    run_dir, _ = run_job(ppo_job(log, rewards), config, resume, log, hooks=hooks)
    final = run_dir / "final"
    return RunResult(run_dir=run_dir, metrics=read_metrics(run_dir), summary=summary(run_dir),
                     final_dir=final if (final / "config.json").exists() else None)


def run_distill(config, train_dataset: Any = None, resume: bool = False, log=print,
                hooks: StepHooks | None = None) -> RunResult:
    """Run the distillation job of ``config`` (a :class:`refit.learner.distill.config.DistillConfig`); with no model
    folders the embedded default builds a teacher and a student. ``train_dataset``: a ``datasets.Dataset`` (prompt
    and completion columns) or a dataset path, replacing ``config.data.dataset``. ``hooks``: as in
    :func:`run_ppo`."""
    import json

    run_dir = Path(config.run.output_dir)
    if train_dataset is not None:
        config = with_values(config, **{"data.dataset": dataset_path(train_dataset, run_dir)})
    if not config.teacher.model_dir and not config.student.model_dir:  # the embedded pair, as `refit distill`
        models = run_dir / "models"
        config = with_values(config, flat_names(type(config)), **build_models(models, config),
                             teacher_engine_dir=config.teacher.engine_dir or str(models / "teacher_engine"),
                             student_engine_dir=config.student.engine_dir or str(models / "student_engine"))
    run_dir = run_cycle(config, resume, log, hooks=hooks)
    s = run_dir / "summary.json"
    final = run_dir / "final"
    return RunResult(run_dir=run_dir, metrics=read_metrics(run_dir),
                     summary=json.loads(s.read_text()) if s.exists() else {},
                     final_dir=final if (final / "config.json").exists() else None)
