"""GRPO as a TRL user writes it: a model folder, two reward functions (one reads a dataset column), weights.

    python grpo.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history and every reward the functions returned, per
call (one call per generation), so a test can check the logged ``reward`` against them.
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
                             for a in range(4) for b in range(4)])
returned = {"correct": [], "short": []}


def correct(prompts, completions, answer, **kwargs):
    out = [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]
    returned["correct"].append(out)
    return out


def short(completions, **kwargs):
    out = [1.0 / (1.0 + len(c[0]["content"])) for c in completions]
    returned["short"].append(out)
    return out


args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=2, learning_rate=1e-3, beta=0.02, reward_weights=[1.0, 2.0], logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = GRPOTrainer(model=model_dir, reward_funcs=[correct, short], args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "returned": returned}))
