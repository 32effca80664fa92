"""``refit distill [--config FILE.yaml] [--field value ...] [--resume]``: knowledge distillation through engines.

With no model folders this is the embedded default, on CPU, with nothing downloaded:

1. Build a byte-level BPE tokenizer, a teacher (GPT-2 geometry, 4 layers x 128) trained locally by
   supervised fine-tuning on the task (``teacher_sft_steps``), and a random-weight student (2 x 64),
   under OUTPUT_DIR/models (reused when already built with the same settings).
2. Export both to engine folders (OUTPUT_DIR/models/{teacher,student}_engine) and distil with the
   config's mode (default: GKD, lmbda 0.5, top-k forward KL from the teacher engine).
3. Print the held-out KL to the teacher and the student's accuracy at the start and the end, and
   the run folder; the last stdout line is one JSON document.

``refit distill --build-models DIR [--field value ...]`` only builds the embedded teacher and
student and their engines into DIR, prints their paths as one JSON line and exits (used by
``scripts/distill_batch.sh`` so every config of a batch distils the same pair).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch

from export.models import Geometry
from learner.config import DistillConfig, parse_config

TEACHER = Geometry("gpt2", n_layer=4, d_model=128, n_head=4, d_ff=512, max_positions=64)
STUDENT = Geometry("gpt2", n_layer=2, d_model=64, n_head=4, d_ff=256, max_positions=64)


def build_models(out: Path, cfg: DistillConfig, log=print) -> dict[str, str]:
    """The embedded teacher (SFT on the task) and student in ``out``; reused if built with the same settings."""
    from export.checkpoint import load_model
    from export.models import build_model, build_tokenizer
    from learner.sft import sft
    from learner.tasks import TASKS

    key = {"teacher": dataclasses.asdict(TEACHER), "student": dataclasses.asdict(STUDENT), "task": cfg.task,
           "max_operand": cfg.max_operand, "teacher_sft_steps": cfg.teacher_sft_steps, "seed": cfg.seed}
    paths = {"teacher_model_dir": str(out / "teacher"), "student_model_dir": str(out / "student")}
    marker = out / "models.json"
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        log(f"refit distill: reusing the embedded teacher and student in {out}")
        return paths
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_tokenizer()
    model = load_model(build_model(TEACHER, out / "teacher_init", seed=cfg.seed, tokenizer=tok))
    kw = {"max_operand": cfg.max_operand} if cfg.task == "addition" else {}
    # the teacher is the given expert: it is trained on every prompt of the task, held-out ones included
    pairs = [(e.prompt, e.answer) for e in TASKS[cfg.task](4000, seed=cfg.seed + 1, **kw)]
    sft(model, tok, pairs, steps=cfg.teacher_sft_steps, batch_size=64, lr=2e-3, seed=cfg.seed, log=log)
    model.save_pretrained(paths["teacher_model_dir"])
    tok.save_pretrained(paths["teacher_model_dir"])
    shutil.rmtree(out / "teacher_init", ignore_errors=True)
    build_model(STUDENT, paths["student_model_dir"], seed=cfg.seed + 1, tokenizer=tok)
    marker.write_text(json.dumps({"key": key, "build_s": round(time.perf_counter() - t0, 1)}, indent=1))
    log(f"refit distill: built teacher ({TEACHER.n_layer}x{TEACHER.d_model}, {cfg.teacher_sft_steps} SFT steps) "
        f"and student ({STUDENT.n_layer}x{STUDENT.d_model}) in {time.perf_counter() - t0:.0f} s")
    return paths


def build_all(out: Path, cfg: DistillConfig, log=print) -> dict[str, str]:
    """:func:`build_models` plus both engines (``--build-models``)."""
    from learner.cycle import ensure_engine

    paths = build_models(out, cfg, log)
    rows = max(cfg.batch_size, cfg.eval_size, cfg.probe_size)
    for name in ("teacher", "student"):
        paths[f"{name}_engine_dir"] = str(ensure_engine(Path(paths[f"{name}_model_dir"]), out / f"{name}_engine",
                                                        rows, 64, log))
    return paths


def report(s: dict) -> str:
    ratio = s["kl_end"] / s["kl_start"] if s.get("kl_start") else float("nan")
    return (f"refit distill: held-out KL to teacher {s['kl_start']:.4f} -> {s['kl_end']:.4f} ({ratio:.1%} of start) "
            f"over {s['steps']} steps; student accuracy {s['accuracy_start']:.3f} -> {s['accuracy_end']:.3f} "
            f"(teacher {s['teacher_accuracy']:.3f}); teacher passes per batch {s['teacher_passes_per_batch']:.2f}; "
            f"run folder {Path(s['run_dir']).resolve()}")


def main(argv: list[str] | None = None) -> int:
    from learner.distill import run_distill, summary

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--build-models", default=None)
    known, rest = pre.parse_known_args(argv)
    cfg, resume = parse_config(DistillConfig, rest, "refit distill")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    if known.build_models:
        print(json.dumps(build_all(Path(known.build_models), cfg)))
        return 0
    rank = int(os.environ.get("RANK", "0"))  # [dist] under torchrun only rank 0 prints
    if not cfg.teacher_model_dir and not cfg.student_model_dir:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from export.errors import RefitError

            raise RefitError("under torchrun pass --teacher_model_dir and --student_model_dir (build the embedded "
                             "pair once first: refit distill --build-models DIR)")
        models = Path(cfg.output_dir) / "models"  # the --build-models layout, so a batch can reuse it
        cfg = dataclasses.replace(cfg, **build_models(models, cfg),
                                  teacher_engine_dir=cfg.teacher_engine_dir or str(models / "teacher_engine"),
                                  student_engine_dir=cfg.student_engine_dir or str(models / "student_engine"))
    run_dir = run_distill(cfg, resume=resume)
    if rank != 0:
        return 0
    s = summary(run_dir)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    s.update({"loss": cfg.loss, "lmbda": cfg.lmbda, "seq_kd": cfg.seq_kd, "beta": cfg.beta})
    if "kl_start" in s:
        print(report(s))
    print(json.dumps(s))
    return 0
