"""``PPOConfig``: the PPO-KL job's fields on top of the shared sections (names as in TRL's ``PPOConfig``).

In Python a config is built with its sections as keywords, each a frozen dataclass of
:mod:`refit.learner.run.config` (``rollout`` and ``sampling``: :mod:`refit.rollout.config`); fields not given keep
their defaults (run it with :func:`refit.learner.api.run_ppo`)::

    PPOConfig(run=RunSection(output_dir="runs/x", steps=50, batch_size=8),
              model=ModelSection(model_dir="models/policy"),
              optim=OptimSection(learning_rate=1e-5), advantage_estimator="grpo", num_generations=8)

``dataclasses.replace(cfg, num_generations=4)`` changes a job field and
``refit.core.parsing.with_values(cfg, **{"optim.learning_rate": 1e-4})`` a section field.
``PPOConfig.from_flat(learning_rate=...)`` takes the previous release's flat names (deprecated).
TRL's GRPO/RLOO names, with their meanings, are taken by :mod:`refit.learner.trl`; in YAML and flags each
is refused with the field that does it (:data:`TRL_HINTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, ClassVar, Literal

from refit.core.errors import RefitError
from refit.core.hf_folder import read_config
from refit.core.parsing import FLAT
from refit.core.validate import validate
from refit.learner.run.config import (CheckpointSection, DataSection, LogSection, LoraSection, ModelSection,
                                      OptimSection, RunSection, ScaleSection, _f, check, from_flat, parse_job)
from refit.learner.run.precision import mixed_bf16
from refit.rollout.config import RolloutSection, Sampling


TRL_HINTS = {
    "per_device_train_batch_size": "run.batch_size counts prompts (TRL's counts completions: run.batch_size = "
                                   "per_device_train_batch_size * gradient_accumulation_steps * steps_per_generation "
                                   "/ num_generations)",
    "max_completion_length": "response_length",
    "max_steps": "run.steps counts rollouts (TRL's max_steps counts optimizer steps: run.steps = max_steps / "
                 "(num_ppo_epochs * num_mini_batches))",
    "beta": "kl_coef with kl_penalty: loss and kl_estimator: k3 (TRL's GRPO beta; Refit's default kl_coef is a k1 "
            "penalty in the reward)",
    "epsilon": "cliprange",
    "epsilon_high": "cliprange_high",
    "num_iterations": "num_ppo_epochs (with minibatch_order: replay, as TRL replays)",
    "steps_per_generation": "num_mini_batches",
    "generation_batch_size": "run.batch_size * num_generations (rows per rollout)",
    "gradient_accumulation_steps": "optim.gradient_accumulation_steps",
    "num_train_epochs": "run.steps (rollouts of run.batch_size prompts)",
    "max_prompt_length": "not supported: prompts are kept whole (a prompt too long for the model is refused)",
    "use_vllm": "rollout.backend (onnxruntime, tensorrt, torch, hf)",
    "vllm_importance_sampling_correction": "mismatch_correction: tis (cap tis_cap) or seq_mask",
    "vllm_importance_sampling_cap": "tis_cap",
    "use_bias_correction_kl": "kl_bias_correction",
    "logging_steps": "not needed: every step is written to metrics.jsonl",
    "save_strategy": "ckpt.save_steps",
    "report_to": "log.tensorboard",
    "per_device_eval_batch_size": "not needed: evaluation runs in engine batches of run.batch_size * num_generations",
    "eval_strategy": "eval_steps",
    "min_p": "not supported (top_k, top_p)",
    "repetition_penalty": "not supported",
    "model_name_or_path": "model.model_dir",
    "dataset_name": "data.dataset (a local file or save_to_disk folder)",
    "dataset_train_split": "data.dataset_split",
    "dataset_test_split": "data.eval_split",
    "gradient_checkpointing": "not supported",
    "lr_scheduler_type": "optim.lr_scheduler_type",
    "warmup_ratio": "optim.warmup_steps (optimizer steps)",
}


@dataclass(frozen=True)
class PPOConfig:
    """PPO-KL with engine rollouts (see ``refit ppo --help`` for every field)."""

    run: RunSection = _f(help_="the run", factory=lambda: RunSection(output_dir="runs/ppo", steps=20))
    model: ModelSection = _f(help_="the policy (also the frozen reference); its engine defaults to OUTPUT_DIR/engine",
                             factory=ModelSection)
    data: DataSection = _f(help_="the embedded prompt set", factory=DataSection)
    rollout: RolloutSection = _f(help_="the rollout engine", factory=RolloutSection)
    optim: OptimSection = _f(help_="the optimizer", factory=lambda: OptimSection(learning_rate=5e-5, warmup_steps=0))
    lora: LoraSection = _f(help_="LoRA: train an adapter over the frozen base (r > 0) instead of full fine-tuning",
                           factory=LoraSection)
    ckpt: CheckpointSection = _f(help_="checkpoints", factory=lambda: CheckpointSection(save_steps=10))
    log: LogSection = _f(help_="logging", factory=LogSection)
    scale: ScaleSection = _f(help_="Ray rollout workers", factory=lambda: ScaleSection(worker_cpus=1.0))
    reward: str = _f("exact_match", "'exact_match', 'module:function', 'path/to/file.py:function' (TRL's signature: "
                                    "fn(prompts, completions, **columns) -> list[float | None]) or an HF "
                                    "sequence-classification folder")
    reward_funcs: tuple[str, ...] = _f((), "several rewards, each a spec as for `reward` (overrides it); summed with "
                                           "reward_weights, None values left out (TRL's nansum); each one's mean "
                                           "logged as reward/NAME/mean")
    reward_weights: tuple[float, ...] = _f((), "one weight per reward function (default 1.0 each), as TRL's "
                                               "GRPOConfig.reward_weights")
    prompts_file: str = _f("", "text file, one prompt per line (overrides data.task; data.dataset overrides it)")
    eval_steps: int = _f(0, "every N steps (a multiple of rollout.sync_every; also at step 0 and the last) generate "
                            "the held-out prompts (data.eval_split / data.eval_fraction) greedily through the engine "
                            "and log their rewards as eval/...; 0 = off")
    eval_max_prompts: int = _f(0, "evaluate at most this many held-out prompts (a fixed seeded choice); 0 = all")
    export_final: bool = _f(True, "at the end of the run write OUTPUT_DIR/final (save_pretrained folder with the "
                                  "tokenizer and chat template), OUTPUT_DIR/final_engine (an engine folder for it) "
                                  "and OUTPUT_DIR/final_value_head.safetensors; with --resume on a finished run "
                                  "only that is done")
    num_generations: int = _f(1, "samples per prompt")
    advantage_estimator: Literal["auto", "gae", "rloo", "grpo"] = _f(
        "auto", "gae: per-token GAE with the value head (critic); rloo: REINFORCE leave-one-out over the "
                "num_generations samples of a prompt; grpo: group mean/std (DeepSeekMath); rloo/grpo need "
                "num_generations > 1 and skip the critic; auto: gae with num_generations 1, and with more it "
                "must be chosen (TRL's GRPO is grpo)")
    scale_rewards: Literal["group", "batch", "none"] | bool = _f(
        "group", "grpo: divide by the group's std ('group', the paper; TRL's True), the batch's std ('batch') or "
                 "not at all ('none', Dr. GRPO; TRL's False); as TRL's GRPOConfig")
    normalize_advantages: bool = _f(False, "rloo: whiten the advantages over the batch, (A - mean) / (std + 1e-4) "
                                           "(TRL RLOOConfig's normalize_advantages)")
    reward_clip_range: tuple[float, ...] = _f((), "(lo, hi): clamp each completion's summed reward to it before the KL "
                                                  "penalty and the baseline (TRL RLOOConfig's reward_clip_range); () "
                                                  "= no clamp")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = _f(
        "sum_then_normalize", "grpo with several reward_funcs: the weighted sum, then the group baseline "
                              "('sum_then_normalize'), or each function normalised within its group, weighted, "
                              "summed and normalised over the batch ('normalize_then_sum', GDPO); as TRL's GRPOConfig")
    mask_truncated_completions: bool = _f(False, "leave completions that reached response_length without a stop "
                                                 "token out of the loss (they still count in their group's baseline; "
                                                 "TRL's mask_truncated_completions, DAPO's overlong filtering)")
    loss_type: Literal["token", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "rloo"] = _f(
        "token", "the policy loss and its normalisation (refit/learner/losses/grpo.py): token: the clipped loss "
                 "over the minibatch's token count (Refit's own); TRL 1.16 GRPO's grpo, bnpo, dr_grpo, dapo, cispo, "
                 "sapo, luspo, vespo, each with TRL's normaliser; rloo: TRL RLOO's ratio of summed log-probs per "
                 "sequence, averaged over sequences")
    cliprange_high: float | None = _f(None, "upper clip 1 + cliprange_high (DAPO's clip-higher; cispo: the cap on "
                                            "the ratio); None: cliprange (TRL's epsilon_high)")
    delta: float | None = _f(None, "two-sided clipping: cap the unclipped ratio at delta (> 1 + cliprange_high; "
                                   "TRL's delta); None: off")
    importance_sampling_level: Literal["token", "sequence"] = _f(
        "token", "sequence: one ratio per completion, exp(mean log ratio) (GSPO; TRL's importance_sampling_level)")
    top_entropy_quantile: float = _f(1.0, "train only on the tokens whose entropy is in this top share of each "
                                          "micro-batch's (1.0: all; TRL's top_entropy_quantile)")
    off_policy_mask_threshold: float | None = _f(
        None, "drop completions with a negative advantage whose mean (old - current) log-prob exceeds this "
              "(DeepSeek-V3.2's off-policy mask; TRL's off_policy_mask_threshold); None: off")
    kl_bias_correction: bool = _f(False, "kl_penalty loss with a TRL loss_type: the KL term times the importance "
                                         "ratio (TRL's use_bias_correction_kl)")
    sapo_temperatures: tuple[float, ...] = _f((1.0, 1.05), "loss_type sapo: (positive, negative) temperatures")
    vespo_params: tuple[float, ...] = _f((2.0, 3.0, 3.0, 2.0), "loss_type vespo: (k_pos, lambda_pos, k_neg, "
                                                               "lambda_neg)")
    minibatch_order: Literal["reshuffle", "replay"] = _f(
        "reshuffle", "the minibatch order over num_ppo_epochs: a new shuffle each pass, or one shuffle replayed "
                     "every pass (TRL's GRPO / RLOO with num_iterations)")
    num_ppo_epochs: int = _f(2, "passes over each rollout batch")
    num_mini_batches: int = _f(2, "minibatches per epoch (one optimizer step each)")
    cliprange: float = _f(0.2, "PPO policy ratio clip")
    cliprange_value: float = _f(0.2, "PPO value clip")
    vf_coef: float = _f(0.1, "value loss coefficient")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient (with entropy_target: its starting value)")
    entropy_target: float | None = _f(
        None, "adaptive entropy bonus (TRL's use_adaptive_entropy; a TRL loss_type): after every optimizer step the "
              "coefficient moves by entropy_coef_delta, up when the step's mean entropy is at or below this target, "
              "down otherwise, and a step applies it only when the step before ended at or below it; None: fixed")
    entropy_coef_delta: float = _f(0.005, "adaptive entropy bonus: the coefficient's step")
    entropy_coef_min: float = _f(0.0, "adaptive entropy bonus: the coefficient's floor")
    entropy_coef_max: float = _f(1.0, "adaptive entropy bonus: the coefficient's cap")
    router_aux_loss_coef: float = _f(0.0, "a Mixture-of-Experts policy's load-balancing loss (the model's own "
                                          "aux_loss from its router logits) times this, added to a TRL loss_type's "
                                          "loss (TRL's GRPO / RLOO router_aux_loss_coef); 0: none")
    gamma: float = _f(1.0, "GAE discount")
    lam: float = _f(0.95, "GAE lambda")
    whiten_rewards: bool = _f(False, "whiten per-token rewards before GAE")
    kl_coef: float = _f(0.05, "KL coefficient (initial value when adap_kl_ctrl)")
    kl_estimator: Literal["k1", "k2", "k3", "exact"] = _f("k1", "KL estimator for the penalty")
    kl_penalty: Literal["reward", "loss"] = _f("reward", "'reward': per-token penalty in the reward; 'loss': a KL "
                                                         "term in the loss")
    adap_kl_ctrl: bool = _f(False, "adaptive KL coefficient (Ziegler et al. 2019)")
    target: float = _f(6.0, "adaptive KL: target KL per sequence")
    horizon: float = _f(10000.0, "adaptive KL: horizon")
    response_length: int = _f(8, "max new tokens per response")
    sampling: Annotated[Sampling, FLAT] = _f(help_="", factory=Sampling)  # --top_k, --top_p (no prefix)
    mismatch_correction: Literal["auto", "none", "tis", "seq_mask"] = _f(
        "auto", "rollout/learner mismatch correction: tis (truncated importance sampling, weights "
                "min(pi_learner / pi_engine, tis_cap)), seq_mask (drop sequences that disagree by more than "
                "seq_mask_threshold), none; auto: tis with a quantized engine (rollout.quantize), overlapped "
                "generation (rollout.max_staleness >= 1: the batch comes from older weights) or a bf16 learner "
                "(lora.base_dtype, run.precision), else none")
    tis_cap: float = _f(2.0, "truncated importance sampling cap C")
    tis_warn_below: float = _f(0.5, "tis: warn (once) when the mean truncated importance weight, the factor that "
                                    "scales the policy gradient, falls below this")
    seq_mask_threshold: float = _f(1.0, "seq_mask: drop sequences whose max |logprob diff| exceeds this")
    ref_backend: Literal["auto", "torch", "onnxruntime"] = _f(
        "auto", "where the frozen reference scores ref_logprobs (and the exact KL): 'onnxruntime' on the exported "
                "reference engine (the policy's engine folder, never pushed), 'torch' a PyTorch forward; auto: "
                "onnxruntime when rollout.backend is an engine (onnxruntime, tensorrt)")
    probe_on_rollout: bool = _f(True, "check each weight push on the first rollout after it: the engine's plain "
                                      "log-probs vs the learner's old log-probs on every response token (computed "
                                      "anyway, so the check is free), stopping before the update when they differ "
                                      "by more than rollout.probe_tol; the run's last push is checked on the fixed "
                                      "greedy probe batch; false: the probe batch after every push")
    single_pass: bool = _f(True, "take the old log-probs from the update's own forward (run before the optimizer "
                                 "step, so they are the same numbers) instead of a separate scoring forward, "
                                 "where the step allows it: one epoch and one minibatch, and either no value head, "
                                 "no KL in the reward and no seq_mask (micro-batch by micro-batch, any "
                                 "accumulation; refit/learner/ppo/onepass.py) or no accumulation (the whole batch "
                                 "in one forward); false: always a separate scoring pass")
    reference: Literal["auto", "always"] = _f(
        "auto", "when the frozen reference is scored: auto, only when the KL is in the objective (kl_coef > 0; "
                "TRL's GRPO at beta 0 loads no reference either, and the step then logs no kl/* figures); "
                "always, every step (the kl/* metrics at kl_coef 0)")
    reference_ahead: bool = _f(False, "one-pass update with an engine reference: score the next micro-batch's "
                                      "reference on a thread of its own while the learner computes this one (off: "
                                      "on 2 cores it was slower than scoring in turn, docs/fast-by-default.md)")
    sync_ref_model: bool = _f(False, "TR-DPO's reference sync (TRL's sync_ref_model): every ref_model_sync_steps "
                                     "optimizer steps the reference becomes ref_model_mixup_alpha x policy + (1 - "
                                     "alpha) x reference (an engine reference takes the mix as a push); needs the "
                                     "reference scored (kl_coef > 0 or reference always) and no LoRA "
                                     "(refit.learner.ppo.refsync)")
    ref_model_mixup_alpha: float = _f(0.6, "sync_ref_model: the policy's share alpha in each mix")
    ref_model_sync_steps: int = _f(512, "sync_ref_model: optimizer steps between mixes (a multiple of "
                                        "num_ppo_epochs x num_mini_batches, the optimizer steps of one Refit step)")
    num_generations_eval: int = _f(0, "held-out evaluation: 0 one greedy completion per prompt; N > 0 N sampled "
                                      "completions per prompt at the training sampling settings (TRL's "
                                      "num_generations_eval), seeded by (seed, step)")

    from_flat = classmethod(from_flat)

    # TRL names this config does not take -> the Refit field that does it, for the one-line refusal in YAML and
    # flags (refit.core.parsing reads NAME_HINTS); refit.learner.trl.GRPOConfig takes them with TRL's meanings
    NAME_HINTS: ClassVar[dict[str, str]] = TRL_HINTS

    @property
    def correction(self) -> str:
        """``mismatch_correction`` resolved: 'auto' is 'tis' with a quantized rollout engine or with overlapped
        generation (``rollout.max_staleness`` >= 1: the engine's log-probs are the behaviour policy's, the
        learner's old log-probs the proximal policy's, AReaL's decoupled PPO) or with a bf16 learner (a LoRA base held
        in bf16, ``lora.base_dtype``, or full fine-tuning under bf16 autocast, ``run.precision``: the engine computes
        in fp32), else 'none'. An unresolved ``rollout.quantize auto`` reads as none (refit.learner.run.precision)."""
        if self.mismatch_correction != "auto":
            return self.mismatch_correction
        return ("tis" if self.rollout.quantize == "int8" or self.rollout.max_staleness > 0 or self.lora.low_base
                or mixed_bf16(self) else "none")

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL's bool: True is "group", False is "none"
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        validate(self)  # the value ranges first (refit.core.validate.RULES), then the cross-field rules
        if self.advantage_estimator == "auto":
            check([(self.num_generations > 1,
                    f"num_generations={self.num_generations} needs advantage_estimator chosen: grpo (TRL's GRPO: "
                    "group mean/std, no critic), rloo (leave-one-out, no critic) or gae (PPO with a value head on "
                    "each of the samples)")])
            object.__setattr__(self, "advantage_estimator", "gae")
        rows = self.run.batch_size * self.num_generations
        check([
            (self.advantage_estimator != "gae" and self.num_generations < 2,
             f"advantage_estimator={self.advantage_estimator} needs num_generations >= 2 (a group per prompt)"),
            (self.eval_steps < 0 or (self.eval_steps and self.eval_steps % self.rollout.sync_every),
             "eval_steps must be >= 0 and a multiple of rollout.sync_every (evaluation runs through the engine)"),
            (bool(self.data.eval_split) and self.data.eval_fraction > 0,
             "give data.eval_split or data.eval_fraction, not both"),
            (len(self.reward_weights) not in (0, len(self.reward_funcs) or 1),
             "reward_weights needs one weight per reward function"),
            (rows % self.num_mini_batches != 0, "run.batch_size * num_generations must be divisible by "
                                                "num_mini_batches"),
            ((rows // self.num_mini_batches) % self.optim.gradient_accumulation_steps,
             "minibatch size must be divisible by optim.gradient_accumulation_steps"),
            (self.ckpt.save_steps % self.rollout.sync_every != 0,
             "ckpt.save_steps must be a multiple of rollout.sync_every (a checkpoint must match the weights the "
             "engine holds)"),
            (self.run.steps < 1, "run.steps must be >= 1"),
            *self._trl_loss_rules(),
            (self.delta is not None and self.delta <= 1 + (self.cliprange if self.cliprange_high is None
                                                            else self.cliprange_high),
             "delta must be > 1 + cliprange_high (TRL's two-sided clipping)"),
            (len(self.reward_clip_range) not in (0, 2) or (len(self.reward_clip_range) == 2
                                                           and self.reward_clip_range[0] > self.reward_clip_range[1]),
             "reward_clip_range is (lo, hi) with lo <= hi, or ()"),
            (len(self.sapo_temperatures) != 2 or len(self.vespo_params) != 4,
             "sapo_temperatures is (positive, negative); vespo_params (k_pos, lambda_pos, k_neg, lambda_neg)"),
            (self.multi_objective_aggregation != "sum_then_normalize" and self.advantage_estimator != "grpo",
             "multi_objective_aggregation normalize_then_sum is GRPO's (advantage_estimator grpo)"),
            (self.scale.workers < 1, "scale.workers must be >= 1"),
            (self.scale.worker_cpus <= 0, "scale.worker_cpus must be > 0"),
            (self.lora.enabled and self.rollout.backend in ("torch", "hf"),
             f"lora needs an engine backend: onnxruntime (the adapter as bound inputs) or tensorrt (a refit of the "
             f"merged targeted layers); the {self.rollout.backend} backend takes no adapter push (docs/lora.md)"),
            (self.lora.enabled and self.scale.workers > 1, "lora with scale.workers > 1 is not built: Ray engine "
                                                            "workers take full-model pushes only"),
            (self.sync_ref_model and self.lora.enabled,
             "sync_ref_model with lora: a LoRA run's reference is the base with the adapter off (the policy's own "
             "frozen weights), there is no separate reference to mix (TRL 1.16 refuses sync_ref_model with PEFT too)"),
            (self.sync_ref_model and not (self.kl_coef > 0 or self.reference == "always"),
             "sync_ref_model at kl_coef 0: the reference is never scored, there is nothing to sync (TRL refuses it at "
             "beta 0 too); set kl_coef > 0 or reference always"),
            (self.sync_ref_model and self.ref_model_sync_steps % (self.num_ppo_epochs * self.num_mini_batches),
             f"ref_model_sync_steps={self.ref_model_sync_steps} must be a multiple of num_ppo_epochs x "
             f"num_mini_batches = {self.num_ppo_epochs * self.num_mini_batches}: Refit mixes the reference at the end "
             "of a step's optimizer steps"),
            (self.lora.low_base and self.ref_backend == "onnxruntime",
             f"ref_backend onnxruntime with lora.base_dtype {self.lora.base_dtype}: the engine's arithmetic is not the "
             f"{self.lora.base_dtype} policy's, so KL(0) would not be 0; the reference must compute as the policy does "
             "(ref_backend auto or torch: the policy with its adapter off)"),
            (self.lora.enabled and self.lora.base_dtype == "int8" and self.rollout.quantize == "none",
             "lora.base_dtype int8 holds the base as the int8 engine does: set rollout.quantize int8 (or auto)"),
            (mixed_bf16(self) and self.ref_backend == "onnxruntime",
             "ref_backend onnxruntime with run.precision bf16: the engine computes in fp32, the policy under bf16 "
             "autocast, so KL(0) would not be 0; the reference must compute as the policy does (ref_backend auto or "
             "torch), or run.precision fp32"),
        ])


    def _trl_loss_rules(self) -> list[tuple[bool, str]]:
        """The cross-field rules of TRL's loss settings (loss_type and the fields only its types take)."""
        return [
            (self.loss_type != "token" and self.advantage_estimator == "gae",
             f"loss_type={self.loss_type} is TRL's GRPO / RLOO loss: advantage_estimator grpo or rloo"),
            (self.loss_type == "rloo" and (self.entropy_coef != 0 or self.kl_penalty == "loss"),
             "loss_type=rloo is TRL RLOO's loss: no entropy bonus, the KL in the reward (kl_penalty reward)"),
            (self.loss_type == "rloo" and self.importance_sampling_level != "token",
             "loss_type=rloo has its own sequence ratio (importance_sampling_level token)"),
            (self.loss_type == "token" and (self.cliprange_high is not None or self.delta is not None
                                            or self.importance_sampling_level != "token"
                                            or self.top_entropy_quantile < 1
                                            or self.off_policy_mask_threshold is not None),
             "cliprange_high, delta, importance_sampling_level, top_entropy_quantile and off_policy_mask_threshold "
             "need a TRL loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo)"),
            (not 0 < self.top_entropy_quantile <= 1, "top_entropy_quantile must be in (0, 1]"),
            (self.entropy_target is not None and self.loss_type in ("token", "rloo"),
             "entropy_target (the adaptive entropy bonus) needs a GRPO loss_type (grpo, bnpo, dr_grpo, dapo, cispo, "
             "sapo, luspo, vespo), as TRL's use_adaptive_entropy"),
            (self.entropy_target is not None and self.entropy_coef_min > self.entropy_coef_max,
             "entropy_coef_min must be <= entropy_coef_max"),
            (self.router_aux_loss_coef != 0 and self.loss_type == "token",
             "router_aux_loss_coef needs a TRL loss_type (grpo, ..., rloo)"),
        ]

def parse_ppo(argv: list[str] | None) -> tuple[PPOConfig, SimpleNamespace]:
    """``refit ppo``'s flags and YAML, and its policy folder read as a checkpoint (config.json, weights), all
    without torch: the front door answers a wrong flag, bad YAML or a missing folder before the heavy imports,
    and before a run folder is made."""
    cfg, opts = parse_job(PPOConfig, argv, "refit ppo")
    if not cfg.model.model_dir:
        raise RefitError("--model.model_dir is required (a policy HF checkpoint folder); `refit demo` builds one for you")
    read_config(cfg.model.model_dir)  # missing, not a checkpoint, a Hub id: one line
    return cfg, opts
