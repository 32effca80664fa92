"""The tables of every TRL / ``transformers.TrainingArguments`` field the facade knows, each sorted into its kind.

- **honoured**: changes the run as it does in TRL; the note names the Refit setting it becomes;
- **accepted**: taken and changes nothing in a Refit run; the note says why;
- **refused**: only TRL's default is taken; any other value is one line saying what Refit does instead.

The one owner of that sorting: the configs take their names and defaults from here, :mod:`refit.learner.trl.fields`
checks given values against it and generates docs/trl-facade.md's table from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
KINDS = (HONOURED, ACCEPTED, REFUSED)


@dataclass(frozen=True)
class TrlField:
    """One TRL name: its kind, TRL's default (for a refused one: the only value taken) and the note."""

    kind: str  # HONOURED | ACCEPTED | REFUSED
    default: Any  # TRL's default value
    note: str  # honoured: the Refit setting; accepted: why it changes nothing; refused: what Refit does instead


def _h(default, note):
    return TrlField(HONOURED, default, note)


def _a(default, note):
    return TrlField(ACCEPTED, default, note)


def _r(default, note):
    return TrlField(REFUSED, default, note)


_NO_EFFECT = "no effect on the numbers"
_LOGS = "Refit logs every step to metrics.jsonl (completions: OUTPUT_DIR/completions.jsonl via log_extra)"

