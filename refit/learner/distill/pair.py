"""The embedded distillation pair, built locally with nothing downloaded: a teacher (GPT-2 geometry, 4 x 128)
trained by supervised fine-tuning on the task, and a random-weight student (2 x 64), sharing one tokenizer.

``refit distill`` with no model folders builds them under OUTPUT_DIR/models; ``refit distill
--build-models DIR`` builds them (and their engines) into DIR so a batch of runs distils one pair.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from refit.core.hf_folder import load_model
from refit.learner.distill.config import DistillConfig
from refit.learner.builtin.models import Geometry, build_model, build_tokenizer
from refit.learner.builtin.sft import sft
from refit.learner.builtin.tasks import TASKS
from refit.rollout.build import ensure_engine

TEACHER = Geometry("gpt2", n_layer=4, d_model=128, n_head=4, d_ff=512, max_positions=64)
STUDENT = Geometry("gpt2", n_layer=2, d_model=64, n_head=4, d_ff=256, max_positions=64)


def build_models(out: Path, cfg: DistillConfig, log=print) -> dict[str, str]:
    """The embedded teacher (SFT on the task) and student in ``out``; reused if built with the same settings."""
    key = {"teacher": dataclasses.asdict(TEACHER), "student": dataclasses.asdict(STUDENT), "task": cfg.data.task,
           "max_operand": cfg.data.max_operand, "teacher_sft_steps": cfg.teacher_sft_steps, "seed": cfg.run.seed}
    paths = {"teacher_model_dir": str(out / "teacher"), "student_model_dir": str(out / "student")}
    marker = out / "models.json"
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        log(f"refit distill: reusing the embedded teacher and student in {out}")
        return paths
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_tokenizer()
    model = load_model(build_model(TEACHER, out / "teacher_init", seed=cfg.run.seed, tokenizer=tok))
    kw = {"max_operand": cfg.data.max_operand} if cfg.data.task == "addition" else {}
    # the teacher is the given expert: it is trained on every prompt of the task, held-out ones included
    pairs = [(e.prompt, e.answer) for e in TASKS[cfg.data.task](4000, seed=cfg.run.seed + 1, **kw)]
    sft(model, tok, pairs, steps=cfg.teacher_sft_steps, batch_size=64, lr=2e-3, seed=cfg.run.seed, log=log)
    model.save_pretrained(paths["teacher_model_dir"])
    tok.save_pretrained(paths["teacher_model_dir"])
    shutil.rmtree(out / "teacher_init", ignore_errors=True)
    build_model(STUDENT, paths["student_model_dir"], seed=cfg.run.seed + 1, tokenizer=tok)
    marker.write_text(json.dumps({"key": key, "build_s": round(time.perf_counter() - t0, 1)}, indent=1))
    log(f"refit distill: built teacher ({TEACHER.n_layer}x{TEACHER.d_model}, {cfg.teacher_sft_steps} SFT steps) "
        f"and student ({STUDENT.n_layer}x{STUDENT.d_model}) in {time.perf_counter() - t0:.0f} s")
    return paths


def build_all(out: Path, cfg: DistillConfig, log=print) -> dict[str, str]:
    """:func:`build_models` plus both engines (``--build-models``)."""
    paths = build_models(out, cfg, log)
    rows = max(cfg.run.batch_size, cfg.eval_size, cfg.rollout.probe_size)
    for name in ("teacher", "student"):
        paths[f"{name}_engine_dir"] = str(ensure_engine(Path(paths[f"{name}_model_dir"]), out / f"{name}_engine",
                                                        rows, 64, log=log))
    return paths
