"""GRPO with checkpoints as a TRL user writes them: save_steps and save_total_limit, then a second trainer with a
larger max_steps that continues with train(resume_from_checkpoint=True), then save_model(dir) and from_pretrained
of the model and the tokenizer that folder holds.

    python grpo_checkpoints.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: each train()'s global_step, log_history (each row's step, loss,
learning_rate, train_runtime, train_loss) and the checkpoint-N folders left in OUTPUT_DIR after it, the files of
the newest checkpoint and its trainer_state.json's steps, and what from_pretrained loaded (its weights against the
newest checkpoint's).
"""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4)
                             for b in range(4)])


def brief(completions, **kwargs):
    return [-len(c[0]["content"]) / 10.0 for c in completions]


def config(max_steps):
    return GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=max_steps, learning_rate=1e-3, logging_steps=1,
                      save_strategy="steps", save_steps=2, save_total_limit=2, report_to="none", use_cpu=True,
                      disable_tqdm=True, seed=0)


def checkpoints():
    return sorted((n for n in os.listdir(output_dir) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))


runs = []
for max_steps, resume in ((4, None), (6, True)):
    trainer = GRPOTrainer(model=model_dir, reward_funcs=brief, args=config(max_steps), train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume)
    rows = [{k: r[k] for k in ("step", "loss", "learning_rate", "train_runtime", "train_loss") if k in r}
            for r in trainer.state.log_history]
    runs.append({"global_step": trainer.state.global_step, "log_history": rows, "checkpoints": checkpoints()})

newest = os.path.join(output_dir, checkpoints()[-1])
with open(os.path.join(newest, "trainer_state.json")) as f:
    saved_state = json.load(f)
final_dir = os.path.join(output_dir, "saved")
trainer.save_model(final_dir)
model = AutoModelForCausalLM.from_pretrained(final_dir)
tokenizer = AutoTokenizer.from_pretrained(final_dir)
at_newest = AutoModelForCausalLM.from_pretrained(newest).state_dict()
same = all(torch.equal(v, at_newest[k]) for k, v in model.state_dict().items())
print(json.dumps({"runs": runs, "newest_files": sorted(os.listdir(newest)),
                  "newest_state": {"global_step": saved_state["global_step"],
                                   "steps": [r["step"] for r in saved_state["log_history"]]},
                  "loaded": {"same_as_newest_checkpoint": same, "vocab": len(tokenizer),
                             "chat_template": tokenizer.chat_template is not None,
                             "params": sum(p.numel() for p in model.parameters())}}))
