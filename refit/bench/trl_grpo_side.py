"""The TRL side of ``refit bench grpo``: TRL's ``GRPOTrainer`` on a local model folder, timed per step.

Run by refit/bench/grpo.py in a virtual environment of its own (TRL 1.16, PEFT, the same torch build as Refit's),
never in Refit's: it imports trl, transformers, peft, datasets and torch only, and loads the reward from a file by
path (refit/bench/grpo_reward.py, the very function Refit's side gets).

    .venv-trl/bin/python refit/bench/trl_grpo_side.py --model_dir M --dataset D --reward_file F --out side.json ...

Every ``GRPOConfig`` field keeps TRL's default except the ones set in :func:`grpo_args` (the bench's aligned
settings, listed in refit/bench/grpo.py's docstring) and ``--trl_args`` (a JSON object of any further fields).

Timing, with no change to what TRL computes: a ``TrainerCallback`` times each optimizer step (``on_step_begin``
to ``on_step_end``); the trainer's own ``_generate`` (prompts -> completions, transformers ``generate()``) and
``_generate_and_score_completions`` (generation, rewards, advantages and the log-probs the loss needs) are wrapped
on the instance to add up their seconds within the step; ``on_log`` (``logging_steps=1``) gives each step's mean
reward and completion length. The result is one JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from datasets import load_dataset
from transformers import TrainerCallback


def load_reward(path: str, name: str):
    """The reward function ``name`` of the Python file at ``path`` (imported by path, not by package)."""
    spec = importlib.util.spec_from_file_location("bench_grpo_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


class StepClock(TrainerCallback):
    """Seconds per optimizer step and, within it, the seconds of the wrapped trainer methods."""

    def __init__(self):
        self.rows: list[dict] = []
        self.logs: dict[int, dict] = {}
        self.inner: dict[str, float] = defaultdict(float)
        self._t0 = 0.0

    def timed(self, fn, key: str):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inner[key] += time.perf_counter() - t
        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        self.inner.clear()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append({"step": state.global_step, "step_s": time.perf_counter() - self._t0, **self.inner})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs[state.global_step] = logs


def grpo_args(a: argparse.Namespace):
    """TRL's ``GRPOConfig`` with the aligned settings; every other field is TRL's default."""
    from trl import GRPOConfig

    fields = dict(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.prompts_per_step * a.num_generations,  # one optimizer step per generation
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        temperature=a.temperature,
        learning_rate=a.learning_rate,
        lr_scheduler_type=a.lr_scheduler,
        max_steps=a.steps,
        beta=a.beta,
        seed=a.seed,
        bf16=False,  # TRL's default is bf16 autocast; the bench compares fp32 learners (or a bf16-held base)
        disable_dropout=True,  # Refit's learner and engine run without dropout (the log-probs they compare are
        # dropout-free); TRL's default (False) trains and generates with the model's dropout on, another algorithm
        # and more work where the config has dropout (small-gpt2: 0.1; Qwen2.5: 0)
        use_cpu=a.device == "cpu",
        logging_steps=1,  # logging only: a reward per step
        save_strategy="no",  # neither side writes checkpoints during the bench
        report_to="none",
    )
    if a.lora_base_dtype == "bf16":  # the model (the frozen base under PEFT) loaded in bf16; the adapter stays fp32
        fields["model_init_kwargs"] = {"dtype": "bfloat16"}
    fields.update(json.loads(a.trl_args or "{}"))
    return GRPOConfig(**fields)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", required=True)
    p.add_argument("--dataset", required=True, help="a .jsonl file with a prompt column (chat messages or text)")
    p.add_argument("--reward_file", required=True)
    p.add_argument("--reward_name", default="reward")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--out", required=True, help="the JSON file this run writes")
    p.add_argument("--prompts_per_step", type=int, required=True)
    p.add_argument("--num_generations", type=int, required=True)
    p.add_argument("--max_completion_length", type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--lr_scheduler", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--beta", type=float, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lora_r", type=int, default=0)
    p.add_argument("--lora_alpha", type=float, default=16.0)
    p.add_argument("--lora_target", default="all-linear")
    p.add_argument("--lora_base_dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--trl_args", default="", help="JSON object of further GRPOConfig fields")
    a = p.parse_args()

    import peft
    import trl
    from trl import GRPOTrainer

    torch.set_num_threads(a.threads)
    dataset = load_dataset("json", data_files=a.dataset, split="train")
    peft_config = None
    if a.lora_r > 0:
        target = a.lora_target if a.lora_target == "all-linear" else a.lora_target.split(",")
        peft_config = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, target_modules=target,
                                      task_type="CAUSAL_LM")
    args = grpo_args(a)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=a.model_dir, reward_funcs=load_reward(a.reward_file, a.reward_name), args=args,
                          train_dataset=dataset, peft_config=peft_config)
    setup_s = time.perf_counter() - t0
    clock = StepClock()
    trainer.add_callback(clock)
    trainer._generate = clock.timed(trainer._generate, "generate_s")
    trainer._generate_and_score_completions = clock.timed(trainer._generate_and_score_completions,
                                                          "generate_and_score_s")
    trainer.train()
    rows = [{**r, "reward": clock.logs.get(r["step"], {}).get("reward"),
             "completion_length": clock.logs.get(r["step"], {}).get("completions/mean_length")} for r in clock.rows]
    kept = ("gradient_checkpointing", "disable_dropout", "num_iterations", "steps_per_generation", "loss_type",
            "scale_rewards", "epsilon", "max_grad_norm", "weight_decay", "top_k", "top_p", "beta", "bf16",
            "lr_scheduler_type", "per_device_train_batch_size", "generation_batch_size")
    Path(a.out).write_text(json.dumps({
        "rows": rows, "setup_s": setup_s, "threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "ref_model": trainer.ref_model is not None,
        "eos_token_ids": list(trainer.eos_token_ids),
        "config": {k: getattr(args, k, None) for k in kept},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "torch": torch.__version__}}))


if __name__ == "__main__":
    main()
