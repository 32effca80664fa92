"""GRPO with a model object (a PreTrainedModel, not a folder), its tokenizer from the model's name_or_path, a
TrainerCallback that times each step and records the events, use_cpu=True; trainer.state read at the end.

    python grpo_callback_model.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: the events, step seconds, global_step, log_history, and whether the
model object's weights changed.
"""

import json
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4)
                             for b in range(4)])


class Clock(TrainerCallback):
    def __init__(self):
        self.events, self.seconds, self.t0 = [], [], 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(["train_begin", state.global_step])

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.t0)
        self.events.append(["step_end", state.global_step])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(["log", state.global_step])

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(["train_end", state.global_step])


def brief(completions, **kwargs):
    return [-len(c[0]["content"]) / 10.0 for c in completions]


model = AutoModelForCausalLM.from_pretrained(model_dir)
before = {k: v.clone() for k, v in model.state_dict().items()}
clock = Clock()
args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=3, learning_rate=1e-3, beta=0.0, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, disable_tqdm=True, seed=0)
trainer = GRPOTrainer(model=model, reward_funcs=brief, args=args, train_dataset=dataset, callbacks=[clock])
trainer.train()
trained = trainer.model
changed = any(not torch.equal(before[k], v.detach().cpu()) for k, v in trained.state_dict().items() if k in before)
print(json.dumps({"events": clock.events, "seconds": clock.seconds, "global_step": trainer.state.global_step,
                  "max_steps": trainer.state.max_steps, "log_history": trainer.state.log_history,
                  "weights_changed": changed}))
