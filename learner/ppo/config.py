"""``PPOConfig``: the PPO-KL job's fields (names as in TRL's ``PPOConfig`` where TRL has one)."""

from __future__ import annotations

from dataclasses import dataclass

from export.errors import RefitError
from learner.run.config import _f


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
    tis_warn_below: float = _f(0.5, "tis: warn (once) when the mean truncated importance weight, the factor that "
                                    "scales the policy gradient, falls below this")
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