# transformers.TrainingArguments: the fields a CPU script sets, common to all four configs
TRAINING_ARGS: dict[str, TrlField] = {
    "output_dir": _h("trainer_output", "run.output_dir"),
    "seed": _h(42, "run.seed (data order, sampling, minibatches)"),
    "use_cpu": _h(False, "run.device = 'cpu' (False: 'auto', CUDA when present)"),
    "no_cuda": _h(False, "as use_cpu (its older name)"),
    "per_device_train_batch_size": _h(8, "the batch (see the trainer's mapping)"),
    "gradient_accumulation_steps": _h(1, "optim.gradient_accumulation_steps"),
    "max_steps": _h(-1, "run.steps (in optimizer steps, as TRL counts)"),
    "num_train_epochs": _h(3.0, "run.steps when max_steps <= 0: epochs x training prompts / prompts per step"),
    "learning_rate": _h(5e-5, "optim.learning_rate"),
    "lr_scheduler_type": _h("linear", "optim.lr_scheduler_type: transformers' get_scheduler, every schedule but "
                                      "reduce_lr_on_plateau and greedy (they need an evaluation metric each step)"),
    "lr_scheduler_kwargs": _h(None, "optim.lr_scheduler_kwargs (NAME=VALUE), get_scheduler's scheduler_specific_kwargs "
                                    "(cosine_with_min_lr's min_lr / min_lr_rate, num_cycles, ...)"),
    "warmup_steps": _h(0, "optim.warmup_steps"),
    "warmup_ratio": _h(0.0, "optim.warmup_steps = ratio x optimizer steps"),
    "weight_decay": _h(0.0, "optim.weight_decay"),
    "max_grad_norm": _h(1.0, "optim.max_grad_norm"),
    "bf16": _h(None, "None: run.precision auto (bf16 where the device has bf16 units, else fp32); True: run.precision "
                     "bf16 (also where bf16 is emulated); False: run.bf16 false (the learner fp32)"),
    "report_to": _h("none", "'none' / [] : no TensorBoard; 'tensorboard' / 'all': log.tensorboard; a remote "
                            "tracker (wandb, ...) is refused: nothing leaves the machine"),
    "disable_tqdm": _h(False, "log.progress = not disable_tqdm"),
    "logging_steps": _h(10, "state.log_history and on_log every N optimizer steps, each value the mean over "
                            "them (a float < 1: of max_steps); metrics.jsonl keeps every step"),
    "logging_strategy": _h("steps", "'steps' or 'no' (no log_history rows, no on_log)"),
    "logging_first_step": _h(False, "a log_history row and on_log after the first step"),
    "save_steps": _h(500, "ckpt.save_steps (a float < 1: of max_steps), and the last step, as TRL; each save writes "
                          "Refit's checkpoint and TRL's OUTPUT_DIR/checkpoint-N view of it; should_save from a "
                          "callback saves too"),
    "save_strategy": _h("steps", "'steps' (save_steps) or 'no' (no checkpoint-N, as TRL; Refit keeps one checkpoint, "
                                 "at the last step, for its own --resume)"),
    "save_total_limit": _h(None, "ckpt.keep_checkpoints (None: 0, every checkpoint kept, as TRL); the checkpoint-N "
                                 "views follow Refit's checkpoints, but best_model_checkpoint is kept as transformers "
                                 "keeps it"),
    "eval_strategy": _h("no", "'steps': Refit's held-out evaluation of eval_dataset every eval_steps (PPO: "
                              "eval_steps, greedy, one completion a prompt; distillation: eval_every, KL to the "
                              "teacher); 'no': at the last step only, for evaluate()"),
    "eval_on_start": _a(False, "Refit evaluates at step 0 whenever it evaluates (metrics.jsonl's step-0 row; no "
                               "log_history row)"),
    "eval_steps": _h(None, "optimizer steps between evaluations (None: logging_steps, as TRL; a float < 1: of "
                           "max_steps)"),
    "logging_dir": _a(None, "TensorBoard events go to OUTPUT_DIR/tb"),
    "run_name": _a(None, _NO_EFFECT),
    "log_level": _a("passive", _NO_EFFECT),
    "log_level_replica": _a("warning", _NO_EFFECT),
    "overwrite_output_dir": _a(False, _NO_EFFECT),
    "do_train": _a(False, _NO_EFFECT),
    "dataloader_num_workers": _a(0, "prompts are read in-process; there is no DataLoader"),
    "dataloader_pin_memory": _a(True, "there is no DataLoader"),
    "dataloader_persistent_workers": _a(False, "there is no DataLoader"),
    "gradient_checkpointing": _a(True, "memory only, not numbers"),
    "gradient_checkpointing_kwargs": _a(None, "memory only, not numbers"),
    "remove_unused_columns": _a(False, "every column rides along to the reward functions"),
    "per_device_eval_batch_size": _a(8, "the held-out prompts are generated in the engine's batches"),
    "save_only_model": _h(False, "checkpoint-N without optimizer.pt, scheduler.pt, rng_state.pth (as TRL); Refit's "
                                 "own checkpoint keeps them (train(resume_from_checkpoint=True) still continues)"),
    "save_safetensors": _a(True, "always safetensors"),
    "skip_memory_metrics": _a(True, _NO_EFFECT),
    "ddp_find_unused_parameters": _a(None, "one process"),
    "hub_model_id": _a(None, "push_to_hub is refused"),
    "hub_strategy": _a("every_save", "push_to_hub is refused"),
    "hub_private_repo": _a(None, "push_to_hub is refused"),
    "push_to_hub": _r(False, "nothing leaves the machine: OUTPUT_DIR/final is a save_pretrained folder"),
    "fp16": _r(False, "fp16 mixed precision is CUDA's (a gradient scaler for fp16's range); Refit's learner runs fp32 "
                      "or bf16 (bf16, run.precision)"),
    "data_seed": _a(None, "TRL 1.16's GRPO, RLOO and Distillation trainers draw their prompts with RepeatSampler("
                          "seed=args.seed): data_seed changes nothing there either; the data order follows seed"),
    "optim": _h("adamw_torch_fused", "'adamw_torch_fused' / 'adamw_torch': torch's AdamW (optim.* settings); any "
                                     "other optimizer is refused"),
    "adam_beta1": _h(0.9, "optim.adam_beta1 (torch's AdamW betas[0])"),
    "adam_beta2": _h(0.999, "optim.adam_beta2 (torch's AdamW betas[1])"),
    "adam_epsilon": _h(1e-8, "optim.adam_epsilon (torch's AdamW eps)"),
    "label_smoothing_factor": _a(0.0, "transformers applies it in Trainer.compute_loss to a labels cross-entropy; "
                                      "TRL 1.16's GRPO, RLOO, GKD and Distillation trainers replace compute_loss with "
                                      "their own (policy gradient, JSD), so it changes nothing in TRL either"),
    "torch_compile": _r(False, "not built: the learner runs eager PyTorch (compiling is speed, not numbers: the log-prob "
                               "and loss are computed chunked by Refit's own code, refit/learner/losses/chunked.py)"),
    "use_liger_kernel": _r(False, "Liger's kernels are Triton (CUDA); Refit's fused log-prob / loss is its own chunked "
                                  "PyTorch code (refit/learner/losses/chunked.py)"),
    "deepspeed": _r(None, "one process here; `torchrun ... refit ppo` for DDP"),
    "fsdp": _r(None, "one process here; `torchrun ... refit ppo` for DDP"),
    "resume_from_checkpoint": _a(None, "as in transformers, the trainer does not read it: a script passes it to "
                                       "train(resume_from_checkpoint=True | 'OUTPUT_DIR/checkpoint-N')"),
}

