"""GRPO with the optimizer, schedule and reference settings a TRL user reaches for next: AdamW's betas and epsilon,
a cosine schedule down to a floor (lr_scheduler_kwargs), the TR-DPO reference sync, NEFTune.

    python grpo_optim.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history (with the learning rate of every step).
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4)
                             for b in range(4)])


def varied(completions, **kwargs):
    return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]


args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=4, learning_rate=1e-3, lr_scheduler_type="cosine_with_min_lr",
                  lr_scheduler_kwargs={"min_lr": 1e-4}, warmup_steps=1, adam_beta1=0.8, adam_beta2=0.95,
                  adam_epsilon=1e-6, beta=0.1, sync_ref_model=True, ref_model_sync_steps=2,
                  ref_model_mixup_alpha=0.5, neftune_noise_alpha=5.0, logging_steps=1, save_strategy="no",
                  report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = GRPOTrainer(model=model_dir, reward_funcs=varied, args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}))
