"""One side of scripts/distill_vs_trl.py: on-policy distillation written as a TRL script (TRL 1.16's
``DistillationTrainer``), run unchanged under TRL in its own environment, and under Refit with its import line
changed to ``from refit import`` (the driver writes that copy). It imports trl (or refit), datasets and the
standard library only.

    .venv-trl/bin/python scripts/distill_side.py --student S --teacher T --train train.jsonl --eval eval.jsonl \
        --out OUT --steps 40

The last stdout line is one JSON document: ``trainer.state.log_history`` (the training loss per step, and the
held-out evaluation every ``--eval_steps``: TRL's ``eval_loss``, Refit's ``eval_kl_to_teacher``) and the wall time.
"""

import argparse
import json
import time

from datasets import load_dataset
from trl import DistillationConfig, DistillationTrainer

p = argparse.ArgumentParser()
for name in ("student", "teacher", "train", "eval", "out"):
    p.add_argument(f"--{name}", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--beta", type=float, default=0.5)
p.add_argument("--max_new_tokens", type=int, default=6)
p.add_argument("--eval_steps", type=int, default=10)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

train = load_dataset("json", data_files=a.train, split="train")
held = load_dataset("json", data_files=a.eval, split="train")
args = DistillationConfig(output_dir=a.out, per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr,
                          lr_scheduler_type="constant", beta=a.beta, temperature=1.0, top_p=1.0,
                          max_completion_length=a.max_new_tokens, logging_steps=1, eval_strategy="steps",
                          eval_steps=a.eval_steps, eval_on_start=True, per_device_eval_batch_size=len(held),
                          save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=a.seed)
t0 = time.perf_counter()
trainer = DistillationTrainer(model=a.student, teacher_model=a.teacher, args=args, train_dataset=train,
                              eval_dataset=held)
trainer.train()
print(json.dumps({"log_history": trainer.state.log_history, "wall_s": round(time.perf_counter() - t0, 1)}))