_ONE = "one process: nothing to distribute"
_EVAL = "Refit's held-out evaluation runs in its engine, not transformers' evaluation loop"
_NO_LOADER = "there is no DataLoader"
MORE_TRAINING_ARGS: dict[str, TrlField] = {
    **{k: _a(d, _ONE) for k, d in (("accelerator_config", None), ("average_tokens_across_devices", True),
                                   ("ddp_backend", None), ("ddp_broadcast_buffers", None), ("ddp_bucket_cap_mb", None),
                                   ("ddp_static_graph", None), ("ddp_timeout", 1800), ("fsdp_config", None),
                                   ("local_rank", -1), ("log_on_each_node", True), ("parallelism_config", None),
                                   ("save_on_each_node", False))},
    **{k: _a(d, _EVAL) for k, d in (("batch_eval_metrics", False), ("bf16_full_eval", False), ("do_eval", False),
                                    ("eval_accumulation_steps", None), ("eval_delay", 0),
                                    ("eval_do_concat_batches", True), ("eval_use_gather_object", False),
                                    ("fp16_full_eval", False), ("include_for_metrics", []), ("label_names", None),
                                    ("prediction_loss_only", False))},
    "metric_for_best_model": _h(None, "the eval_ metric (eval_ prepended when missing) each evaluation during training "
                                      "compares: trainer_state.json's best_metric, best_model_checkpoint, a best view "
                                      "kept from rotation; load_best_model_at_end: 'loss' by default, which Refit does "
                                      "not log (refused)"),
    "greater_is_better": _h(None, "the comparison of metric_for_best_model (None: not metric.endswith('loss'))"),
    **{k: _a(d, _NO_LOADER) for k, d in (("dataloader_drop_last", False), ("dataloader_in_order", True),
                                         ("dataloader_multiprocessing_context", None),
                                         ("dataloader_prefetch_factor", None), ("length_column_name", "length"),
                                         ("train_sampling_strategy", "random"))},
    **{k: _a(d, "memory only, not numbers") for k, d in (("activation_checkpointing", None),
                                                        ("activation_checkpointing_kwargs", None),
                                                        ("torch_empty_cache_steps", None))},
    **{k: _a(d, "push_to_hub is refused; report_to decides what is written") for k, d in (
        ("hub_always_push", False), ("hub_revision", None), ("hub_token", None), ("project", "huggingface"),
        ("trackio_bucket_id", None), ("trackio_space_id", None), ("trackio_static_space_id", None))},
    **{k: _a(d, "torch_compile / use_liger_kernel are refused") for k, d in (
        ("torch_compile_backend", None), ("torch_compile_mode", None), ("liger_kernel_config", None))},
    "debug": _a("", _NO_EFFECT),
    "do_predict": _a(False, _NO_EFFECT),
    "enable_jit_checkpoint": _a(False, "Refit checkpoints every save_steps"),
    "full_determinism": _a(False, "Refit's runs are seeded (run.seed)"),
    "ignore_data_skip": _a(False, "a resumed run continues from its saved data position"),
    "include_num_input_tokens_seen": _a("no", _NO_EFFECT),
    "logging_nan_inf_filter": _a(True, "a non-finite step stops the run in one line, naming the last checkpoint"),
    "tf32": _a(None, "torch's TF32 setting is left as it is"),
    "use_cache": _a(False, "the learner's forward passes are whole sequences; the engine keeps its own KV cache"),
    "auto_find_batch_size": _r(False, "transformers halves the batch after a CUDA out-of-memory error; Refit sizes "
                                      "micro-batches to memory before the run (a batch that cannot fit is refused)"),
    "load_best_model_at_end": _h(False, "at the end of train() OUTPUT_DIR/final (the model train() returns and "
                                        "save_model writes) gets best_model_checkpoint's weights and final_engine is "
                                        "exported again from it; eval and save strategies must match (as "
                                        "transformers); refused with peft_config"),
    "neftune_noise_alpha": _h(None, "optim.neftune_noise_alpha: uniform noise of alpha / sqrt(L * d) on the input "
                                    "embeddings in the learner's training forwards (transformers' NEFTune hook); not "
                                    "in the engine's sampling, the probe or a separate reference"),
    "optim_args": _a(None, "transformers reads it only for other optimizers (AdEMAMix, AnyPrecisionAdamW, SGD, "
                           "GaLore, ...); for adamw_torch / adamw_torch_fused, the two optim Refit takes, it changes "
                           "nothing in transformers either"),
    "optim_target_modules": _a(None, "transformers reads it only for GaLore / APOLLO optimizers; for adamw_torch / "
                                     "adamw_torch_fused every trainable parameter is optimised, in transformers as "
                                     "in Refit"),
    "restore_callback_states_from_checkpoint": _h(False, "on resume, the ExportableState callbacks (and control) "
                                                         "rebuilt from trainer_state.json's stateful_callbacks"),
}

