"""Every TRL / ``transformers.TrainingArguments`` field the facade knows, sorted into three kinds: the one owner of
that sorting (the configs take their names and defaults from here, docs/trl-facade.md's table is generated from it).

- **honoured**: changes the run as it does in TRL; the note names the Refit setting it becomes;
- **accepted**: taken and changes nothing in a Refit run; the note says why;
- **refused**: only TRL's default is taken; any other value is one line saying what Refit does instead.

A name in none of the tables is refused as unknown. ``python -m refit.learner.trl.fields --write
docs/trl-facade.md`` rewrites the generated part of the page (tests/test_trl_compat.py checks it is current).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit.core.errors import RefitError

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
    "lr_scheduler_type": _h("linear", "optim.lr_scheduler_type (constant, linear, cosine)"),
    "warmup_steps": _h(0, "optim.warmup_steps"),
    "warmup_ratio": _h(0.0, "optim.warmup_steps = ratio x optimizer steps"),
    "weight_decay": _h(0.0, "optim.weight_decay"),
    "max_grad_norm": _h(1.0, "optim.max_grad_norm"),
    "bf16": _h(None, "run.bf16: autocast on CUDA; with use_cpu, True is refused (Refit's CPU learner runs fp32)"),
    "report_to": _h("none", "'none' / [] : no TensorBoard; 'tensorboard' / 'all': log.tensorboard; a remote "
                            "tracker (wandb, ...) is refused: nothing leaves the machine"),
    "disable_tqdm": _h(False, "log.progress = not disable_tqdm"),
    "logging_steps": _h(10, "state.log_history and on_log every N optimizer steps, each value the mean over "
                            "them (a float < 1: of max_steps); metrics.jsonl keeps every step"),
    "logging_strategy": _h("steps", "'steps' or 'no' (no log_history rows, no on_log)"),
    "logging_first_step": _h(False, "a log_history row and on_log after the first step"),
    "save_steps": _h(500, "ckpt.save_steps (a float < 1: of max_steps); should_save from a callback saves too"),
    "save_strategy": _h("steps", "'steps' (save_steps) or 'no' (one checkpoint, at the last step: --resume)"),
    "save_total_limit": _h(None, "ckpt.keep_checkpoints"),
    "eval_strategy": _h("no", "'steps': Refit's held-out evaluation of eval_dataset every eval_steps (PPO: "
                              "eval_steps, greedy, one completion a prompt; distillation: eval_every, KL to the "
                              "teacher); 'no': at the last step only, for evaluate()"),
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
    "gradient_checkpointing": _a(False, "memory only, not numbers"),
    "gradient_checkpointing_kwargs": _a(None, "memory only, not numbers"),
    "remove_unused_columns": _a(False, "every column rides along to the reward functions"),
    "per_device_eval_batch_size": _a(8, "the held-out prompts are generated in the engine's batches"),
    "save_only_model": _a(False, "Refit's checkpoints always hold the optimizer (--resume)"),
    "save_safetensors": _a(True, "always safetensors"),
    "skip_memory_metrics": _a(True, _NO_EFFECT),
    "ddp_find_unused_parameters": _a(None, "one process"),
    "hub_model_id": _a(None, "push_to_hub is refused"),
    "hub_strategy": _a("every_save", "push_to_hub is refused"),
    "hub_private_repo": _a(None, "push_to_hub is refused"),
    "push_to_hub": _r(False, "nothing leaves the machine: OUTPUT_DIR/final is a save_pretrained folder"),
    "fp16": _r(False, "fp32, or bf16 autocast on CUDA (bf16)"),
    "data_seed": _r(None, "the data order follows seed"),
    "optim": _r("adamw_torch", "torch's AdamW (optim.* settings)"),
    "adam_beta1": _r(0.9, "torch's AdamW betas (0.9, 0.999)"),
    "adam_beta2": _r(0.999, "torch's AdamW betas (0.9, 0.999)"),
    "adam_epsilon": _r(1e-8, "torch's AdamW eps 1e-8"),
    "lr_scheduler_kwargs": _r(None, "the schedules take no extra arguments"),
    "label_smoothing_factor": _r(0.0, "not supported"),
    "torch_compile": _r(False, "not supported"),
    "use_liger_kernel": _r(False, "not supported"),
    "deepspeed": _r(None, "one process here; `torchrun ... refit ppo` for DDP"),
    "fsdp": _r(None, "one process here; `torchrun ... refit ppo` for DDP"),
    "resume_from_checkpoint": _r(None, "call train(resume_from_checkpoint=True)"),
}

_GEN = "generation runs on Refit's engine: rollout.backend via refit={'rollout.backend': ...}"

# GRPOConfig's own fields (TRL's GRPO trainer); RLOOConfig shares them with other defaults
GRPO_ARGS: dict[str, TrlField] = {
    **TRAINING_ARGS,
    "learning_rate": _h(1e-6, "optim.learning_rate"),
    "num_generations": _h(8, "num_generations (completions per prompt)"),
    "steps_per_generation": _h(None, "num_mini_batches = steps_per_generation / gradient_accumulation_steps"),
    "generation_batch_size": _h(None, "completions per generation (instead of steps_per_generation)"),
    "num_iterations": _h(1, "num_ppo_epochs (Refit reshuffles each pass; TRL replays in order)"),
    "max_completion_length": _h(256, "response_length"),
    "beta": _h(0.0, "kl_coef with kl_penalty=loss, kl_estimator=k3 (a k3 term in each token's loss)"),
    "epsilon": _h(0.2, "cliprange"),
    "epsilon_high": _h(None, "only None or equal to epsilon (Refit clips symmetrically)"),
    "loss_type": _h("dapo", "'dapo' (and 'bnpo' with gradient_accumulation_steps 1): Refit's token "
                            "normalisation; others refused"),
    "scale_rewards": _h("group", "scale_rewards: True/'group', 'batch', False/'none'"),
    "reward_weights": _h(None, "reward_weights"),
    "temperature": _h(1.0, "sampling.temperature"),
    "top_p": _h(1.0, "sampling.top_p"),
    "top_k": _h(0, "sampling.top_k (None: 0, no top-k)"),
    "refit": _h(None, "Refit's own: any PPOConfig field by dotted path ({'rollout.backend': 'torch'})"),
    "log_completions": _a(False, _LOGS),
    "num_completions_to_print": _a(None, _LOGS),
    "log_unique_prompts": _a(False, _LOGS),
    "ds3_gather_for_generation": _a(True, "no DeepSpeed"),
    "cast_lm_head_to_fp32": _a(False, "the learner runs fp32 on CPU"),
    "model_init_kwargs": _a(None, "the model folder is loaded as saved"),
    "shuffle_dataset": _a(True, "Refit draws prompts in a seeded order"),
    "disable_dropout": _a(False, "Refit's policy forward runs without dropout"),
    "use_vllm": _r(False, _GEN),
    "mask_truncated_completions": _r(False, "not supported"),
    "importance_sampling_level": _r("token", "not supported: Refit's ratios are per token"),
    "top_entropy_quantile": _r(1.0, "not supported"),
    "delta": _r(None, "not supported (two-sided clipping)"),
    "min_p": _r(None, "not supported: top_k, top_p"),
    "repetition_penalty": _r(1.0, "not supported"),
    "generation_kwargs": _r(None, "not supported: temperature, top_k, top_p"),
    "sync_ref_model": _r(False, "not supported: the reference stays the step-0 policy"),
    "multi_objective_aggregation": _r("sum_then_normalize", "not supported: weighted sum, then the group baseline"),
    "num_generations_eval": _r(None, "not supported"),
    "vllm_importance_sampling_correction": _r(True, "the engine's mismatch is checked every push (probe_tol); "
                                                    "refit={'mismatch_correction': 'tis'} corrects it"),
    "max_prompt_length": _r(None, "not supported: prompts are kept whole (a prompt too long for the model is refused)"),
}

RLOO_ARGS: dict[str, TrlField] = {
    **GRPO_ARGS,
    "num_generations": _h(2, "num_generations (completions per prompt)"),
    "beta": _h(0.05, "kl_coef with kl_penalty=reward, kl_estimator=k1 (the summed k1 subtracted from the score)"),
    "max_completion_length": _h(512, "response_length"),
    "normalize_advantages": _r(False, "RLOO advantages are not whitened"),
    "reward_clip_range": _r(None, "not supported"),
}

_DISTILL_COMMON: dict[str, TrlField] = {
    **TRAINING_ARGS,
    "per_device_train_batch_size": _h(8, "run.batch_size = per_device_train_batch_size x "
                                         "gradient_accumulation_steps prompts, one completion each"),
    "beta": _h(1.0, "beta of the generalised JSD (loss=jsd; 0: KL(teacher||student), 1: KL(student||teacher))"),
    "refit": _h(None, "Refit's own: any DistillConfig field by dotted path ({'eval_size': 8})"),
    "disable_dropout": _r(True, "Refit's student trains without dropout"),
    "model_init_kwargs": _a(None, "the model folders are loaded as saved"),
    "teacher_model_init_kwargs": _a(None, "the teacher folder is loaded as saved"),
    "use_vllm": _r(False, _GEN),
}

DISTILLATION_ARGS: dict[str, TrlField] = {
    **_DISTILL_COMMON,
    "learning_rate": _h(1e-6, "optim.learning_rate"),
    "temperature": _h(1.0, "sampling.temperature and loss_temperature"),
    "max_completion_length": _h(512, "max_new_tokens"),
    "top_p": _h(0.95, "sampling.top_p"),
    "top_k": _h(0, "sampling.top_k"),
    "teacher_model_name_or_path": _h(None, "teacher.model_dir when teacher_model is not given"),
    "num_generations": _r(1, "one completion per prompt"),
    "generation_batch_size": _r(None, "one generation per optimizer step"),
    "trust_remote_code": _a(False, "local folders of transformers' own architectures"),
    "teacher_model_revision": _a(None, "local folders only"),
    "log_completions": _a(False, _LOGS),
    "log_completions_steps": _a(100, _LOGS),
    "num_completions_to_print": _a(None, _LOGS),
}

GKD_ARGS: dict[str, TrlField] = {
    **_DISTILL_COMMON,
    "learning_rate": _h(2e-5, "optim.learning_rate"),
    "temperature": _h(0.9, "sampling.temperature and loss_temperature"),
    "lmbda": _h(0.5, "lmbda: the share of steps whose batch the student engine generates (drawn per step)"),
    "beta": _h(0.5, "beta of the generalised JSD (loss=jsd)"),
    "max_new_tokens": _h(128, "max_new_tokens"),
    "seq_kd": _h(False, "seq_kd: off-policy batches generated by the teacher engine; needs beta=0 (forward KL on "
                        "the teacher's top-k from that same pass, loss=topk_kl)"),
    "teacher_model_name_or_path": _h(None, "teacher.model_dir when teacher_model is not given"),
    "max_length": _a(1024, "prompts are kept whole (a prompt too long for the model is refused)"),
    "dataset_text_field": _a("text", "GKD reads 'messages' (or 'prompt' and 'completion')"),
    "packing": _r(False, "no packing: one prompt per row"),
    "completion_only_loss": _a(None, "the loss is on completion tokens only"),
    "assistant_only_loss": _r(False, "the loss is on the completion (the last assistant turn)"),
    "dataset_kwargs": _a(None, _NO_EFFECT),
}

CONFIG_FIELDS = {"GRPOConfig": GRPO_ARGS, "RLOOConfig": RLOO_ARGS, "DistillationConfig": DISTILLATION_ARGS,
                 "GKDConfig": GKD_ARGS}


def check_values(owner: str, table: dict[str, TrlField], given: dict[str, Any], hints: dict[str, str]) -> None:
    """One line for the first unknown name or refused value in ``given`` (``hints``: Refit's nearest name)."""
    for k, v in given.items():
        f = table.get(k)
        if f is None:
            raise RefitError(f"{owner}: {k!r} is not supported" + (f" (Refit's nearest: {hints[k]})" if k in hints
                                                                   else "")
                             + f"; the names {owner} takes: docs/trl-facade.md")
        if f.kind == REFUSED and not _same(v, f.default):
            raise RefitError(f"{owner}: {k}={v!r}: {f.note}")


def _same(value, default) -> bool:
    empty = (None, "", [], {}, ())
    return value == default or (value in empty and default in empty)


def counts(table: dict[str, TrlField]) -> dict[str, int]:
    return {k: sum(f.kind == k for f in table.values()) for k in KINDS}


BEGIN, END = "<!-- generated: refit.learner.trl.fields (do not edit by hand) -->", "<!-- end generated -->"


def field_table() -> str:
    """The markdown of every config's fields by kind (docs/trl-facade.md holds it between BEGIN and END)."""
    out = ["| config | honoured | accepted | refused |", "|---|---|---|---|"]
    out += [f"| `{name}` | " + " | ".join(str(n) for n in counts(t).values()) + " |" for name, t in CONFIG_FIELDS.items()]
    for name, table in CONFIG_FIELDS.items():
        out += ["", f"### {name}", "", "| field | kind | TRL default | in Refit |", "|---|---|---|---|"]
        for kind in KINDS:
            for k, f in sorted((k, f) for k, f in table.items() if f.kind == kind):
                out.append(f"| `{k}` | {kind} | `{f.default!r}` | {f.note.replace('|', '/')} |")
    return "\n".join(out)


def write_doc(path: Path) -> None:
    """Replace the generated part of ``path`` (between BEGIN and END) with :func:`field_table`."""
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{field_table()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_doc(Path(sys.argv[2]))
    else:
        print(field_table())
