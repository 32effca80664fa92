"""Job configs: one frozen dataclass per job, parsed from YAML and flags by HfArgumentParser.

Field names follow TRL's ``PPOConfig`` where TRL has a name (``learning_rate``, ``num_ppo_epochs``,
``num_mini_batches``, ``gradient_accumulation_steps``, ``cliprange``, ``cliprange_value``,
``vf_coef``, ``gamma``, ``lam``, ``kl_coef``, ``kl_estimator``, ``whiten_rewards``,
``response_length``, ``temperature``, ``adap_kl_ctrl``/``target``/``horizon`` from TRL < 0.12).
Precedence: defaults < YAML file (``--config``) < command-line flags. The resolved config is
printed and saved with the run (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from export.errors import RefitError


def _f(default, help_: str, **kw):
    return field(default=default, metadata={"help": help_, **kw})


@dataclass(frozen=True)
class PPOConfig:
    """PPO-KL with engine rollouts (see ``refit ppo --help`` for every field)."""

    model_dir: str = _f("", "policy HF checkpoint folder (also the frozen reference)")
    output_dir: str = _f("runs/ppo", "run folder: metrics.jsonl, TensorBoard events, plots, checkpoints, engine")
    engine_dir: str = _f("", "policy engine folder (default: OUTPUT_DIR/engine; exported or reused)")
    backend: str = _f("onnxruntime", "rollout engine backend ('hf': transformers generate(), the baseline)",
                      choices=["onnxruntime", "torch", "tensorrt", "hf"])
    reward: str = _f("exact_match", "'exact_match', 'module:function' or an HF sequence-classification folder")
    task: str = _f("addition", "embedded prompt set when no prompts_file is given", choices=["addition", "sort"])
    prompts_file: str = _f("", "text file, one prompt per line (overrides task)")
    num_prompts: int = _f(512, "embedded task: number of training prompts")
    max_operand: int = _f(30, "embedded addition task: operands are in [0, max_operand]")
    seed: int = _f(0, "seed for data order, sampling and minibatches (each step derives its own)")
    steps: int = _f(20, "PPO iterations (rollout + update)")
    batch_size: int = _f(32, "prompts per iteration")
    num_generations: int = _f(1, "samples per prompt")
    num_ppo_epochs: int = _f(2, "passes over each rollout batch")
    num_mini_batches: int = _f(2, "minibatches per epoch (one optimizer step each)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per minibatch (same update, less memory)")
    learning_rate: float = _f(5e-5, "AdamW learning rate")
    lr_scheduler_type: str = _f("constant", "learning-rate schedule", choices=["constant", "linear", "cosine"])
    warmup_steps: int = _f(0, "optimizer steps of linear warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    cliprange: float = _f(0.2, "PPO policy ratio clip")
    cliprange_value: float = _f(0.2, "PPO value clip")
    vf_coef: float = _f(0.1, "value loss coefficient")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    gamma: float = _f(1.0, "GAE discount")
    lam: float = _f(0.95, "GAE lambda")
    whiten_rewards: bool = _f(False, "whiten per-token rewards before GAE")
    kl_coef: float = _f(0.05, "KL coefficient (initial value when adap_kl_ctrl)")
    kl_estimator: str = _f("k1", "KL estimator for the penalty", choices=["k1", "k2", "k3", "exact"])
    kl_penalty: str = _f("reward", "'reward': per-token penalty in the reward; 'loss': a KL term in the loss",
                         choices=["reward", "loss"])
    adap_kl_ctrl: bool = _f(False, "adaptive KL coefficient (Ziegler et al. 2019)")
    target: float = _f(6.0, "adaptive KL: target KL per sequence")
    horizon: float = _f(10000.0, "adaptive KL: horizon")
    response_length: int = _f(8, "max new tokens per response")
    temperature: float = _f(1.0, "sampling and learner temperature")
    top_k: int = _f(0, "sampling top-k (0 = off); corrected for by mismatch_correction")
    top_p: float = _f(1.0, "sampling top-p (1 = off)")
    mismatch_correction: str = _f("none", "rollout/learner mismatch correction",
                                  choices=["none", "tis", "seq_mask"])
    tis_cap: float = _f(2.0, "truncated importance sampling cap C")
    seq_mask_threshold: float = _f(1.0, "seq_mask: drop sequences whose max |logprob diff| exceeds this")
    sync_every: int = _f(1, "push weights into the engine every N steps")
    probe_tol: float = _f(1e-3, "max |logprob diff| engine vs learner on the probe batch after a push")
    probe_size: int = _f(8, "rows in the fixed probe batch")
    save_steps: int = _f(10, "checkpoint every N steps (a multiple of sync_every)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk")
    max_steps_this_run: int = _f(0, "stop after this many steps in this process (0 = no limit); for tests")
    engine_threads: int = _f(0, "engine intra-op threads (0 = runtime default)")
    rollout_workers: int = _f(1, "rollout engines: N > 1 runs N copies of the engine as Ray actors (RayEnginePool; "
                                 "pip install 'refit[dist]'); the tokens do not depend on N")
    ray_address: str = _f("", "Ray cluster for the rollout workers ('auto', 'HOST:6379'; default $RAY_ADDRESS); "
                              "empty: a local Ray instance on this machine")
    rollout_worker_cpus: float = _f(1.0, "Ray CPUs reserved by each rollout worker (its engine's threads)")
    rollout_worker_gpus: float = _f(-1.0, "Ray GPUs reserved by each rollout worker; -1: 1 for the tensorrt "
                                          "backend, else 0")
    device: str = _f("auto", "learner device: auto (CUDA when present), cpu, cuda")
    bf16: bool = _f(True, "bf16 autocast for the learner forward on CUDA (ignored on CPU)")
    tensorboard: bool = _f(True, "write TensorBoard events")
    plots: bool = _f(True, "write PNG plots at the end")
    progress: bool = _f(True, "show a progress bar")

    def __post_init__(self):
        checks = [
            (self.batch_size * self.num_generations % self.num_mini_batches != 0,
             "batch_size * num_generations must be divisible by num_mini_batches"),
            ((self.batch_size * self.num_generations // self.num_mini_batches) % self.gradient_accumulation_steps,
             "minibatch size must be divisible by gradient_accumulation_steps"),
            (self.save_steps % self.sync_every != 0, "save_steps must be a multiple of sync_every (a checkpoint "
                                                     "must match the weights the engine holds)"),
            (self.steps < 1, "steps must be >= 1"),
            (self.rollout_workers < 1, "rollout_workers must be >= 1"),
            (self.rollout_worker_cpus <= 0, "rollout_worker_cpus must be > 0"),
        ]
        for bad, msg in checks:
            if bad:
                raise RefitError(f"config: {msg}")


def parse_config(cls, argv: list[str] | None, prog: str):
    """``--config FILE.yaml`` plus flags -> a frozen ``cls``; unknown YAML keys are an error."""
    import argparse

    from transformers import HfArgumentParser

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(cls, prog=prog, description=cls.__doc__)
    parser.add_argument("--config", default=None, help="YAML file with any of the fields below; flags override it")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    if known.config:
        path = Path(known.config)
        if not path.exists():
            raise RefitError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        values = _flatten_sections(values, names)
        unknown = sorted(set(values) - names)
        if unknown:
            raise RefitError(f"config file {path}: unknown fields {unknown}")
        parser.set_defaults(**values)
    # -> (cfg, namespace of the non-dataclass flags, remaining strings)
    outs = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    cfg, extra = outs[0], outs[-1]
    if extra:
        raise RefitError(f"unknown arguments: {' '.join(extra)}")
    resume = any(getattr(o, "resume", False) for o in outs[1:-1])
    return cfg, resume


def _flatten_sections(values: dict, names: set[str]) -> dict:
    """``rollout: {workers: 2, ray_address: auto}`` -> ``rollout_workers: 2, ray_address: auto``.

    A YAML mapping under a key that is not a field is a section: each ``key: value`` in it becomes the
    field ``SECTION_key`` if there is one, else ``key``; anything else stays as it is (and is reported
    as unknown). Flags stay flat (``--rollout_workers 2``).
    """
    out = {}
    for k, v in values.items():
        if isinstance(v, dict) and k not in names:
            for sub, x in v.items():
                flat = f"{k}_{sub}" if f"{k}_{sub}" in names else sub if sub in names else f"{k}.{sub}"
                out[flat] = x
        else:
            out[k] = v
    return out


def save_config(cfg, path: Path) -> str:
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    path.write_text(text)
    return text


DISTILL_LOSSES = ("jsd", "forward_kl", "reverse_kl", "ce", "topk_kl")
FULL_VOCAB_LOSSES = ("jsd", "forward_kl", "reverse_kl")  # need full teacher logits: PyTorch teacher


@dataclass(frozen=True)
class DistillConfig:
    """Knowledge distillation with generation on engines: supervised KD, sequence-level KD, on-policy GKD.

    Names follow TRL's ``GKDConfig`` where TRL has one (``lmbda``, ``beta``, ``temperature``,
    ``max_new_tokens``, ``seq_kd``, ``learning_rate``, ...). With no model folders the embedded
    default builds a teacher (4x128 GPT-2, SFT on addition) and a student (2x64) locally.
    ``refit distill --build-models DIR`` only builds those two (and their engines) and exits.
    """

    student_model_dir: str = _f("", "student HF checkpoint folder (empty, with teacher_model_dir empty: the "
                                    "embedded default builds both under OUTPUT_DIR/models)")
    teacher_model_dir: str = _f("", "teacher HF checkpoint folder; same tokenizer and vocabulary as the student")
    output_dir: str = _f("runs/distill", "run folder: metrics.jsonl, TensorBoard events, curves.png, checkpoints",
                         aliases=["-o"])
    student_engine_dir: str = _f("", "student engine folder (default OUTPUT_DIR/student_engine, embedded default "
                                     "OUTPUT_DIR/models/student_engine; exported, or reused if from the same weights)")
    teacher_engine_dir: str = _f("", "teacher engine folder (default OUTPUT_DIR/teacher_engine, embedded default "
                                     "OUTPUT_DIR/models/teacher_engine; exported, or reused if from the same weights)")
    backend: str = _f("onnxruntime", "engine backend of teacher and student",
                      choices=["onnxruntime", "torch", "tensorrt"])
    loss: str = _f("topk_kl", "topk_kl: forward KL on the teacher engine's top-k (+ tail bucket); jsd / forward_kl "
                              "/ reverse_kl: full vocabulary, teacher logits from the PyTorch teacher; ce: "
                              "sequence-level KD, cross-entropy on teacher tokens (needs seq_kd, lmbda=0)",
                   choices=list(DISTILL_LOSSES))
    lmbda: float = _f(0.5, "GKD: probability that a step's batch is generated by the student engine (on-policy); "
                           "drawn per step from (seed, step)")
    beta: float = _f(0.5, "generalized JSD interpolation (loss=jsd): 0 = KL(teacher||student), "
                          "1 = KL(student||teacher)")
    seq_kd: bool = _f(False, "sequence-level KD: off-policy batches are generated by the teacher engine (with its "
                             "top-k in the same pass) instead of read from the dataset")
    temperature: float = _f(1.0, "sampling temperature of student (on-policy) and teacher (seq_kd) generation")
    loss_temperature: float = _f(1.0, "temperature of both distributions inside the loss (teacher scores too)")
    teacher_topk: int = _f(32, "k of the teacher's top-k log-probs: score(topk=k), or generate(return_topk=k) "
                               "in seq_kd")
    max_new_tokens: int = _f(6, "max tokens per generated response (dataset completions are cut to it too)")
    task: str = _f("addition", "embedded prompt/answer set when no dataset_file is given", choices=["addition", "sort"])
    dataset_file: str = _f("", "JSONL with 'prompt' and 'completion' per line (overrides task); the last eval_size "
                               "lines are held out")
    num_prompts: int = _f(1000, "embedded task: examples drawn (distinct prompts are kept, eval_size held out)")
    max_operand: int = _f(9, "embedded addition task: operands in [0, max_operand]")
    eval_size: int = _f(32, "held-out prompts for KL-to-teacher and accuracy")
    seed: int = _f(0, "seed for data order, the lmbda draw, sampling (each step derives its own)")
    steps: int = _f(300, "distillation steps (one batch and one optimizer step each)")
    batch_size: int = _f(32, "prompts per step")
    gradient_accumulation_steps: int = _f(1, "micro-batches per step (same update, less memory)")
    learning_rate: float = _f(3e-3, "AdamW learning rate")
    lr_scheduler_type: str = _f("constant", "learning-rate schedule", choices=["constant", "linear", "cosine"])
    warmup_steps: int = _f(10, "optimizer steps of linear warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    sync_every: int = _f(1, "push student weights into the student engine every N steps (on-policy batches lag "
                            "by at most N-1 updates)")
    probe_tol: float = _f(1e-3, "max |logprob diff| student engine vs learner on the probe batch after a push")
    probe_size: int = _f(8, "rows in the fixed probe batch")
    eval_every: int = _f(50, "held-out KL and accuracy every N steps (a multiple of sync_every); also at 0 and the end")
    save_steps: int = _f(100, "checkpoint every N steps (a multiple of sync_every)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk")
    max_steps_this_run: int = _f(0, "stop after this many steps in this process (0 = no limit); for tests")
    teacher_sft_steps: int = _f(200, "embedded default only: SFT steps that make the local teacher")
    engine_threads: int = _f(0, "engine intra-op threads (0 = runtime default)")
    rollout_workers: int = _f(1, "engines per model: N > 1 runs N teacher and N student engines as Ray actors "
                                 "(RayEnginePool; pip install 'refit[dist]'); the tokens do not depend on N")
    ray_address: str = _f("", "Ray cluster for the rollout workers ('auto', 'HOST:6379'; default $RAY_ADDRESS); "
                              "empty: a local Ray instance on this machine")
    rollout_worker_cpus: float = _f(0.5, "Ray CPUs reserved by each engine actor (a teacher and a student actor "
                                         "share one CPU by default)")
    rollout_worker_gpus: float = _f(-1.0, "Ray GPUs reserved by each engine actor; -1: 0.5 for the tensorrt "
                                          "backend, else 0")
    device: str = _f("auto", "learner device: auto (CUDA when present), cpu, cuda")
    tensorboard: bool = _f(True, "write TensorBoard events")
    plots: bool = _f(True, "write PNG plots at the end")
    progress: bool = _f(True, "show a progress bar")

    def __post_init__(self):
        seq_topk = self.seq_kd and self.loss == "topk_kl" and self.loss_temperature != self.temperature
        checks = [
            (not 0.0 <= self.lmbda <= 1.0, f"lmbda must be in [0, 1], got {self.lmbda}"),
            (not 0.0 <= self.beta <= 1.0, f"beta must be in [0, 1], got {self.beta}"),
            (self.loss == "ce" and (not self.seq_kd or self.lmbda > 0),
             "loss=ce is sequence-level KD: it needs seq_kd=true and lmbda=0 (CE on dataset or student tokens "
             "is not distillation)"),
            (self.seq_kd and self.loss in FULL_VOCAB_LOSSES,
             f"seq_kd with loss={self.loss} would need a second teacher pass for full logits; use loss=ce or "
             "topk_kl (the teacher's generation pass returns its top-k)"),
            (seq_topk, "seq_kd with loss=topk_kl takes the teacher's top-k from generation at `temperature`; "
                       "set loss_temperature equal to temperature"),
            (self.loss == "topk_kl" and self.teacher_topk < 1, "loss=topk_kl needs teacher_topk >= 1"),
            (self.save_steps % self.sync_every != 0, "save_steps must be a multiple of sync_every (a checkpoint "
                                                     "must match the weights the student engine holds)"),
            (self.eval_every % self.sync_every != 0, "eval_every must be a multiple of sync_every (accuracy is "
                                                     "measured through the student engine)"),
            (self.batch_size % self.gradient_accumulation_steps != 0,
             "batch_size must be divisible by gradient_accumulation_steps"),
            (self.steps < 1 or self.eval_size < 1, "steps and eval_size must be >= 1"),
            (self.temperature <= 0 or self.loss_temperature <= 0, "temperatures must be > 0"),
            (self.rollout_workers < 1, "rollout_workers must be >= 1"),
            (self.rollout_worker_cpus <= 0, "rollout_worker_cpus must be > 0"),
        ]
        for bad, msg in checks:
            if bad:
                raise RefitError(f"config: {msg}")
