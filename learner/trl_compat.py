"""TRL's ``GRPOTrainer`` / ``GRPOConfig`` and ``RLOOTrainer`` / ``RLOOConfig`` on Refit: TRL's argument names
with TRL's meanings, run by the PPO job (generation on the exported engine).

A TRL script moves over by changing its import line::

    from refit.learner.trl_compat import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="runs/x", per_device_train_batch_size=16, num_generations=8, beta=0.02,
                      max_completion_length=64, max_steps=100, learning_rate=1e-5)
    GRPOTrainer(model="models/policy", reward_funcs=[my_reward], args=args, train_dataset=dataset).train()

``model`` is a local ``save_pretrained`` folder (nothing is downloaded), a ``PreTrainedModel`` (saved under
``OUTPUT_DIR/model`` with ``processing_class``), or :data:`DEMO_CHAT_MODEL`, the embedded chat model built
locally on first use (``refit demo --policy_only --chat``). ``reward_funcs``: callables in TRL's signature
(with TRL's ``trainer_state``, ``log_metric``, ``log_extra`` keywords; :mod:`refit.learner.ppo.rewards`) or spec
strings. ``train_dataset``: a ``datasets.Dataset`` with a ``prompt`` column (text or chat messages).

How each TRL name maps (one process; TRL counts per device, Refit's batch is the whole rollout):

============================  ==============================================================================
TRL (default)                 Refit (:class:`refit.learner.ppo.config.PPOConfig`)
============================  ==============================================================================
per_device_train_batch_size   completions per micro-batch. Completions per generation =
(8)                           per_device_train_batch_size * steps_per_generation (or generation_batch_size);
                              run.batch_size (PROMPTS per rollout) = that / num_generations; 16 completions
                              with num_generations 8 is 2 prompts
num_generations (8 / RLOO 2)  num_generations
steps_per_generation (=GA)    num_mini_batches = steps_per_generation / gradient_accumulation_steps
generation_batch_size         the same, given as completions per generation (one of the two)
gradient_accumulation_steps   optim.gradient_accumulation_steps
num_iterations (1)            num_ppo_epochs (TRL replays the micro-batches in order, Refit reshuffles)
max_steps (optimizer steps)   run.steps (rollouts) = max_steps / (num_iterations * num_mini_batches)
num_train_epochs (3.0)        used when max_steps <= 0: run.steps = ceil(epochs * prompts / run.batch_size)
max_completion_length (256)   response_length
beta (GRPO 0.0)               kl_coef with kl_penalty=loss, kl_estimator=k3: beta * k3 added to each token's
                              loss (Schulman's k3, as TRL's GRPO)
beta (RLOO 0.05)              kl_coef with kl_penalty=reward, kl_estimator=k1: the score minus beta * the
                              sequence's summed k1 (as TRL's RLOO)
epsilon (0.2)                 cliprange (epsilon_high: only None or equal, Refit clips symmetrically)
loss_type ("dapo")            'dapo': Refit's normalisation (the minibatch's response-token count); 'bnpo' is the
                              same when gradient_accumulation_steps is 1; 'grpo', 'dr_grpo', ...: refused
scale_rewards ("group")       scale_rewards: True/'group', 'batch', False/'none' (GRPO)
advantage estimator           grpo (GRPOTrainer), rloo (RLOOTrainer)
learning_rate (1e-6)          optim.learning_rate; lr_scheduler_type ('linear'), warmup_steps, weight_decay,
                              max_grad_norm as TRL (warmup_ratio: of the optimizer steps)
temperature, top_p, top_k     temperature, top_p, top_k (the sampling section; None: 0, no top-k)
output_dir, seed              run.output_dir, run.seed
save_steps (500, opt. steps)  ckpt.save_steps in rollouts (a multiple of the optimizer steps per rollout); a
                              float < 1 is a fraction of max_steps, as in TRL; save_total_limit:
                              ckpt.keep_checkpoints
logging_steps (10)            accepted: Refit writes every step to metrics.jsonl (and TensorBoard)
report_to                     log.tensorboard when it names tensorboard
bf16                          run.bf16 (CUDA only)
reward_weights                reward_weights
============================  ==============================================================================

Names that change no number (``logging_dir``, ``run_name``, ``gradient_checkpointing``, ``remove_unused_columns``,
``log_completions``, ...: :data:`ACCEPTED`) are taken and ignored. A TRL name Refit cannot honour at a
non-default value (``use_vllm``, ``mask_truncated_completions``, ``importance_sampling_level='sequence'``, ...:
:data:`REFUSED`) is refused in one line that says what Refit does instead; an unknown name likewise.
``refit={"rollout.backend": "torch", "rollout.engine_threads": 2}`` sets any PPOConfig field by its dotted path.

Departures kept visible: Refit always scores the frozen reference (TRL skips it when beta is 0; the KL is
logged either way); the held-out evaluation (``eval_steps``) is not offered here (``refit ppo`` has it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from refit.core.errors import RefitError

DEMO_CHAT_MODEL = "refit/demo-chat"  # the embedded chat model: built locally by refit.learner.examples.demo on first use

# names that change no number in a Refit run: taken, ignored (the docstring says why)
ACCEPTED = {"logging_dir", "run_name", "logging_first_step", "logging_strategy", "log_level", "overwrite_output_dir",
            "do_train", "gradient_checkpointing", "gradient_checkpointing_kwargs", "remove_unused_columns",
            "log_completions", "num_completions_to_print", "log_unique_prompts", "dataloader_num_workers",
            "dataloader_pin_memory", "ds3_gather_for_generation", "cast_lm_head_to_fp32", "model_init_kwargs",
            "disable_tqdm", "save_strategy", "shuffle_dataset", "disable_dropout"}

# TRL name -> (the value Refit honours, what Refit does instead); any other value is refused in one line
REFUSED: dict[str, tuple[Any, str]] = {
    "use_vllm": (False, "generation runs on Refit's engine: rollout.backend via refit={'rollout.backend': ...}"),
    "mask_truncated_completions": (False, "not supported"),
    "importance_sampling_level": ("token", "not supported: Refit's ratios are per token"),
    "top_entropy_quantile": (1.0, "not supported"),
    "delta": (None, "not supported (two-sided clipping)"),
    "min_p": (None, "not supported: top_k, top_p"),
    "repetition_penalty": (1.0, "not supported"),
    "generation_kwargs": (None, "not supported: temperature, top_k, top_p"),
    "sync_ref_model": (False, "not supported: the reference stays the step-0 policy"),
    "multi_objective_aggregation": ("sum_then_normalize", "not supported: weighted sum, then the group baseline"),
    "num_generations_eval": (None, "not supported"),
    "eval_strategy": ("no", "not in GRPOTrainer: `refit ppo` has eval_steps with data.eval_split"),
    "fp16": (False, "not supported: fp32, or bf16 autocast on CUDA (bf16)"),
    "push_to_hub": (False, "not supported: OUTPUT_DIR/final is a save_pretrained folder"),
    "torch_compile": (False, "not supported"),
    "use_liger_kernel": (False, "not supported"),
    "vllm_importance_sampling_correction": (True, "the engine's mismatch is checked every push (probe_tol); "
                                                  "refit={'mismatch_correction': 'tis'} corrects it"),
    "normalize_advantages": (False, "not supported: RLOO advantages are not whitened"),
    "reward_clip_range": (None, "not supported"),
    "max_prompt_length": (None, "not supported: prompts are kept whole (a prompt too long for the model is "
                                "refused)"),
}


@dataclass(init=False)
class GRPOConfig:
    """TRL's ``GRPOConfig`` fields that Refit honours, with TRL's defaults (see the module docstring)."""

    output_dir: str = "trainer_output"
    seed: int = 42
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_generations: int = 8
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_iterations: int = 1
    max_steps: int = -1
    num_train_epochs: float = 3.0
    max_completion_length: int = 256
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: Any = "group"
    reward_weights: list | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    logging_steps: float = 10
    save_steps: float = 500
    save_total_limit: int | None = None
    report_to: Any = "none"
    bf16: bool | None = None
    refit: dict = field(default_factory=dict)  # any PPOConfig field by dotted path ({"rollout.backend": "torch"})

    ESTIMATOR: ClassVar[str] = "grpo"
    KL: ClassVar[tuple[str, str]] = ("loss", "k3")  # beta: a k3 term in the loss (TRL GRPO)

    def __init__(self, output_dir: str | None = None, **kw):
        own = {f.name: f for f in fields(self)}
        bad = [k for k in kw if k not in own and k not in ACCEPTED and k not in REFUSED]
        if bad:
            from refit.learner.ppo.config import TRL_HINTS

            k = bad[0]
            raise RefitError(f"{type(self).__name__}: {k!r} is not supported"
                             + (f" (Refit's nearest: {TRL_HINTS[k]})" if k in TRL_HINTS else "")
                             + f"; the names {type(self).__name__} takes are in learner/trl_compat.py")
        for k, v in kw.items():
            if k in REFUSED and v != REFUSED[k][0]:
                raise RefitError(f"{type(self).__name__}: {k}={v!r}: {REFUSED[k][1]}")
        for name, f in own.items():
            default = f.default_factory() if callable(f.default_factory) else f.default
            setattr(self, name, kw.get(name, default))
        if output_dir is not None:
            self.output_dir = str(output_dir)
        self.ignored = {k: v for k, v in kw.items() if k in ACCEPTED}  # taken, no effect (kept for the record)


@dataclass(init=False)
class RLOOConfig(GRPOConfig):
    """TRL's ``RLOOConfig``: as :class:`GRPOConfig`, with RLOO's defaults (2 generations, beta 0.05 as a k1
    penalty in the reward, max_completion_length 512)."""

    num_generations: int = 2
    beta: float = 0.05
    max_completion_length: int = 512

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


def _opt_steps_to_rollouts(name: str, value: float, per: int, total_opt: int | None = None, exact: bool = True
                           ) -> int:
    """TRL's optimizer-step count ``value`` as rollouts of ``per`` optimizer steps (a float < 1: of ``total_opt``).
    ``exact``: refuse a count that is not a whole number of rollouts, else round up (checkpoints)."""
    if 0 < value < 1 and total_opt is not None:
        value = math.ceil(value * total_opt)  # TRL: a ratio of the total
    value = int(value)
    if not exact and value >= 1:
        return math.ceil(value / per)
    if value < 1 or value % per:
        lo, hi = max(per, value // per * per), (value // per + 1) * per
        raise RefitError(f"{name}={value} optimizer steps is not a multiple of the {per} optimizer steps each "
                         f"generation makes (num_iterations * steps_per_generation / gradient_accumulation_steps); "
                         f"use {lo} or {hi}")
    return value // per


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


def to_ppo_config(a: GRPOConfig, model_dir: str, num_prompts: int | None = None, reward_specs: tuple = ()):
    """The :class:`refit.learner.ppo.config.PPOConfig` that runs ``a`` with TRL's meanings (the module's table).
    ``num_prompts``: training prompts, for ``num_train_epochs`` when ``max_steps`` is not set; ``reward_specs``:
    the reward functions as the saved config names them (``refit.learner.ppo.rewards.spec_of``)."""
    from refit.core.parsing import build, resolve
    from refit.learner.ppo.config import PPOConfig

    shape = batch_shape(a)
    per = shape["per_rollout"]
    if a.epsilon_high is not None and a.epsilon_high != a.epsilon:
        raise RefitError(f"epsilon_high={a.epsilon_high} != epsilon={a.epsilon}: not supported (Refit clips "
                         "symmetrically with cliprange)")
    if a.loss_type not in ("dapo", "bnpo") or (a.loss_type == "bnpo" and a.gradient_accumulation_steps != 1):
        raise RefitError(f"loss_type={a.loss_type!r}: not supported; Refit normalises the loss by the response-token "
                         "count of each optimizer step's minibatch, TRL's 'dapo' ('bnpo' too with "
                         "gradient_accumulation_steps 1)")
    if a.max_steps and a.max_steps > 0:
        steps = _opt_steps_to_rollouts("max_steps", a.max_steps, per, None)
    else:
        if not num_prompts:
            raise RefitError("max_steps is not set and the number of training prompts is unknown: set max_steps")
        steps = math.ceil(a.num_train_epochs * num_prompts / shape["prompts"])
    save = _opt_steps_to_rollouts("save_steps", a.save_steps, per, steps * per, exact=False) if a.save_steps else steps
    report = [a.report_to] if isinstance(a.report_to, str) else list(a.report_to or [])
    warmup = a.warmup_steps or math.ceil(a.warmup_ratio * steps * per)
    values = {
        "run.output_dir": a.output_dir, "run.seed": a.seed, "run.steps": steps, "run.batch_size": shape["prompts"],
        "run.bf16": True if a.bf16 is None else bool(a.bf16), "model.model_dir": model_dir,
        "num_generations": a.num_generations, "advantage_estimator": a.ESTIMATOR,
        "scale_rewards": _scale_rewards(a.scale_rewards), "num_ppo_epochs": a.num_iterations,
        "num_mini_batches": shape["num_mini_batches"],
        "optim.gradient_accumulation_steps": a.gradient_accumulation_steps,
        "response_length": a.max_completion_length, "kl_coef": a.beta, "kl_penalty": a.KL[0], "kl_estimator": a.KL[1],
        "cliprange": a.epsilon, "optim.learning_rate": a.learning_rate, "optim.lr_scheduler_type": a.lr_scheduler_type,
        "optim.warmup_steps": warmup, "optim.weight_decay": a.weight_decay, "optim.max_grad_norm": a.max_grad_norm,
        "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k or 0,
        "ckpt.save_steps": min(save, steps), "log.tensorboard": bool({"tensorboard", "all"} & set(report)),
        "reward_weights": tuple(float(w) for w in a.reward_weights or ()), "reward_funcs": tuple(reward_specs),
    }
    if a.save_total_limit is not None:
        values["ckpt.keep_checkpoints"] = a.save_total_limit
    if a.lr_scheduler_type not in ("constant", "linear", "cosine"):
        raise RefitError(f"lr_scheduler_type={a.lr_scheduler_type!r}: Refit has constant, linear, cosine")
    values, _ = resolve(PPOConfig, values, {}, "trl_compat")  # every name checked (top_p -> sampling.top_p)
    extra, _ = resolve(PPOConfig, dict(a.refit), {}, f"{type(a).__name__}(refit=...)")
    return build(PPOConfig, {**values, **extra})


def resolve_model(model: Any, processing_class: Any, output_dir: str) -> str:
    """A local checkpoint folder for ``model`` (a folder, a PreTrainedModel, or :data:`DEMO_CHAT_MODEL`)."""
    if model == DEMO_CHAT_MODEL:
        return str(demo_chat_model())
    if isinstance(model, (str, Path)):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise RefitError(f"model {str(model)!r} is not a local checkpoint folder (no config.json): Refit "
                             f"downloads nothing; give a save_pretrained folder, or {DEMO_CHAT_MODEL!r}")
        if processing_class is not None:
            _same_tokenizer(processing_class, folder)
        return str(folder)
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        if processing_class is None:
            raise RefitError("a model object needs processing_class (its tokenizer): both are saved under "
                             "OUTPUT_DIR/model for the export")
        out = Path(output_dir) / "model"
        model.save_pretrained(str(out))
        processing_class.save_pretrained(str(out))
        return str(out)
    raise RefitError(f"model must be a checkpoint folder, a PreTrainedModel or {DEMO_CHAT_MODEL!r}; got "
                     f"{type(model).__name__}")


def _same_tokenizer(tok, folder: Path) -> None:
    """The run uses the folder's tokenizer: a different ``processing_class`` is refused, not silently dropped."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(folder))
    if saved.get_vocab() != tok.get_vocab() or getattr(saved, "chat_template", None) != getattr(
            tok, "chat_template", None):
        raise RefitError(f"processing_class differs from the tokenizer saved in {folder} (vocabulary or chat "
                         "template); save it there (processing_class.save_pretrained(model_folder))")


