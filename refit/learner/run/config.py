"""Job configs: frozen dataclasses composed of shared sections, parsed from YAML and flags by tyro.

Every job config (``PPOConfig``, ``DistillConfig``) is the job's own fields on top of sections
defined once and shared (here; the rollout's two, ``rollout`` and ``sampling``, in :mod:`refit.rollout.config`),
each with per-job defaults where they legitimately differ:

==========  ========================  ======================================================================
section     class                     fields
==========  ========================  ======================================================================
``run``     :class:`RunSection`       output_dir (``-o``), seed, steps, batch_size, device, precision,
                                      bf16, max_steps_this_run
``model``   :class:`ModelSection`     model_dir, engine_dir (distill has two: ``student`` and ``teacher``)
``data``    :class:`DataSection`      dataset, dataset_split, prompt_column, dataset_text_field, eval_split,
                                      eval_fraction (a local dataset); task, num_prompts, max_operand
``rollout`` :class:`~refit.rollout.config.RolloutSection`  backend, engine_threads, sync_every, probe_tol,
                                      probe_size, probe_tokens, quantize, max_staleness (beside ``Sampling``)
``sampling`` :class:`~refit.rollout.config.Sampling`  temperature, top_k, top_p (spelled without prefix:
                                      ``--temperature``, ``top_k:``; the one section generate shares too)
``lora``    :class:`LoraSection`      r (0: full fine-tuning), alpha, dropout, target_modules, init
``optim``   :class:`OptimSection`     learning_rate, lr_scheduler_type, lr_scheduler_kwargs, warmup_steps,
                                      weight_decay, adam_beta1/2, adam_epsilon, neftune_noise_alpha,
                                      max_grad_norm, gradient_accumulation_steps
``ckpt``    :class:`CheckpointSection`  save_steps, keep_checkpoints
``log``     :class:`LogSection`       tensorboard, plots, progress
``scale``   :class:`ScaleSection`     workers, ray_address, worker_cpus, worker_gpus (Ray rollout workers)
==========  ========================  ======================================================================

On the command line a section field is ``--optim.learning_rate 1e-4``, in YAML ``optim: {learning_rate:
1e-4}``; the job's own fields (``--cliprange``, ``--lmbda``) have no prefix. Field names follow TRL's
``PPOConfig`` / ``GKDConfig`` where TRL has a name. Precedence: defaults < YAML file (``--config``) <
flags. The resolved config is printed and saved with the run (``config.yaml``, sectioned; it loads back
through ``--config`` to an equal config). The flat names of the release before (``--learning_rate``,
``rollout_workers: 2``) still work for one release, with one deprecation line naming the new spelling
(:func:`flat_names`); ``Config.from_flat(**kw)`` builds a config from them in Python (tests, benches).

Why tyro and not HfArgumentParser: HfArgumentParser maps one flat dataclass to flat flags; it has no
nested dataclasses, so sections would have to be flattened by hand again (the hand-written rule this
replaces), or split into several dataclasses whose field names must still be unique across them. tyro
parses nested frozen dataclasses natively (``--optim.learning_rate``, one help group per section with
its docstring), reads the same ``metadata["help"]`` texts HfArgumentParser does, takes a default
instance (so a YAML file is simply the defaults of the one parse), handles positionals, short aliases
and required fields for ``refit export`` / ``generate`` / ``demo`` / ``bench``, and accepts both
``--max_batch`` and ``--max-batch``. The glue is :mod:`refit.core.parsing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from refit.core.parsing import build, check, flat_leaves, leaves, opt, parse, resolve, save_yaml

_f = opt
Task = Literal["addition", "sort"]

__all__ = ["RunSection", "ModelSection", "DataSection", "LoraSection", "OptimSection", "CheckpointSection",
           "LogSection", "ScaleSection", "flat_names", "from_flat", "parse_job", "save_config", "check"]


@dataclass(frozen=True)
class RunSection:
    """The run: its folder, seed, length and batch."""

    output_dir: Annotated[str, tyro.conf.arg(aliases=["-o"])] = _f(
        "runs/run", "run folder: metrics.jsonl, TensorBoard events, plots, checkpoints, engines")
    seed: int = _f(0, "seed for data order, sampling, minibatches and per-step draws (each step derives its own)")
    steps: int = _f(20, "training steps (PPO: rollout + update; distill: one batch and one optimizer step)")
    batch_size: int = _f(32, "prompts per step")
    device: str = _f("auto", "learner device: auto (CUDA when present), cpu, cuda")
    precision: Literal["auto", "fp32", "bf16"] = _f(
        "auto", "the learner's arithmetic, and the engine's under rollout.quantize auto: auto (bf16 where the device "
                "has bf16 units: a CPU with AVX512-BF16/AMX, a CUDA GPU with bf16; LoRA: the frozen base held in bf16, "
                "full fine-tuning: bf16 autocast over fp32 master weights; else fp32), fp32 (the learner and the "
                "engine in fp32, as before), bf16 (forced, also where bf16 is emulated: slower, with a warning); "
                "KL(0) stays exactly 0 and TIS is on where the engine computes otherwise (refit.learner.run.precision)")
    bf16: bool = _f(True, "false: the learner in fp32 where run.precision auto would pick bf16 (the older switch; "
                          "run.precision says it in full)")
    cpu_matmul: Literal["auto", "onednn", "blas"] = _f(
        "auto", "a CPU learner's fp32 linear layers: oneDNN (auto on x86-64: a Qwen2.5-1.5B LoRA forward+backward "
                "1.38x torch's BLAS here, same fp32 math) or torch's own BLAS; refit.learner.run.matmul")
    max_steps_this_run: int = _f(0, "stop after this many steps in this process (0 = no limit); for tests")


@dataclass(frozen=True)
class ModelSection:
    """A model: its HF checkpoint folder and its engine folder."""

    model_dir: str = _f("", "HF checkpoint folder")
    engine_dir: str = _f("", "engine folder (empty: under OUTPUT_DIR; exported, or reused if from the same "
                             "weights)")


@dataclass(frozen=True)
class DataSection:
    """The prompts: a local dataset with columns (TRL's conventions, refit.learner.run.dataset), else the embedded task."""

    dataset: str = _f("", "local dataset (overrides the embedded task and any prompts/dataset file): a .jsonl / .json "
                          "/ .parquet / .csv file or a datasets save_to_disk folder, loaded with the datasets "
                          "library; a prompt column (text or chat messages) and any others, which PPO reward "
                          "functions receive by name")
    dataset_split: str = _f("train", "training split, datasets syntax ('train', 'train[:90%]'); a file is one "
                                     "'train' split")
    prompt_column: str = _f("prompt", "the column holding prompts: text, or a list of {role, content} messages "
                                      "rendered with the tokenizer's chat template (add_generation_prompt=True)")
    dataset_text_field: str = _f("", "TRL SFT's name for the prompt column; overrides prompt_column when set")
    chat_template_kwargs: tuple[str, ...] = _f((), "KEY=VALUE pairs passed to the tokenizer's apply_chat_template "
                                                    "when chat prompts are rendered (TRL's chat_template_kwargs), "
                                                    "e.g. enable_thinking=false; values read as YAML scalars")
    eval_split: str = _f("", "held-out split ('test', 'train[90%:]'); empty: none (PPO) or the last eval_size rows "
                             "(distill), unless eval_fraction")
    eval_fraction: float = _f(0.0, "hold out this share of the training split (seeded) when there is no eval_split")
    task: Task = _f("addition", "embedded task when no prompts or dataset file is given")
    num_prompts: int = _f(512, "embedded task: examples drawn (distill: distinct prompts kept, eval_size held out)")
    max_operand: int = _f(30, "embedded addition task: operands are in [0, max_operand]")
    data_seed: int = _f(-1, "seed of the training prompts' order (transformers' data_seed); -1: run.seed")

    def order_seed(self, run_seed: int) -> int:
        """The seed the prompt order is drawn with: ``data_seed``, else the run's seed."""
        return self.data_seed if self.data_seed >= 0 else run_seed


LORA_INITS = ("default", "gaussian")  # PEFT's init_lora_weights values that leave the base and B = 0 (step 0 = base)


@dataclass(frozen=True)
class LoraSection:
    """LoRA (through PEFT): the learner trains an adapter over a frozen base; the engine holds the base once and
    takes only the adapter on each push; the reference is the same engine with the adapter off. r 0: full
    fine-tuning."""

    r: int = _f(0, "LoRA rank (PEFT's r); 0 = full fine-tuning")
    alpha: float = _f(16.0, "LoRA alpha (PEFT's lora_alpha): the adapter's output is scaled by alpha / r")
    dropout: float = _f(0.0, "LoRA dropout on the adapter's input in the learner's training forward (PEFT's "
                             "lora_dropout); the engine samples and the learner scores without it")
    target_modules: tuple[str, ...] = _f(("all-linear",), "modules that get an adapter, as PEFT names them: "
                                                          "'all-linear' (every linear layer but the output head), "
                                                          "module names / suffixes (q_proj v_proj), or all-linear "
                                                          "with more names (all-linear lm_head: the head too)")
    learning_rate: float = _f(0.0, "the adapter's AdamW learning rate (0: optim.learning_rate); LoRA wants about 10x "
                                   "full fine-tuning's (Schulman et al., 'LoRA Without Regret', 2025), a value head "
                                   "keeps optim.learning_rate")
    base_dtype: Literal["auto", "fp32", "bf16", "int8"] = _f(
        "auto", "the frozen base's precision on the learner: bf16 halves its memory and runs its matmuls in bf16 (fast "
                "where the hardware has bf16 units: AVX512-BF16/AMX CPUs, Ampere+ GPUs), the engine computing in its "
                "own precision over the same (bf16-rounded) base; int8 holds it as the int8 engine does (a quarter of "
                "its memory) and runs the engine's int8 arithmetic by int8 GEMMs (a CPU learner with an int8 engine, "
                "rollout.quantize int8); the adapter stays fp32; auto: bf16 where run.precision resolves to bf16, "
                "else int8 where the engine resolves to int8 on a CPU learner, else fp32; docs/lora.md")
    init: Literal["default", "gaussian"] = _f("default", "PEFT's init_lora_weights: 'default' (Kaiming A, B = 0) or "
                                                         "'gaussian' (Gaussian A, B = 0); both leave the policy equal "
                                                         "to the base at step 0, so KL(0) = 0")

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def low_base(self) -> bool:
        """A LoRA run whose learner holds the base in bf16 or int8 (``base_dtype``): the update's forward is not the
        fp32 model's, so the reference must be the policy's own (adapter off), never an engine."""
        return self.enabled and self.base_dtype in ("bf16", "int8")

    @property
    def bf16_base(self) -> bool:
        """A LoRA run whose learner holds the base in bf16: its engine is exported from the rounded base and computes
        in fp32, so the update's forward and the engine differ by rounding."""
        return self.enabled and self.base_dtype == "bf16"

    def __post_init__(self):
        check([(self.r < 0, f"lora.r = {self.r}: a rank is >= 0 (0 = full fine-tuning)"),
               (self.r > 0 and not self.target_modules, "lora.target_modules is empty: name modules or 'all-linear'"),
               (not 0.0 <= self.dropout < 1.0, f"lora.dropout = {self.dropout} is outside [0, 1)"),
               (self.r > 0 and self.alpha <= 0, f"lora.alpha = {self.alpha} must be > 0"),
               (self.learning_rate < 0, f"lora.learning_rate = {self.learning_rate} must be >= 0")])


# transformers' get_scheduler names a job can run (reduce_lr_on_plateau and greedy need an evaluation metric)
SCHEDULES = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup",
             "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


@dataclass(frozen=True)
class OptimSection:
    """AdamW and its schedule."""

    learning_rate: float = _f(5e-5, "AdamW learning rate")
    lr_scheduler_type: Literal[SCHEDULES] = _f("constant", "learning-rate schedule, transformers' get_scheduler by "
                                                           "name (TRL's lr_scheduler_type)")
    lr_scheduler_kwargs: tuple[str, ...] = _f((), "the schedule's own arguments as NAME=VALUE (TRL's "
                                                  "lr_scheduler_kwargs: cosine_with_min_lr min_lr=1e-6 or "
                                                  "min_lr_rate=0.1, cosine_with_restarts num_cycles=2, polynomial "
                                                  "lr_end=1e-7 power=2); VALUE a number or a word")
    warmup_steps: int = _f(0, "optimizer steps of linear warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1, the first moment's decay (TRL's adam_beta1)")
    adam_beta2: float = _f(0.999, "AdamW beta2, the second moment's decay (TRL's adam_beta2)")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon, added to the second moment's root (TRL's adam_epsilon)")
    neftune_noise_alpha: float = _f(0.0, "NEFTune (Jain et al. 2023, as transformers does it): uniform noise in "
                                         "[-a, a], a = alpha / sqrt(L * d), added to the input embeddings of the "
                                         "learner's forward passes in a training step (L: the sequence length, d: "
                                         "the hidden size); never in the engine, the reference or the probe; 0 = off")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step (same update, less memory)")
    micro_batch_rows: int = _f(0, "one-pass update (refit.learner.ppo.onepass): rows per learner forward; 0 = auto, "
                                  "the most whose saved activations and logits fit a quarter of the free memory "
                                  "(at most 4 GiB); never fewer micro-batches than gradient_accumulation_steps")

    def __post_init__(self):
        bad = [kv for kv in self.lr_scheduler_kwargs if "=" not in kv or not kv.partition("=")[0].strip()]
        check([(bool(bad), f"optim.lr_scheduler_kwargs: {bad[:1]} is not NAME=VALUE (e.g. min_lr=1e-6)"),
               (not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1,
                f"optim.adam_beta1 / adam_beta2 = {self.adam_beta1} / {self.adam_beta2}: each in [0, 1)")])


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints (``--resume`` continues from the last one)."""

    save_steps: int = _f(10, "checkpoint every N steps (a multiple of rollout.sync_every)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk")


@dataclass(frozen=True)
class LogSection:
    """What the run writes besides metrics.jsonl."""

    tensorboard: bool = _f(True, "write TensorBoard events")
    plots: bool = _f(True, "write PNG plots at the end")
    progress: bool = _f(True, "show a progress bar")


@dataclass(frozen=True)
class ScaleSection:
    """Scale-out of the rollouts: engines as Ray actors (the learner scales with torchrun)."""

    workers: int = _f(1, "engines per model: N > 1 runs N copies as Ray actors (RayEnginePool; pip install "
                         "'refit[dist]'); the tokens do not depend on N")
    ray_address: str = _f("", "Ray cluster for the rollout workers ('auto', 'HOST:6379'; default $RAY_ADDRESS); "
                              "empty: a local Ray instance on this machine")
    worker_cpus: float = _f(1.0, "Ray CPUs reserved by each engine actor (its engine's threads)")
    worker_gpus: float = _f(-1.0, "Ray GPUs reserved by each engine actor; -1: the backend's share (tensorrt: 1 "
                                  "per PPO engine, 0.5 per distill engine), else 0")


# the flat names of the release before sections, where they are not the field's own name
_RENAMED = {"scale.workers": "rollout_workers", "scale.worker_cpus": "rollout_worker_cpus",
            "scale.worker_gpus": "rollout_worker_gpus"}
NO_FLAT_NAMES = ("lora",)  # sections added after the flat release: they never had flat names
# fields that moved to another section: old dotted path -> new one (read with a deprecation note)
MOVED = {"rollout.temperature": "sampling.temperature"}


def flat_names(cls) -> dict[str, str]:
    """Old flat name -> dotted path, for every section field of ``cls`` (``learning_rate`` ->
    ``optim.learning_rate``; ``student_model_dir`` -> ``student.model_dir``: a model section other than
    ``model`` had its role as prefix; ``rollout_workers`` -> ``scale.workers``). A FLAT section's fields
    (``top_k``) are spelled without prefix already: not old names; nor are the fields of sections born after the
    flat release (``lora``: its ``learning_rate`` must not take ``optim.learning_rate``'s old name)."""
    out, flat = {}, set(flat_leaves(cls).values())
    for path in leaves(cls):
        section, _, leaf = path.partition(".")
        if leaf and path not in flat and section not in NO_FLAT_NAMES:
            old = _RENAMED.get(path) or (f"{section}_{leaf}" if section in ("student", "teacher") else leaf)
            out[old] = path
    out.update({old: new for old, new in MOVED.items() if new in flat or new in out.values()})
    return out


def from_flat(cls, **values):
    """``cls`` from keyword arguments by old flat name (``learning_rate=1e-4``), dotted path or job field."""
    values, _ = resolve(cls, values, flat_names(cls), cls.__name__)
    return build(cls, values)


def parse_job(cls, argv: list[str] | None, prog: str, options: tuple = ()):
    """``refit ppo|distill`` flags -> (frozen ``cls``, options namespace with ``resume`` and ``options``)."""
    resume = ("resume", bool, _f(False, "continue from the last checkpoint in run.output_dir (its config may change "
                                        "only in the run's length, logging and scale-out: refit.learner.run.folder)"))
    overwrite = ("overwrite", bool, _f(False, "replace the run already in run.output_dir (its metrics and checkpoints "
                                              "are deleted) and any engine folder of other weights the run names; "
                                              "without it both are refused"))
    return parse(cls, argv, prog, options=(resume, overwrite, *options), legacy=flat_names(cls))


def save_config(cfg, path) -> str:
    return save_yaml(cfg, path)

