"""Atomic checkpoints: write into a temporary folder, then rename; keep the last K.

A checkpoint folder ``checkpoints/step_000010/`` holds ``policy/`` (an HF checkpoint folder with
its tokenizer: loadable and exportable as is), ``trainer.pt`` (value head, optimizer, scheduler,
RNG states) and ``state.json`` (step, KL coefficient, data position, engine weight version).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, value_head, optimizer, scheduler,
                    state: dict, keep: int = 2) -> Path:
    ck_root = Path(run_dir) / "checkpoints"
    ck_root.mkdir(parents=True, exist_ok=True)
    final = ck_root / f"step_{step:06d}"
    tmp = ck_root / f".step_{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp / "policy"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "policy"))
        extra = {"value_head": value_head.state_dict() if value_head is not None else None,
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state()}
        torch.save(extra, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if keep > 0:  # 0 keeps every checkpoint (refit.core.validate: keep_checkpoints >= 0)
        for old in sorted(p for p in ck_root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    cks = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return cks[-1] if cks else None


def resume_latest(run_dir: Path, model, value_head, optimizer, scheduler) -> tuple[Path, dict]:
    """``--resume``: :func:`load_checkpoint` of the newest checkpoint in ``run_dir``; (its path, state.json)."""
    ck = latest_checkpoint(run_dir)
    if ck is None:
        from refit.core.errors import RefitError

        raise RefitError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}")
    return ck, load_checkpoint(ck, model, value_head, optimizer, scheduler)


def load_checkpoint(path: Path, model, value_head, optimizer, scheduler) -> dict:
    """Load weights and trainer state in place; return state.json (RNG restored too)."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted((path / "policy").glob("*.safetensors")):
        sd.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {a for a, _ in getattr(model, "_tied_weights_keys", {}).items()} if isinstance(
        getattr(model, "_tied_weights_keys", None), dict) else set(getattr(model, "_tied_weights_keys", None) or [])
    real_missing = [m for m in missing if m not in tied]
    if real_missing or unexpected:
        from refit.core.errors import RefitError

        raise RefitError(f"checkpoint {path} does not match the model: missing {real_missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    extra = torch.load(path / "trainer.pt", weights_only=False)
    if value_head is not None and extra["value_head"] is not None:
        value_head.load_state_dict(extra["value_head"])
    if optimizer is not None and extra["optimizer"] is not None:
        optimizer.load_state_dict(extra["optimizer"])
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
    return json.loads((path / "state.json").read_text())
