"""GRPO with the sampling settings a TRL user reaches for next: min_p, repetition_penalty, generation_kwargs (over
the sampling fields, as TRL's GenerationConfig update) and chat_template_kwargs (passed to apply_chat_template).

    python grpo_sampling.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history and the completion lengths of each call, so a
test can check that generation_kwargs' max_new_tokens (6) capped them below max_completion_length (16).
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4) for b in range(4)])
lengths = []


def short(completion_ids, **kwargs):
    lengths.append([len(c) for c in completion_ids])
    return [1.0 / (1.0 + len(c)) for c in completion_ids]


args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                  max_steps=2, learning_rate=1e-3, temperature=0.9, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                  generation_kwargs={"top_k": 50, "max_new_tokens": 6}, chat_template_kwargs={"enable_thinking": False},
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = GRPOTrainer(model=model_dir, reward_funcs=short, args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "lengths": lengths}))
