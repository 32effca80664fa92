"""GRPO on examples/trl_chat, written as a TRL script; it runs on Refit with only its import lines changed.

    python examples/trl_chat/grpo.py                  # 60 generations, ~4.5 min on 2 cores
    GRPO_MAX_STEPS=8 python examples/trl_chat/grpo.py # a short run (REFIT_TOUR_SHORT=1 makes it 4 steps)

The TRL original reads ``from trl import GRPOConfig, GRPOTrainer``; every other line is the same. The data
(data.jsonl: chat prompts with ``answer`` and ``difficulty`` columns) and the reward functions (rewards.py)
are the ones ``refit ppo --config examples/trl_chat/config.yaml`` uses. The model is Refit's embedded chat
model (a small GPT-2 with a chat template, warmed up on addition, built locally on first use into
runs/chat-model: nothing is downloaded); a TRL run would name a hub id or a local folder there.
Metrics go to runs/trl-chat-grpo/metrics.jsonl, the trained model to runs/trl-chat-grpo/final.
"""

import os
from pathlib import Path

from datasets import load_dataset
from rewards import carry_bonus, correct

from refit import GRPOConfig, GRPOTrainer  # TRL: from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files=str(Path(__file__).with_name("data.jsonl")), split="train[:80%]")

training_args = GRPOConfig(
    output_dir="runs/trl-chat-grpo",
    per_device_train_batch_size=64,  # completions: 8 prompts x 8 generations per micro-batch
    steps_per_generation=2,  # 128 completions (16 prompts) per generation, 2 optimizer steps over them
    num_iterations=2,
    num_generations=8,
    max_completion_length=6,
    # optimizer steps: 240 are 60 generations; shorter with GRPO_MAX_STEPS, or REFIT_TOUR_SHORT (the README's tour)
    max_steps=int(os.environ.get("GRPO_MAX_STEPS") or (4 if os.environ.get("REFIT_TOUR_SHORT", "0") != "0" else 240)),
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    beta=0.02,
    epsilon=0.2,
    scale_rewards=True,
    reward_weights=[1.0, 0.5],
    temperature=1.0,
    logging_steps=10,
    save_steps=40,
    seed=0,
)

trainer = GRPOTrainer(
    model="refit/demo-chat",
    reward_funcs=[correct, carry_bonus],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
