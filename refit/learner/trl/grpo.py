"""TRL's ``GRPOTrainer`` / ``GRPOConfig`` and ``RLOOTrainer`` / ``RLOOConfig`` on Refit: TRL's argument names
with TRL's meanings, run by the PPO job (generation on the exported engine).

A TRL script moves over by changing its import line::

    from refit import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="runs/x", per_device_train_batch_size=16, num_generations=8, beta=0.02,
                      max_completion_length=64, max_steps=100, learning_rate=1e-5, use_cpu=True)
    trainer = GRPOTrainer(model="models/policy", reward_funcs=[my_reward], args=args, train_dataset=dataset,
                          callbacks=[MyCallback()])
    trainer.train()
    trainer.state.log_history[-1]["train_loss"], trainer.model

``model`` is a local ``save_pretrained`` folder (nothing is downloaded), a ``PreTrainedModel`` (saved under
``OUTPUT_DIR/model`` with ``processing_class``, or the tokenizer of its ``name_or_path`` as TRL loads it), or
:data:`DEMO_CHAT_MODEL`. ``reward_funcs``: callables in TRL's signature (with TRL's ``trainer_state``,
``log_metric``, ``log_extra`` keywords; :mod:`refit.learner.ppo.rewards`) or spec strings. ``train_dataset``: a
``datasets.Dataset`` with a ``prompt`` column (text or chat messages). ``callbacks``: transformers'
``TrainerCallback`` objects (:mod:`refit.learner.trl.events` says where they fire). ``peft_config``: a
``peft.LoraConfig``, Refit's ``lora`` section (:func:`refit.learner.trl.common.lora_values`).

The batch arithmetic (one process; TRL counts per device, Refit's batch is the whole rollout):
completions per generation = per_device_train_batch_size x steps_per_generation (or generation_batch_size);
run.batch_size (PROMPTS per rollout) = that / num_generations; num_mini_batches = steps_per_generation /
gradient_accumulation_steps; num_ppo_epochs = num_iterations; ``max_steps`` and ``save_steps`` count optimizer
steps, ``num_iterations x num_mini_batches`` per rollout. Every other name, its kind and its Refit setting:
:mod:`refit.learner.trl.field_tables` (docs/trl-facade.md).

``eval_dataset``: Refit's held-out evaluation (``refit ppo``'s ``eval_steps``) every ``eval_steps`` optimizer steps
with ``eval_strategy='steps'``, and at the last step always, which ``evaluate()`` returns; logged as
``eval_reward``, ``eval_rewards/<func>/mean``, ``eval_completions/mean_length`` with on_evaluate.

The loss is TRL 1.16's, computed as its trainers compute it (:mod:`refit.learner.losses.grpo`): every GRPO
``loss_type`` with its normaliser, ``epsilon_high``, ``delta``, ``importance_sampling_level``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, ``entropy_coef`` (with ``use_adaptive_entropy``, TRL's
controller, checkpointed), ``use_bias_correction_kl``, a Mixture-of-Experts policy's ``router_aux_loss_coef``; RLOO's
ratio of summed log-probs averaged over sequences, with ``normalize_advantages`` and ``reward_clip_range``;
``mask_truncated_completions`` for both; the generation shuffled once and replayed ``num_iterations`` times in that
order, as TRL's buffer does.

Departures kept visible: without ``num_generations_eval`` the evaluation generates one greedy completion per
held-out prompt (TRL samples ``num_generations`` then); with it, that many sampled completions (as TRL); TRL also
logs an ``eval_loss``. The off-policy mask compares the current log-probs with the learner's old ones (TRL's path
without vLLM); the engine's own mismatch is Refit's ``mismatch_correction``. ``generation_kwargs`` with a
``temperature``: TRL samples at it and keeps scoring at ``temperature``; Refit samples and scores at it (one
temperature, the engine/learner contract). ``min_p`` and ``repetition_penalty`` are the engine sampler's and the
learner scores at the temperature alone, as TRL does (docs/design.md, "Logit processors and the learner").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

from refit.core.errors import RefitError
from refit.core.hf_folder import text_config
from refit.core.parsing import build, resolve
from refit.learner.api import run_ppo
from refit.learner.losses.grpo import LOSS_TYPES
from refit.learner.ppo.config import PPOConfig, TRL_HINTS
from refit.learner.ppo.rewards import spec_of
from refit.learner.trl.common import (TrlConfig, base_dtype_values, eval_every, generation_values, lora_values,
                                      lr_schedule, resolve_model, shared_values, staged_dataset, steps_of)
from refit.learner.trl.events import grpo_row
from refit.learner.trl.face import TrainerFace
from refit.learner.trl.field_tables import GRPO_ARGS, RLOO_ARGS


class GRPOConfig(TrlConfig):
    """TRL's ``GRPOConfig``: its names with TRL's defaults (:data:`refit.learner.trl.field_tables.GRPO_ARGS`)."""

    FIELDS = GRPO_ARGS
    HINTS = TRL_HINTS
    ESTIMATOR: ClassVar[str] = "grpo"
    KL: ClassVar[tuple[str, str]] = ("loss", "k3")  # beta: a k3 term in the loss (TRL GRPO)


class RLOOConfig(GRPOConfig):
    """TRL's ``RLOOConfig``: as :class:`GRPOConfig`, with RLOO's defaults (2 generations, beta 0.05 as a k1
    penalty in the reward, max_completion_length 512)."""

    FIELDS = RLOO_ARGS
    ESTIMATOR: ClassVar[str] = "rloo"
    KL: ClassVar[tuple[str, str]] = ("reward", "k1")  # beta: the summed k1 subtracted from the score (TRL RLOO)


def _scale_rewards(v: Any) -> str:
    if v is True or v == "group":
        return "group"
    if v is False or v == "none":
        return "none"
    if v == "batch":
        return "batch"
    raise RefitError(f"scale_rewards={v!r}: Refit takes True/'group', 'batch', False/'none'")


def batch_shape(a: GRPOConfig) -> dict[str, int]:
    """TRL's batch arithmetic as Refit's: prompts per rollout, minibatches, optimizer steps per rollout."""
    ga, mb = a.gradient_accumulation_steps, a.per_device_train_batch_size
    if a.steps_per_generation is not None and a.generation_batch_size is not None:
        raise RefitError("steps_per_generation and generation_batch_size are mutually exclusive (as in TRL)")
    if a.generation_batch_size is not None:
        if a.generation_batch_size % mb:
            raise RefitError(f"generation_batch_size={a.generation_batch_size} must be a multiple of "
                             f"per_device_train_batch_size={mb}")
        steps = a.generation_batch_size // mb
    else:
        steps = a.steps_per_generation or ga
    rows = mb * steps  # completions per generation
    if a.num_generations < 2 or rows % a.num_generations:
        raise RefitError(f"{rows} completions per generation (per_device_train_batch_size {mb} x "
                         f"steps_per_generation {steps}) must be a multiple of num_generations={a.num_generations} "
                         "(>= 2)")
    if steps % ga:
        raise RefitError(f"steps_per_generation={steps} must be a multiple of gradient_accumulation_steps={ga}: "
                         "Refit's optimizer steps do not straddle generations")
    minibatches = steps // ga
    return {"prompts": rows // a.num_generations, "rows": rows, "num_mini_batches": minibatches,
            "per_rollout": minibatches * a.num_iterations}


def rollouts(a: GRPOConfig, per: int, prompts: int, num_prompts: int | None) -> int:
    """Refit's steps (rollouts): ``max_steps`` optimizer steps (a whole number of rollouts), else
    ``num_train_epochs`` passes over ``num_prompts``."""
    if a.max_steps and a.max_steps > 0:
        if a.max_steps % per:
            lo, hi = max(per, a.max_steps // per * per), (a.max_steps // per + 1) * per
            raise RefitError(f"max_steps={a.max_steps} optimizer steps is not a multiple of the {per} optimizer steps "
                             "each generation makes (num_iterations * steps_per_generation / "
                             f"gradient_accumulation_steps); use {lo} or {hi}")
        return a.max_steps // per
    if not num_prompts:
        raise RefitError("max_steps is not set and the number of training prompts is unknown: set max_steps")
    return math.ceil(a.num_train_epochs * num_prompts / prompts)


def loss_values(a: GRPOConfig) -> dict[str, Any]:
    """The loss and advantage settings as Refit's PPOConfig fields (refit/learner/losses/grpo.py computes each as
    TRL)."""
    values = {"cliprange_high": a.epsilon_high, "mask_truncated_completions": bool(a.mask_truncated_completions),
              "minibatch_order": "replay"}  # TRL shuffles a generation once and replays it num_iterations times
    if a.ESTIMATOR == "rloo":
        if "loss_type" in a.given:
            raise RefitError("RLOOConfig: loss_type is not a field of TRL 1.16's RLOOConfig (RLOO's loss is its own)")
        clip = tuple(float(x) for x in a.reward_clip_range) if a.reward_clip_range else ()
        return {**values, "loss_type": "rloo", "normalize_advantages": bool(a.normalize_advantages),
                "reward_clip_range": clip}
    if a.loss_type not in LOSS_TYPES:
        raise RefitError(f"loss_type={a.loss_type!r}: TRL 1.16's loss types are {', '.join(LOSS_TYPES)}")
    if a.importance_sampling_level not in ("token", "sequence"):
        raise RefitError(f"importance_sampling_level={a.importance_sampling_level!r}: 'token' or 'sequence' (GSPO)")
    if a.delta is not None and a.delta <= 1 + (a.epsilon if a.epsilon_high is None else a.epsilon_high):
        raise RefitError(f"delta={a.delta} must be > 1 + epsilon_high (TRL's two-sided clipping)")
    return {**values, "loss_type": a.loss_type, "delta": a.delta,
            "importance_sampling_level": a.importance_sampling_level,
            "top_entropy_quantile": float(a.top_entropy_quantile),
            "off_policy_mask_threshold": a.off_policy_mask_threshold, "entropy_coef": float(a.entropy_coef),
            **({"entropy_target": float(a.entropy_target), "entropy_coef_delta": float(a.entropy_coef_delta),
                "entropy_coef_min": float(a.entropy_coef_min), "entropy_coef_max": float(a.entropy_coef_max)}
               if a.use_adaptive_entropy else {}),
            "multi_objective_aggregation": a.multi_objective_aggregation,
            "kl_bias_correction": bool(a.use_bias_correction_kl),
            "sapo_temperatures": (float(a.sapo_temperature_pos), float(a.sapo_temperature_neg)),
            "vespo_params": (float(a.vespo_k_pos), float(a.vespo_lambda_pos), float(a.vespo_k_neg),
                             float(a.vespo_lambda_neg))}


def router_aux_value(a: GRPOConfig, model_dir: str) -> dict[str, float]:
    """TRL 1.16's MoE load-balancing loss weight: ``router_aux_loss_coef``, or when None the architecture's own
    (its config's ``router_aux_loss_coef``) for a model whose config has ``output_router_logits`` (a
    Mixture-of-Experts one, where TRL adds it by default); 0 for any other model, where setting it is refused."""
    text = text_config(model_dir)
    if text is None:  # no model folder here: the run refuses it when it loads
        return {"router_aux_loss_coef": float(a.router_aux_loss_coef or 0.0)}
    moe = hasattr(text, "output_router_logits")
    if a.router_aux_loss_coef and not moe:
        raise RefitError(f"router_aux_loss_coef={a.router_aux_loss_coef}: {type(text).__name__} is not a "
                         "Mixture-of-Experts model that returns its router logits: there is no auxiliary loss to weight")
    coef = getattr(text, "router_aux_loss_coef", 0.0) if a.router_aux_loss_coef is None else a.router_aux_loss_coef
    return {"router_aux_loss_coef": float(coef or 0.0) if moe else 0.0}


def to_ppo_config(a: GRPOConfig, model_dir: str, num_prompts: int | None = None, reward_specs: tuple = (),
                  peft_config: Any = None, has_eval: bool = False):
    """The :class:`refit.learner.ppo.config.PPOConfig` that runs ``a`` with TRL's meanings (the module's mapping).
    ``num_prompts``: training prompts, for ``num_train_epochs`` when ``max_steps`` is not set; ``reward_specs``:
    the reward functions as the saved config names them (``refit.learner.ppo.rewards.spec_of``); ``has_eval``: an
    eval_dataset comes as the split 'eval' (:func:`refit.learner.trl.common.staged_dataset`)."""
    shape = batch_shape(a)
    per = shape["per_rollout"]
    steps = rollouts(a, per, shape["prompts"], num_prompts)
    steps_of("logging_steps", a.logging_steps, steps * per)  # a ratio needs max_steps
    values = {
        **shared_values(a, steps, per), "run.steps": steps, "run.batch_size": shape["prompts"],
        "model.model_dir": model_dir, "num_generations": a.num_generations, "advantage_estimator": a.ESTIMATOR,
        "scale_rewards": _scale_rewards(a.scale_rewards), "num_ppo_epochs": a.num_iterations,
        "num_mini_batches": shape["num_mini_batches"],
        **generation_values(a, "response_length", a.max_completion_length),
        "kl_coef": a.beta, "kl_penalty": a.KL[0], "kl_estimator": a.KL[1], "cliprange": a.epsilon,
        **loss_values(a), **router_aux_value(a, model_dir),
        "reward_weights": tuple(float(w) for w in a.reward_weights or ()), "reward_funcs": tuple(reward_specs),
        "sync_ref_model": bool(a.sync_ref_model), "ref_model_mixup_alpha": a.ref_model_mixup_alpha,
        "ref_model_sync_steps": a.ref_model_sync_steps, "num_generations_eval": a.num_generations_eval or 0,
        **lora_values(peft_config, model_dir), **base_dtype_values(a.model_init_kwargs, peft_config, type(a).__name__),
        **({"eval_steps": eval_every(a, steps, per), "data.eval_split": "eval"} if has_eval else {}),
    }
    values, _ = resolve(PPOConfig, values, {}, "trl")  # every name checked (top_p -> sampling.top_p)
    extra, _ = resolve(PPOConfig, dict(a.refit), {}, f"{type(a).__name__}(refit=...)")
    return build(PPOConfig, {**values, **extra})


class GRPOTrainer(TrainerFace):
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, processing_class, callbacks, peft_config)``
    on the PPO job."""

    config_class = GRPOConfig

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        self._refuse(reward_processing_classes=reward_processing_classes, optimizers=optimizers,
                     quantization_config=quantization_config, tools=tools, rollout_func=rollout_func,
                     environment_factory=environment_factory)
        name = type(self).__name__
        if args is None:
            stem = Path(str(model)).name if isinstance(model, (str, Path)) else type(model).__name__
            args = self.config_class(output_dir=f"{stem}-{self.config_class.ESTIMATOR.upper()}")
        if not isinstance(args, self.config_class):
            raise RefitError(f"{name}: args must be a {self.config_class.__name__}, got {type(args).__name__}")
        if train_dataset is None:
            raise RefitError(f"{name}: train_dataset is required (a datasets.Dataset with a 'prompt' column)")
        if args.eval_strategy != "no" and eval_dataset is None:
            raise RefitError(f"{name}: eval_strategy={args.eval_strategy!r} needs an eval_dataset (as in TRL)")
        super().__init__(args, callbacks, processing_class, model)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.events.eval_in_train = args.eval_strategy == "steps"
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        model_dir = resolve_model(model, self.processing_class, Path(args.output_dir) / "model")
        n = len(train_dataset) if hasattr(train_dataset, "__len__") and not isinstance(train_dataset, str) else None
        # the PPOConfig that runs (saved as OUTPUT_DIR/config.yaml)
        self.config = to_ppo_config(args, model_dir, n, tuple(spec_of(f) for f in self.reward_funcs), peft_config,
                                    has_eval=eval_dataset is not None)
        self.num_prompts = n

    def _hooks(self):
        cfg = self.config
        per = cfg.num_ppo_epochs * cfg.num_mini_batches
        n = self.num_prompts or cfg.run.batch_size
        in_loss = cfg.kl_penalty == "loss"
        return self.events.hooks(steps=cfg.run.steps, per=per, epoch_of=lambda s: s * cfg.run.batch_size / n,
                                 row=lambda m: grpo_row(m, cfg.kl_coef, in_loss),
                                 lr_at=lr_schedule(cfg.optim, cfg.run.steps * per))

    def _samples_per_step(self) -> int:
        return self.config.run.batch_size * self.config.num_generations // max(
            1, self.config.num_ppo_epochs * self.config.num_mini_batches)

    def _run(self, hooks, resume: bool):
        data = self.train_dataset if self.eval_dataset is None else staged_dataset(
            self.train_dataset, self.eval_dataset, Path(self.config.run.output_dir))
        return run_ppo(self.config, reward_funcs=self.reward_funcs, train_dataset=data, resume=resume, hooks=hooks)


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer``: RLOO's leave-one-out baseline, beta as a k1 penalty in the reward (see the module)."""

    config_class = RLOOConfig