def demo_chat_model() -> Path:
    """The embedded chat model (a small GPT-2 with a chat template, warmed up on addition), built once under
    ``$REFIT_DEMO_MODELS`` (default ``runs/chat-model``, where ``refit demo --policy_only --chat -o
    runs/chat-model`` puts it) and reused."""
    import os

    root = Path(os.environ.get("REFIT_DEMO_MODELS", "runs/chat-model"))
    if not (root / "policy" / "config.json").is_file():
        from refit.learner.examples.demo import build_policy

        print(f"refit: building the embedded chat model under {root} (once)")
        build_policy(root, sft_steps=150, max_operand=9, seed=0, chat=True)
    return root / "policy"


@dataclass(frozen=True)
class TrainOutput:
    """What TRL's ``train()`` returns (transformers.TrainOutput's fields)."""

    global_step: int  # optimizer steps taken
    training_loss: float  # mean policy-gradient loss over the run's steps
    metrics: dict  # the last step's metrics (metrics.jsonl)


class GRPOTrainer:
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, processing_class)`` on the PPO job."""

    config_class = GRPOConfig

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None):
        name = type(self).__name__
        for what, v, ok in (("eval_dataset", eval_dataset, None), ("reward_processing_classes",
                            reward_processing_classes, None), ("callbacks", callbacks, None),
                            ("optimizers", tuple(optimizers or (None, None)), (None, None)),
                            ("peft_config", peft_config, None)):
            if v != ok:
                raise RefitError(f"{name}: {what} is not supported (Refit: "
                                 + {"eval_dataset": "`refit ppo` with data.eval_split and eval_steps",
                                    "optimizers": "AdamW with optim.* settings",
                                    "peft_config": "full fine-tuning only"}.get(what, "not available") + ")")
        if args is None:
            args = self.config_class(output_dir=f"{Path(str(model)).name}-{self.config_class.ESTIMATOR.upper()}")
        if not isinstance(args, GRPOConfig):
            raise RefitError(f"{name}: args must be a {self.config_class.__name__}, got {type(args).__name__}")
        if train_dataset is None:
            raise RefitError(f"{name}: train_dataset is required (a datasets.Dataset with a 'prompt' column)")
        self.args, self.train_dataset = args, train_dataset
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        model_dir = resolve_model(model, processing_class, args.output_dir)
        n = len(train_dataset) if hasattr(train_dataset, "__len__") and not isinstance(train_dataset, str) else None
        from refit.learner.ppo.rewards import spec_of

        # the PPOConfig that runs (saved as OUTPUT_DIR/config.yaml)
        self.config = to_ppo_config(args, model_dir, n, tuple(spec_of(f) for f in self.reward_funcs))
        self.result = None

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Run the job; ``resume_from_checkpoint``: True continues from OUTPUT_DIR's last checkpoint (a path:
        its run folder must be OUTPUT_DIR)."""
        from refit.learner.api import run_ppo

        if isinstance(resume_from_checkpoint, str) and Path(self.args.output_dir).resolve() not in Path(
                resume_from_checkpoint).resolve().parents:
            raise RefitError(f"resume_from_checkpoint={resume_from_checkpoint!r}: Refit resumes the last checkpoint "
                             f"of output_dir {self.args.output_dir}")
        self.result = run_ppo(self.config, reward_funcs=self.reward_funcs, train_dataset=self.train_dataset,
                              resume=bool(resume_from_checkpoint))
        rows = [r for r in self.result.metrics if "reward/mean" in r]
        per = self.config.num_ppo_epochs * self.config.num_mini_batches
        losses = [r["ppo/pg_loss"] for r in rows if r.get("ppo/pg_loss") is not None]
        return TrainOutput(global_step=(rows[-1]["step"] if rows else 0) * per,
                           training_loss=sum(losses) / len(losses) if losses else float("nan"),
                           metrics=rows[-1] if rows else {})

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model as a save_pretrained folder (OUTPUT_DIR/final, copied to ``output_dir``)."""
        import shutil

        if self.result is None or self.result.final_dir is None:
            raise RefitError("save_model: nothing trained yet (call train() first; export_final writes the model)")
        if output_dir and Path(output_dir).resolve() != self.result.final_dir.resolve():
            shutil.copytree(self.result.final_dir, output_dir, dirs_exist_ok=True)


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer``: RLOO's leave-one-out baseline, beta as a k1 penalty in the reward.

    One departure from TRL's RLOO: its clipped ratio is per sequence (summed log-probs) and its loss a mean over
    sequences; Refit's PPO loss clips per token and normalises by the token count. With num_iterations 1 (the
    default) the ratio is 1 at the only pass, and the two gradients differ by one positive factor per minibatch
    (its mean completion length), which AdamW's normalisation mostly absorbs."""

    config_class = RLOOConfig

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, **kw):
        if args is not None and not isinstance(args, RLOOConfig):
            raise RefitError(f"RLOOTrainer: args must be an RLOOConfig, got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, **kw)
