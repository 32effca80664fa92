"""GRPO with peft_config=LoraConfig(...): only the adapter trains.

    python grpo_peft.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step and log_history.
"""

import json
import sys

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4)
                             for b in range(4)])


def brief(completions, **kwargs):
    return [-len(c[0]["content"]) / 10.0 for c in completions]


args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=2, learning_rate=1e-3, beta=0.02, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, disable_tqdm=True, seed=0)
lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], task_type="CAUSAL_LM")
trainer = GRPOTrainer(model=model_dir, reward_funcs=brief, args=args, train_dataset=dataset, peft_config=lora)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}))
