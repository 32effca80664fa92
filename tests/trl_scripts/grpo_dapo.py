"""GRPO with the DAPO / Dr. GRPO settings as TRL's docs write them: loss_type="dr_grpo", scale_rewards="none",
clip-higher (epsilon_high), each generation replayed num_iterations=2 times over steps_per_generation=2 optimizer
steps, top_p sampling, and truncated completions masked out of the loss.

    python grpo_dapo.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history and every reward the function returned, per
call (one call per generation).
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4) for b in range(4)])
returned = []


def short(completions, **kwargs):
    out = [1.0 / (1.0 + len(c[0]["content"])) for c in completions]
    returned.append(out)
    return out


args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                  loss_type="dr_grpo", scale_rewards="none", epsilon=0.2, epsilon_high=0.28, num_iterations=2,
                  steps_per_generation=2, top_p=0.9, mask_truncated_completions=True, max_steps=4, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = GRPOTrainer(model=model_dir, reward_funcs=short, args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "returned": returned}))
