"""On-policy distillation as a TRL user writes it (TRL 1.16's DistillationTrainer): the student generates, the
teacher scores, a generalised JSD with beta and temperature trains the student.

    python distillation.py STUDENT_DIR TEACHER_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step and log_history.
"""

import json
import sys

from datasets import Dataset
from trl import DistillationConfig, DistillationTrainer

student_dir, teacher_dir, output_dir = sys.argv[1], sys.argv[2], sys.argv[3]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(5)
                             for b in range(4)])
args = DistillationConfig(output_dir=output_dir, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
                          beta=0.5, temperature=1.0, max_completion_length=6, logging_steps=1, save_strategy="no",
                          report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
trainer = DistillationTrainer(model=student_dir, teacher_model=teacher_dir, args=args, train_dataset=dataset)
trainer.train()
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}))
