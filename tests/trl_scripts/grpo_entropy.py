"""GRPO with TRL's entropy settings as its docs write them: the entropy bonus under the adaptive controller
(use_adaptive_entropy with entropy_coef as the starting coefficient, entropy_target, entropy_coef_delta,
entropy_coef_max) and the high-entropy token mask (top_entropy_quantile), checkpointed every 2 steps and continued
by a second trainer with train(resume_from_checkpoint=True).

    python grpo_entropy.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: each train()'s global_step and log_history rows (step, loss,
policy_loss, entropy, entropy_coef), and the controller file of checkpoint-2.
"""

import json
import os
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
questions = [f"What is {a} times {b}?" for a in range(2, 6) for b in range(2, 6)]
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})


def digits(completions, **kwargs):
    """The share of digits in each completion's text."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


entropy_settings = dict(loss_type="dapo", entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0,
                        entropy_coef_delta=0.002, entropy_coef_max=0.05, top_entropy_quantile=0.5)


def config(max_steps):
    return GRPOConfig(output_dir=output_dir, max_steps=max_steps, save_strategy="steps", save_steps=2, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=1e-3,
                      report_to="none", use_cpu=True, disable_tqdm=True, seed=0, **entropy_settings)


runs = []
for max_steps, resume in ((2, None), (4, True)):
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=config(max_steps), train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume)
    rows = [{k: r[k] for k in ("step", "loss", "policy_loss", "entropy", "entropy_coef", "train_runtime", "train_loss") if k in r}
            for r in trainer.state.log_history]
    runs.append({"global_step": trainer.state.global_step, "log_history": rows})

with open(os.path.join(output_dir, "checkpoint-2", "entropy_ctrl_state.json")) as f:
    ctrl = json.load(f)
print(json.dumps({"runs": runs, "ctrl_at_2": ctrl}))
