"""GKD as a TRL user writes it (trl.experimental.gkd): conversational rows, lmbda the on-policy share.

    python gkd.py STUDENT_DIR TEACHER_DIR OUTPUT_DIR [seq_kd]

With ``seq_kd``: sequence-level KD (GKDTrainer with seq_kd=True): each step the student generates (on-policy) with
probability lmbda, else the teacher generates; the generalised JSD at beta is taken on those sequences with the
teacher's full distributions.

The last stdout line is one JSON document: global_step and log_history.
"""

import json
import sys

from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.gkd import GKDConfig, GKDTrainer

student_dir, teacher_dir, output_dir = sys.argv[1], sys.argv[2], sys.argv[3]
seq_kd = sys.argv[4:] == ["seq_kd"]
tokenizer = AutoTokenizer.from_pretrained(student_dir)  # TRL's GKDTrainer needs it given
dataset = Dataset.from_list([{"messages": [{"role": "user", "content": f"{a}+{b}="},
                                           {"role": "assistant", "content": str(a + b)}]}
                             for a in range(5) for b in range(4)])
args = GKDConfig(output_dir=output_dir, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, lmbda=0.5,
                 seq_kd=seq_kd, beta=0.5, temperature=0.9, max_new_tokens=6, logging_steps=1, save_strategy="no",
                 report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = GKDTrainer(model=student_dir, teacher_model=teacher_dir, args=args, train_dataset=dataset,
                     processing_class=tokenizer)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}))
