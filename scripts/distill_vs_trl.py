"""Distillation loss curves, TRL 1.16 against Refit, on one student, teacher and data set; and the held-out KL to
the teacher under the facade's ``DistillationTrainer``, its ``GKDTrainer`` and ``refit distill``'s own job.

    python scripts/distill_vs_trl.py                                  # WORK runs/distill-vs-trl, 40 steps
    python scripts/distill_vs_trl.py --steps 20 --trl_python .venv-trl/bin/python

The runs (each in a fresh folder under WORK):

1. ``refit distill``'s embedded pair (a 4x128 GPT-2 teacher trained on addition with operands 0-9, a random 2x64
   GPT-2 student, one tokenizer), built once in WORK/models; the task's prompts with their answers, ``--train``
   for training and ``--held`` held out (WORK/train.jsonl, WORK/eval.jsonl; no held-out prompt is in train).
2. ``trl``: scripts/distill_side.py under TRL (``DistillationTrainer``: the student generates with transformers'
   ``generate()``, the generalised JSD with ``beta`` on its completions).
3. ``refit``: the same script with its import line changed to ``from refit import`` (the facade's
   ``DistillationTrainer`` on Refit's distillation job: generation on the exported student engine).
4. ``refit_gkd``: the facade's ``GKDTrainer``, ``lmbda`` 0.5 (half the steps train on the data set's answers).
5. ``refit_distill``: ``refit.learner.api.run_distill`` with a ``DistillConfig`` (``refit distill``'s job), loss
   ``jsd``, on-policy (``lmbda`` 1).

Every side: batch 8 prompts, constant learning rate 2e-3, beta 0.5, temperature 1, top_p 1, 6 new tokens, seed 0.
The curves: the training loss per step (the generalised JSD, token mean) side by side; every ``--eval_steps``
steps the held-out figure: TRL's ``eval_loss`` (that JSD on the student's completions for the held-out prompts)
and Refit's ``eval_kl_to_teacher`` (forward KL(teacher || student), full vocabulary, on the teacher's sampled
completions for the held-out prompts: one fixed set for the whole run). They are different measures; each should
fall. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "scripts" / "distill_side.py"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="runs/distill-vs-trl", help="work folder (models, data, one folder a run)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of every run")
    p.add_argument("--eval_steps", type=int, default=10, help="held-out evaluation every N steps")
    p.add_argument("--train", type=int, default=84, help="training prompts")
    p.add_argument("--held", type=int, default=16, help="held-out prompts")
    p.add_argument("--trl_python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                   help="TRL 1.16's environment (refit bench grpo --vs trl makes it); missing: the TRL run is skipped")
    p.add_argument("--sides", default="trl,refit,refit_gkd,refit_distill", help="which runs, comma-separated")
    return p.parse_args()


def write_data(work: Path, n_train: int, n_held: int, max_operand: int) -> tuple[Path, Path]:
    """Distinct addition prompts of the pair's task (operands 0..max_operand, the teacher's) with their answers,
    split once."""
    rng = random.Random(0)
    pairs = sorted({(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)})
    if n_train + n_held > len(pairs):
        raise SystemExit(f"--train {n_train} + --held {n_held} > the task's {len(pairs)} distinct prompts")
    rng.shuffle(pairs)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs[:n_train + n_held]]
    paths = work / "train.jsonl", work / "eval.jsonl"
    for path, part in zip(paths, (rows[:n_train], rows[n_train:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def build_pair(work: Path) -> tuple[str, str]:
    from refit.learner.distill.config import DistillConfig
    from refit.learner.distill.pair import build_models

    paths = build_models(work / "models", DistillConfig())
    return paths["student_model_dir"], paths["teacher_model_dir"]


def run_side(python: str, script: Path, common: list[str], out: Path, log: Path) -> dict:
    """One run of the side script in its own process; its last stdout line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        done = subprocess.run([python, str(script), *common, "--out", str(out)], stdout=subprocess.PIPE, stderr=f,
                              text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{script.name} under {python} failed (exit {done.returncode}); see {log}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def refit_copy(work: Path) -> Path:
    """scripts/distill_side.py with its one TRL import line pointed at Refit."""
    src = SIDE.read_text()
    moved, n = re.subn(r"^from trl import ", "from refit import ", src, flags=re.M)
    assert n == 1
    path = work / "distill_side_refit.py"
    path.write_text(moved)
    return path


def facade_gkd(student: str, teacher: str, train: Path, held: Path, out: Path, a) -> dict:
    from datasets import load_dataset

    from refit import GKDConfig, GKDTrainer

    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=8, max_steps=a.steps, learning_rate=2e-3,
                     lr_scheduler_type="constant", lmbda=0.5, beta=0.5, temperature=1.0, max_new_tokens=6,
                     logging_steps=1, eval_strategy="steps", eval_steps=a.eval_steps, save_strategy="no",
                     report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args,
                         train_dataset=load_dataset("json", data_files=str(train), split="train"),
                         eval_dataset=load_dataset("json", data_files=str(held), split="train"))
    t0 = time.perf_counter()
    trainer.train()
    return {"log_history": trainer.state.log_history, "wall_s": round(time.perf_counter() - t0, 1)}


