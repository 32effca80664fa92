"""Long-response GRPO on examples/trl_chat, written as a TRL script: 16 prompts x 8 generations, completions of up
to 128 tokens, two reward functions, a model object (its tokenizer from its folder, as TRL loads it), a
``TrainerCallback`` that times each step, ``use_cpu=True``, and ``trainer.state`` read at the end.

    refit build-model small-gpt2 --chat -o runs/small-gpt2-chat           # a local chat model (random weights)
    python examples/trl_chat/grpo_long.py runs/small-gpt2-chat runs/trl-chat-long 4      # on Refit
    .venv-trl/bin/python examples/trl_chat/grpo_long_trl.py runs/small-gpt2-chat runs/trl-chat-long-trl 4  # TRL

grpo_long_trl.py is this file with ``from trl import GRPOConfig, GRPOTrainer``: ``diff`` shows that one line
(tests/test_trl_scripts.py checks it). Arguments: the model folder, the output folder, optimizer steps (10).
The last stdout line is one JSON document: the step seconds and each logged step's reward, KL, loss, length.
"""

import json
import statistics
import sys
import time
from pathlib import Path

from datasets import load_dataset
from rewards import correct, digit_share
from transformers import AutoModelForCausalLM, TrainerCallback

from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
dataset = load_dataset("json", data_files=str(Path(__file__).with_name("data.jsonl")), split="train[:80%]")


class StepClock(TrainerCallback):
    """Seconds from on_step_begin to on_step_end, printed as each step ends."""

    def __init__(self):
        self.seconds, self.t0 = [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.t0)
        print(f"step {state.global_step}: {self.seconds[-1]:.2f} s", flush=True)


model = AutoModelForCausalLM.from_pretrained(model_dir)
clock = StepClock()
training_args = GRPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=128,  # 16 prompts x 8 generations, one optimizer step per generation
    num_generations=8,
    max_completion_length=128,
    max_steps=max_steps,
    learning_rate=1e-4,
    beta=0.02,
    reward_weights=[1.0, 0.5],
    temperature=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=[correct, digit_share], args=training_args, train_dataset=dataset,
                      callbacks=[clock])
trainer.train()

keys = ("reward", "rewards/correct/mean", "rewards/digit_share/mean", "kl", "loss", "completions/mean_length")
rows = [{k: round(r[k], 4) for k in ("step", *keys) if k in r} for r in trainer.state.log_history if "reward" in r]
for row in rows:
    print(row)
print(json.dumps({"global_step": trainer.state.global_step, "step_seconds": [round(s, 2) for s in clock.seconds],
                  "median_step_s": round(statistics.median(clock.seconds), 2), "rows": rows}))