# names a script may pass that TRL 1.16 (transformers 5) no longer has; taken, and not counted as TRL's
_OLDER = {"no_cuda", "logging_dir", "overwrite_output_dir", "save_safetensors", "warmup_ratio", "refit"}

_GEN = "generation runs on Refit's engine: rollout.backend via refit={'rollout.backend': ...}"
# the sampler's logit processors: the engine samples with them and returns the processed log-probs; the learner
# scores at the temperature alone, as TRL (mismatch_correction tis weights by the processed distribution)
_MIN_P = "sampling.min_p (None: 0, off), the engine sampler's; the learner scores at temperature, as TRL"
_REP = ("sampling.repetition_penalty (prompt and completion tokens), the engine sampler's; the learner scores at "
        "temperature, as TRL")
_GEN_KW = ("over the sampling fields as TRL's GenerationConfig update: temperature, top_k, top_p, min_p, "
           "repetition_penalty, max_new_tokens, do_sample=True; any other key refused in one line")
_NO_VLLM = "use_vllm is refused: " + _GEN
_VLLM = ("vllm_mode", "colocate"), ("vllm_model_impl", "vllm"), ("vllm_enable_sleep_mode", False), (
    "vllm_structured_outputs_regex", None), ("vllm_server_base_url", None), ("vllm_server_host", "0.0.0.0"), (
    "vllm_server_port", 8000), ("vllm_server_timeout", 240.0), ("vllm_group_port", 51216), (
    "vllm_gpu_memory_utilization", 0.3), ("vllm_max_model_length", None), ("vllm_tensor_parallel_size", 1)
_ONLINE = {  # the generation options GRPO, RLOO and Distillation share
    **{k: _a(d, _NO_VLLM) for k, d in _VLLM},
    "cache_implementation": _a(None, _GEN),
    "pad_to_multiple_of": _a("auto", _NO_EFFECT),
    "chat_template_kwargs": _h(None, "data.chat_template_kwargs: apply_chat_template's keywords when chat prompts "
                                     "are rendered (enable_thinking=False, ...)"),
}
_TRANSFORMERS_GEN = {k: _a(d, _GEN) for k, d in (("use_transformers_continuous_batching", False),
                                                 ("transformers_continuous_batching_config", None),
                                                 ("use_transformers_paged", False))}

