"""GRPO with the best model kept and a callback's state carried over a resume, as a TRL user writes them.

1. OUTPUT_DIR: eval_dataset evaluated every step, metric_for_best_model='reward', load_best_model_at_end,
   save_total_limit=1, 3 steps; the reward peaks at global step 2 (its trainer_state), so checkpoint-2 is the best;
   then save_model(OUTPUT_DIR/saved).
2. OUTPUT_DIR-states: an ExportableState callback over 2 steps; a second trainer with
   restore_callback_states_from_checkpoint=True continues to step 3 (its callback rebuilt from checkpoint-2's
   trainer_state.json); a third without it continues to step 4 (its callback as given).

    python grpo_best.py MODEL_DIR OUTPUT_DIR

The last stdout line is one JSON document: the evaluations by step, the best-model fields of the best checkpoint's
trainer_state.json, the checkpoint-N folders left, whether the saved and returned models hold the best checkpoint's
weights; the callback's stored state and what each resumed trainer's callback started from and ended at.
"""

import json
import os
import sys

from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from trl import GRPOConfig, GRPOTrainer

model_dir, output_dir = sys.argv[1], sys.argv[2]
prompts = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}]} for a in range(4) for b in range(2)]
dataset, held_out = Dataset.from_list(prompts), Dataset.from_list(prompts[:2])


def peak(completions, trainer_state, **kwargs):
    return [-float(trainer_state.global_step - 2) ** 2 - len(c[0]["content"]) / 1000 for c in completions]


class Counter(TrainerCallback, ExportableState):
    def __init__(self, every=1):
        self.every, self.seen, self.at_begin = every, 0, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = self.seen

    def on_step_end(self, args, state, control, **kwargs):
        self.seen += 1

    def state(self):
        return {"args": {"every": self.every}, "attributes": {"seen": self.seen}}


def config(out, max_steps, **kw):
    return GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      max_steps=max_steps, learning_rate=1e-2, logging_steps=1, save_steps=1, report_to="none",
                      use_cpu=True, disable_tqdm=True, seed=0, **kw)


def checkpoints(out):
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))


def same(weights, folder):
    got = load_file(os.path.join(folder, "model.safetensors"))
    return all(k in weights and bool((weights[k] == v).all()) for k, v in got.items())


trainer = GRPOTrainer(model=model_dir, reward_funcs=peak, train_dataset=dataset, eval_dataset=held_out,
                      args=config(output_dir, 3, eval_strategy="steps", eval_steps=1, metric_for_best_model="reward",
                                  load_best_model_at_end=True, save_total_limit=1))
trainer.train()
left = checkpoints(output_dir)
with open(os.path.join(output_dir, left[0], "trainer_state.json")) as f:
    saved = json.load(f)
trainer.save_model(os.path.join(output_dir, "saved"))
best_dir = os.path.join(output_dir, left[0])
model = {k: v.detach() for k, v in trainer.model.state_dict().items()}
best = {"evals": {r["step"]: r["eval_reward"] for r in trainer.state.log_history if "eval_reward" in r},
        "best_model_checkpoint": os.path.basename(saved["best_model_checkpoint"]),
        "best_global_step": saved["best_global_step"], "best_metric": saved["best_metric"], "checkpoints": left,
        "saved_is_best": same(load_file(os.path.join(output_dir, "saved", "model.safetensors")), best_dir),
        "model_is_best": same(model, best_dir)}

states_dir = output_dir + "-states"
runs = []
for max_steps, restore, resume in ((2, False, None), (3, True, True), (4, False, True)):
    given = Counter(3 if resume is None else 1)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=peak, train_dataset=dataset, callbacks=[given],
                          args=config(states_dir, max_steps, restore_callback_states_from_checkpoint=restore))
    trainer.train(resume_from_checkpoint=resume)
    cb = next(c for c in getattr(trainer, "callback_handler", trainer).callbacks if isinstance(c, Counter))
    runs.append({"given": cb is given, "every": cb.every, "at_begin": cb.at_begin, "seen": cb.seen})
with open(os.path.join(states_dir, "checkpoint-2", "trainer_state.json")) as f:
    stored = json.load(f)["stateful_callbacks"]["Counter"]
print(json.dumps({"best": best, "states": {"stored": stored, "runs": runs}}))
