"""RLOO as a TRL user writes it: a model folder, one reward function, beta as RLOO's KL penalty.

    python rloo.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history and the rewards returned per call.
"""

import json
import sys

from datasets import Dataset
from trl import RLOOConfig, RLOOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4)
                             for b in range(4)])
returned = []


def length(completions, **kwargs):
    out = [len(c[0]["content"]) / 10.0 for c in completions]
    returned.append(out)
    return out


args = RLOOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=2, learning_rate=1e-3, beta=0.05, logging_steps=1, save_strategy="no",
                  report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = RLOOTrainer(model=model_dir, reward_funcs=length, args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "returned": returned}))