def refit_distill(student: str, teacher: str, train: Path, held: Path, out: Path, a) -> dict:
    """``refit distill``'s job from a DistillConfig; its metrics.jsonl as log rows (loss; eval_kl_to_teacher)."""
    import datasets

    from refit.learner.api import run_distill
    from refit.learner.distill.config import DistillConfig

    data = out.parent / "refit_distill_data"
    datasets.DatasetDict({"train": datasets.load_dataset("json", data_files=str(train), split="train"),
                          "eval": datasets.load_dataset("json", data_files=str(held), split="train")}
                         ).save_to_disk(str(data))
    cfg = DistillConfig.from_flat(
        teacher_model_dir=teacher, student_model_dir=student, output_dir=str(out), dataset=str(data),
        eval_split="eval", eval_size=a.held, eval_every=a.eval_steps, steps=a.steps, batch_size=8, loss="jsd",
        lmbda=1.0, beta=0.5, temperature=1.0, loss_temperature=1.0, top_p=1.0, max_new_tokens=6,
        learning_rate=2e-3, lr_scheduler_type="constant", warmup_steps=0, seed=0, device="cpu", progress=False,
        plots=False, export_final=False)
    t0 = time.perf_counter()
    res = run_distill(cfg, log=lambda *_: None)
    rows = [{"step": m["step"], **({"loss": m["loss"]} if "loss" in m else {}),
             **({"eval_kl_to_teacher": m["eval/kl_to_teacher"], "eval_accuracy": m["eval/accuracy"]}
                if "eval/kl_to_teacher" in m else {})}
            for m in res.metrics]
    return {"log_history": rows, "wall_s": round(time.perf_counter() - t0, 1)}


def curves(run: dict) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> training loss, step -> held-out figure) of a run's log rows."""
    loss, held = {}, {}
    for r in run["log_history"]:
        if "loss" in r and "train_runtime" not in r:
            loss[r["step"]] = r["loss"]
        for k in ("eval_loss", "eval_kl_to_teacher"):
            if k in r:
                held[r["step"]] = r[k]
    return loss, held


def accuracy(run: dict) -> dict[int, float]:
    """step -> greedy exact-match accuracy on the held-out prompts (Refit's eval_accuracy; TRL logs none)."""
    return {r["step"]: r["eval_accuracy"] for r in run["log_history"] if "eval_accuracy" in r}


def fmt(v) -> str:
    return f"{v:10.4f}" if isinstance(v, float) else f"{'-':>10}"


def main() -> None:
    a = parse()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    from refit.learner.distill.config import DistillConfig

    train, held = write_data(work, a.train, a.held, DistillConfig().data.max_operand)
    student, teacher = build_pair(work)
    common = ["--student", student, "--teacher", teacher, "--train", str(train), "--eval", str(held),
              "--steps", str(a.steps), "--eval_steps", str(a.eval_steps)]
    sides = a.sides.split(",")
    runs: dict[str, dict] = {}
    stamp = time.strftime("%H%M%S")
    for side in sides:
        out = work / f"{side}-{stamp}"
        t0 = time.perf_counter()
        if side == "trl":
            if not Path(a.trl_python).is_file():
                print(f"trl: skipped, no TRL environment at {a.trl_python}", file=sys.stderr)
                continue
            runs[side] = run_side(a.trl_python, SIDE, common, out, work / f"{side}-{stamp}.log")
        elif side == "refit":
            runs[side] = run_side(sys.executable, refit_copy(work), common, out, work / f"{side}-{stamp}.log")
        elif side == "refit_gkd":
            runs[side] = facade_gkd(student, teacher, train, held, out, a)
        elif side == "refit_distill":
            runs[side] = refit_distill(student, teacher, train, held, out, a)
        else:
            raise SystemExit(f"unknown side {side!r}")
        if side in ("refit", "refit_gkd"):  # Refit's step-0 evaluation: in metrics.jsonl, not in log_history
            first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
            if first["step"] == 0 and "eval/kl_to_teacher" in first:
                runs[side]["log_history"].insert(0, {"step": 0, "eval_kl_to_teacher": first["eval/kl_to_teacher"],
                                                     "eval_accuracy": first["eval/accuracy"]})
        print(f"{side}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    got = {s: curves(r) for s, r in runs.items()}
    names = list(got)
    print("training loss (generalised JSD, beta 0.5) by step")
    print(f"{'step':>5}" + "".join(f"{n:>15}" for n in names))
    for step in range(1, a.steps + 1):
        print(f"{step:>5}" + "".join(f"{fmt(got[n][0].get(step)):>15}" for n in names))
    print("held-out: trl eval_loss (JSD on the student's completions); refit eval_kl_to_teacher (KL(teacher||student))")
    steps = sorted({s for n in names for s in got[n][1]})
    print(f"{'step':>5}" + "".join(f"{n:>15}" for n in names))
    for step in steps:
        print(f"{step:>5}" + "".join(f"{fmt(got[n][1].get(step)):>15}" for n in names))
    summary = {}
    for n in names:
        loss, held_out = got[n]
        ks = sorted(loss)
        k = max(1, len(ks) // 4)
        hs = sorted(held_out)
        summary[n] = {"loss_first_quarter": sum(loss[s] for s in ks[:k]) / k,
                      "loss_last_quarter": sum(loss[s] for s in ks[-k:]) / k,
                      "held_out_first": held_out[hs[0]] if hs else None,
                      "held_out_last": held_out[hs[-1]] if hs else None,
                      "held_out_steps": hs, "held_out_accuracy": accuracy(runs[n]), "wall_s": runs[n]["wall_s"]}
    print(json.dumps({"steps": a.steps, "train_prompts": a.train, "held_out_prompts": a.held, "runs": summary,
                      "curves": {n: {"loss": got[n][0], "held_out": got[n][1]} for n in names}}))


if __name__ == "__main__":
    main()