# GRPOConfig's own fields (TRL's GRPO trainer); RLOOConfig shares them with other defaults
GRPO_ARGS: dict[str, TrlField] = {
    **TRAINING_ARGS,
    "learning_rate": _h(1e-6, "optim.learning_rate"),
    "num_generations": _h(8, "num_generations (completions per prompt)"),
    "steps_per_generation": _h(None, "num_mini_batches = steps_per_generation / gradient_accumulation_steps"),
    "generation_batch_size": _h(None, "completions per generation (instead of steps_per_generation)"),
    "num_iterations": _h(1, "num_ppo_epochs with minibatch_order=replay (one shuffle of the generation, replayed "
                            "in that order each iteration, as TRL's buffer)"),
    "max_completion_length": _h(512, "response_length"),
    "beta": _h(0.0, "kl_coef with kl_penalty=loss, kl_estimator=k3 (a k3 term in each token's loss)"),
    "epsilon": _h(0.2, "cliprange"),
    "epsilon_high": _h(None, "cliprange_high: the upper clip 1 + epsilon_high (DAPO's clip-higher; cispo: the cap "
                             "on the ratio); RLOO: its sequence ratio's upper clip"),
    "loss_type": _h("dapo", "loss_type: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, each with TRL's "
                            "normaliser (refit/learner/losses/grpo.py)"),
    "scale_rewards": _h("group", "scale_rewards: True/'group', 'batch', False/'none'"),
    "reward_weights": _h(None, "reward_weights"),
    "temperature": _h(1.0, "sampling.temperature"),
    "top_p": _h(1.0, "sampling.top_p"),
    "top_k": _h(0, "sampling.top_k (None: 0, no top-k)"),
    "min_p": _h(None, _MIN_P),
    "repetition_penalty": _h(1.0, _REP),
    "generation_kwargs": _h(None, _GEN_KW + "; a temperature there is the sampler's and the learner's (TRL's learner "
                                            "keeps temperature)"),
    "refit": _h(None, "Refit's own: any PPOConfig field by dotted path ({'rollout.backend': 'torch'})"),
    "log_completions": _a(False, _LOGS),
    "num_completions_to_print": _a(None, _LOGS),
    "log_unique_prompts": _a(False, _LOGS),
    "ds3_gather_for_generation": _a(True, "no DeepSpeed"),
    "cast_lm_head_to_fp32": _a(False, "the learner runs fp32 on CPU"),
    "model_init_kwargs": _h(None, "dtype bfloat16 with peft_config: lora.base_dtype bf16 (the LoRA base held in bf16); "
                                  "other keys: the model folder is loaded as saved"),
    "shuffle_dataset": _a(True, "Refit draws prompts in a seeded order"),
    "disable_dropout": _a(False, "Refit's policy forward runs without dropout"),
    **MORE_TRAINING_ARGS, **_ONLINE, **_TRANSFORMERS_GEN,
    "trust_remote_code": _a(False, "local folders of transformers' own architectures"),
    "log_multimodal": _a(True, _LOGS),
    "ref_model_mixup_alpha": _h(0.6, "ref_model_mixup_alpha (with sync_ref_model)"),
    "ref_model_sync_steps": _h(512, "ref_model_sync_steps (with sync_ref_model; a multiple of the optimizer steps "
                                    "per generation)"),
    "router_aux_loss_coef": _h(None, "router_aux_loss_coef: a Mixture-of-Experts policy's load-balancing loss "
                                     "(its aux_loss) times this / the accumulation steps, added to the loss; None: "
                                     "its config's own coefficient (TRL's default), 0 for a dense model"),
    "max_tool_calling_iterations": _a(None, "only with the trainer's tools=[...], which Refit refuses (no tool "
                                            "calls)"),
    "use_vllm": _r(False, _GEN),
    "mask_truncated_completions": _h(False, "mask_truncated_completions: rows without a stop token out of the loss "
                                             "(still in their group's baseline)"),
    "importance_sampling_level": _h("token", "importance_sampling_level: 'token' or 'sequence' (GSPO: exp of the "
                                             "mean log ratio per completion)"),
    "top_entropy_quantile": _h(1.0, "top_entropy_quantile: the loss on each accumulation slice's top-entropy "
                                    "tokens (quantile over the slice, as TRL's micro-batch)"),
    "delta": _h(None, "delta: two-sided clipping (the unclipped ratio capped at delta)"),
    "sync_ref_model": _h(False, "sync_ref_model: every ref_model_sync_steps optimizer steps ref = alpha x policy + "
                                "(1 - alpha) x ref, an engine reference pushed the mix (refit.learner.ppo.refsync); "
                                "refused with peft_config or beta 0, as TRL"),
    "multi_objective_aggregation": _h("sum_then_normalize", "multi_objective_aggregation: 'sum_then_normalize' or "
                                                            "'normalize_then_sum' (GDPO: each function normalised in "
                                                            "its group, weighted sum, batch-normalised)"),
    "num_generations_eval": _h(None, "num_generations_eval: N sampled completions per held-out prompt (None: "
                                     "Refit's one greedy completion, where TRL samples num_generations)"),
    "vllm_importance_sampling_correction": _a(True, _NO_VLLM + " (without vLLM TRL corrects nothing); the "
                                                    "engine's mismatch is checked every push (probe_tol) and "
                                                    "corrected by Refit's mismatch_correction"),
    "max_prompt_length": _r(None, "not supported: prompts are kept whole (a prompt too long for the model is refused)"),
    "use_bias_correction_kl": _h(True, "kl_bias_correction: the k3 term times the importance ratio"),
    "entropy_coef": _h(0.0, "entropy_coef: minus coef x the mean entropy of each accumulation slice's (masked) "
                            "tokens, as TRL"),
    "use_adaptive_entropy": _h(False, "entropy_target (set from TRL's): the coefficient starts at entropy_coef, "
                                      "moves after every optimizer step and applies after a step at or below the "
                                      "target, as TRL's controller; its state is in each checkpoint"),
    **{k: _h(d, f"{k} (with use_adaptive_entropy)") for k, d in (
        ("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0), ("entropy_coef_delta", 0.005), ("entropy_target", 0.2))},
    **{k: _h(d, "sapo_temperatures (positive, negative) of loss_type sapo") for k, d in (
        ("sapo_temperature_neg", 1.05), ("sapo_temperature_pos", 1.0))},
    **{k: _h(d, "vespo_params (k_pos, lambda_pos, k_neg, lambda_neg) of loss_type vespo") for k, d in (
        ("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0))},
    **{k: _a(d, _NO_VLLM) for k, d in (("vllm_importance_sampling_mode", "sequence_mask"),
                                       ("vllm_importance_sampling_cap", None),
                                       ("vllm_importance_sampling_clip_min", None),
                                       ("vllm_importance_sampling_clip_max", 3.0))},
    "off_policy_mask_threshold": _h(None, "off_policy_mask_threshold: rows with a negative advantage and a mean "
                                          "old - current log-prob above it out of the loss (DeepSeek-V3.2)"),
    "log_completions_hub_repo": _r(None, "nothing leaves the machine: completions go to OUTPUT_DIR/completions.jsonl"),
}

# GRPOConfig's names that TRL 1.16's RLOOConfig does not have (refused there as unknown, as TRL does)
_GRPO_ONLY = {"cast_lm_head_to_fp32", "delta", "importance_sampling_level", "multi_objective_aggregation",
              "top_entropy_quantile", "vllm_importance_sampling_correction", "use_bias_correction_kl", "entropy_coef",
              "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
              "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
              "vespo_lambda_neg", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
              "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "off_policy_mask_threshold",
              "log_completions_hub_repo", "max_tool_calling_iterations"}

RLOO_ARGS: dict[str, TrlField] = {
    **{k: f for k, f in GRPO_ARGS.items() if k not in _GRPO_ONLY},
    "num_generations": _h(2, "num_generations (completions per prompt)"),
    "beta": _h(0.05, "kl_coef with kl_penalty=reward, kl_estimator=k1 (the summed k1 subtracted from the score)"),
    "max_completion_length": _h(512, "response_length"),
    "normalize_advantages": _h(False, "normalize_advantages: (A - mean) / (std + 1e-4) over the batch"),
    "reward_clip_range": _h(None, "reward_clip_range: each completion's summed reward clamped before the KL "
                                  "penalty"),
}

_DISTILL_COMMON: dict[str, TrlField] = {
    **TRAINING_ARGS,
    "per_device_train_batch_size": _h(8, "run.batch_size = per_device_train_batch_size x "
                                         "gradient_accumulation_steps prompts, one completion each"),
    "beta": _h(1.0, "beta of the generalised JSD (loss=jsd; 0: KL(teacher||student), 1: KL(student||teacher))"),
    "refit": _h(None, "Refit's own: any DistillConfig field by dotted path ({'eval_size': 8})"),
    "disable_dropout": _a(False, "Refit's student always trains without dropout (as True)"),
    "model_init_kwargs": _h(None, "dtype bfloat16 with peft_config: lora.base_dtype bf16 (the student's LoRA base "
                                  "held in bf16); other keys: the model folders are loaded as saved"),
    "teacher_model_init_kwargs": _a(None, "the teacher folder is loaded as saved"),
    **MORE_TRAINING_ARGS,
    "use_vllm": _r(False, _GEN),
}

DISTILLATION_ARGS: dict[str, TrlField] = {
    **_DISTILL_COMMON,
    "learning_rate": _h(1e-6, "optim.learning_rate"),
    "temperature": _h(1.0, "sampling.temperature and loss_temperature"),
    "max_completion_length": _h(512, "max_new_tokens"),
    "top_p": _h(1.0, "sampling.top_p"),
    "top_k": _h(0, "sampling.top_k"),
    "teacher_model_name_or_path": _h(None, "teacher.model_dir when teacher_model is not given"),
    "num_generations": _r(1, "not a DistillationConfig field in TRL 1.16 (TypeError there); its trainer generates "
                              "one completion per prompt (RepeatSampler mini_repeat_count=1), as Refit"),
    "generation_batch_size": _r(None, "not a DistillationConfig field in TRL 1.16 (TypeError there); its trainer "
                                      "generates per_device_train_batch_size x gradient_accumulation_steps "
                                      "completions a step, as Refit"),
    "trust_remote_code": _a(False, "local folders of transformers' own architectures"),
    "teacher_model_revision": _a(None, "local folders only"),
    "log_completions": _a(False, _LOGS),
    "log_completions_steps": _a(100, _LOGS),
    "num_completions_to_print": _a(None, _LOGS),
    **_ONLINE,
    "ds3_gather_for_generation": _a(True, "no DeepSpeed"),
    "log_unique_prompts": _a(False, _LOGS),
    "shuffle_dataset": _a(True, "Refit draws prompts in a seeded order"),
    "generation_kwargs": _h(None, _GEN_KW + "; a temperature there is the sampler's (loss_temperature keeps "
                                            "temperature, as TRL)"),
    "min_p": _h(None, _MIN_P),
    "repetition_penalty": _h(1.0, _REP),
    "max_tool_calling_iterations": _a(None, "only with the trainer's tools=[...], which Refit refuses (no tool "
                                            "calls)"),
}

GKD_ARGS: dict[str, TrlField] = {
    **_DISTILL_COMMON,
    "learning_rate": _h(2e-5, "optim.learning_rate"),
    "temperature": _h(0.9, "sampling.temperature; the loss at temperature 1, as TRL's GKD loss"),
    "lmbda": _h(0.5, "lmbda: the share of steps whose batch the student engine generates (drawn per step)"),
    "beta": _h(0.5, "beta of the generalised JSD (loss=jsd)"),
    "max_new_tokens": _h(128, "max_new_tokens"),
    "seq_kd": _h(False, "seq_kd: the steps the lmbda draw leaves to the teacher engine's generation; the generalised "
                        "JSD at beta takes the teacher's full distributions from that same pass (no second pass)"),
    "teacher_model_name_or_path": _h(None, "teacher.model_dir when teacher_model is not given"),
    "data_seed": _h(None, "data.data_seed: the prompt order's seed (transformers' seedable sampler, which GKD's "
                          "Trainer uses; None: seed)"),
    "max_length": _a(1024, "prompts are kept whole (a prompt too long for the model is refused)"),
    "dataset_text_field": _a("text", "GKD reads 'messages' (or 'prompt' and 'completion')"),
    "packing": _r(False, "TRL 1.16's GKDTrainer refuses it too: packing ('bfd') turns on padding_free, which takes "
                         "no custom collator, and GKD always passes its ChatML collator (ValueError); Refit's rows are "
                         "one prompt each"),
    "completion_only_loss": _a(None, "the loss is on completion tokens only"),
    "assistant_only_loss": _a(False, "TRL 1.16's GKDTrainer skips SFT's dataset preparation (skip_prepare_dataset) "
                                     "and its ChatML collator labels the last assistant turn only, with or without "
                                     "it; Refit's loss is on that turn too"),
    "dataset_kwargs": _a(None, _NO_EFFECT),
    "remove_unused_columns": _a(True, "GKD reads 'messages' (or 'prompt' and 'completion')"),
    "trust_remote_code": _a(False, "local folders of transformers' own architectures"),
    "activation_offloading": _a(False, "memory only, not numbers"),
    "dataset_num_proc": _a(None, _NO_EFFECT),
    "eval_packing": _a(None, "packing is refused"),
    "packing_strategy": _a("bfd", "packing is refused"),
    "padding_free": _a(False, "memory only, not numbers"),
    "truncation_mode": _a("keep_start", "prompts are kept whole (a prompt too long for the model is refused)"),
    "shuffle_dataset": _a(False, "Refit draws prompts in a seeded order"),
    "loss_type": _a("nll", "GKD's loss is the generalised JSD (beta), as in TRL"),
    "pad_to_multiple_of": _a("auto", _NO_EFFECT),
    "disable_dropout": _a(True, "Refit's student trains without dropout"),
    "router_aux_loss_coef": _a(None, "TRL 1.16's GKDTrainer replaces SFTTrainer's compute_loss with its JSD on "
                                     "the logits and never adds the load-balancing loss: no effect in TRL either"),
    "chat_template_path": _h(None, "the student's chat template, in the run's copy of it (OUTPUT_DIR/model): a .jinja "
                                   "/ .j2 file's text, or a tokenizer folder's template and EOS (TRL's "
                                   "clone_chat_template) when that keeps the vocabulary (adding tokens or resizing the "
                                   "embeddings is refused)"),
    "eos_token": _h(None, "the student's EOS (refused unless in its vocabulary, as TRL): the tokenizer's, the config's "
                          "eos_token_id, prepended to generation_config.eos_token_id (OUTPUT_DIR/model); generation "
                          "stops at it and at the ids already there"),
    "pad_token": _a(None, "TRL 1.16's GKDTrainer always passes its ChatML collator, so SFTTrainer's pad_token step "
                          "(for its own collator) never runs: TRL pads with processing_class.pad_token, as Refit, and "
                          "padded positions are masked"),
}

CONFIG_FIELDS = {"GRPOConfig": GRPO_ARGS, "RLOOConfig": RLOO_ARGS, "DistillationConfig": DISTILLATION_ARGS,
                 "GKDConfig": GKD_ARGS}
# per config, the names it takes that are not fields of TRL 1.16's config (older transformers / TRL names, Refit's
# own ``refit``, and two GRPO names RLOO's mapping reads at their GRPO defaults); the counts leave them out
NOT_IN_TRL_116 = {"GRPOConfig": _OLDER | {"max_prompt_length"},
                  "RLOOConfig": _OLDER | {"max_prompt_length", "loss_type", "scale_rewards"},
                  "DistillationConfig": _OLDER | {"num_generations", "generation_batch_size", "log_completions_steps"},
                  "GKDConfig": _OLDER | {"use_vllm"}}
