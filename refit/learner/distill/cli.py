"""``refit distill [--config FILE.yaml] [--section.field value ...] [--resume]``: knowledge distillation through engines.

With no model folders this is the embedded default, on CPU, with nothing downloaded:

1. Build a byte-level BPE tokenizer, a teacher (GPT-2 geometry, 4 layers x 128) trained locally by
   supervised fine-tuning on the task (``teacher_sft_steps``), and a random-weight student (2 x 64),
   under OUTPUT_DIR/models (reused when already built with the same settings).
2. Export both to engine folders (OUTPUT_DIR/models/{teacher,student}_engine) and distil with the
   config's mode (default: GKD, lmbda 0.5, top-k forward KL from the teacher engine).
3. Print the held-out KL to the teacher and the student's accuracy at the start and the end, and
   the run folder; the last stdout line is one JSON document.

``refit distill --build_models DIR [--field value ...]`` only builds the embedded teacher and
student and their engines into DIR, prints their paths as one JSON line and exits (used by
``scripts/distill_batch.sh`` so every config of a batch distils the same pair).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.parsing import with_values
from refit.learner.distill.config import DistillConfig, parse_distill
from refit.learner.distill.cycle import run_distill
from refit.learner.distill.evaluate import summary
from refit.learner.distill.pair import build_all, build_models
from refit.learner.run.config import flat_names


def report(s: dict) -> str:
    ratio = s["kl_end"] / s["kl_start"] if s.get("kl_start") else float("nan")
    return (f"refit distill: held-out KL to teacher {s['kl_start']:.4f} -> {s['kl_end']:.4f} ({ratio:.1%} of start) "
            f"over {s['steps']} steps; student accuracy {s['accuracy_start']:.3f} -> {s['accuracy_end']:.3f} "
            f"(teacher {s['teacher_accuracy']:.3f}); teacher passes per batch {s['teacher_passes_per_batch']:.2f}; "
            f"run folder {Path(s['run_dir']).resolve()}")


def main(argv: list[str] | None = None) -> int:
    return run(*parse_distill(argv))


def run(cfg: DistillConfig, opts) -> int:
    """``refit distill`` after :func:`~refit.learner.distill.config.parse_distill` checked its line (no torch)."""
    torch.manual_seed(cfg.run.seed)
    t0 = time.perf_counter()
    if opts.build_models:
        print(json.dumps(build_all(Path(opts.build_models), cfg)))
        return 0
    rank = int(os.environ.get("RANK", "0"))  # [dist] under torchrun only rank 0 prints
    if not cfg.teacher.model_dir and not cfg.student.model_dir:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RefitError("under torchrun pass --teacher.model_dir and --student.model_dir (build the embedded "
                             "pair once first: refit distill --build_models DIR)")
        models = Path(cfg.run.output_dir) / "models"  # the --build-models layout, so a batch can reuse it
        cfg = with_values(cfg, flat_names(DistillConfig), **build_models(models, cfg),
                          teacher_engine_dir=cfg.teacher.engine_dir or str(models / "teacher_engine"),
                          student_engine_dir=cfg.student.engine_dir or str(models / "student_engine"))
    run_dir = run_distill(cfg, resume=opts.resume, overwrite=opts.overwrite)
    if rank != 0:
        return 0
    s = summary(run_dir)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    s.update({"loss": cfg.loss, "lmbda": cfg.lmbda, "seq_kd": cfg.seq_kd, "beta": cfg.beta})
    if "kl_start" in s:
        print(report(s))
    print(json.dumps(s))
    return 0
