"""Atomic checkpoints: write into a temporary folder, then rename; keep the last K.

A checkpoint folder ``checkpoints/step_000010/`` holds ``policy/`` (an HF checkpoint folder with
its tokenizer: loadable and exportable as is), ``trainer.pt`` (value head, optimizer, scheduler,
RNG states), any job file (PPO's ``pending_rollout.pt``: the batch in flight of an overlapped run) and
``state.json`` (step, KL coefficient, data position, engine weight version, and the
sha256 of every other file of the checkpoint, written last). ``--resume`` verifies those hashes and
falls back, in one line, to the newest intact checkpoint when the newest one is damaged.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.learner.run.lora import is_lora, load_trainable_state, save_adapter
from refit.core.integrity import atomic_folder, fault_point, sha256_files


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
                    state: dict, keep: int = 2, files: dict | None = None) -> Path:
    """``files``: {name: object} written with torch.save beside trainer.pt (hashed like every file; PPO's batch in
    flight with rollout.max_staleness). A LoRA policy (a PEFT model) writes its adapter folder only
    (``save_pretrained``: adapter_config.json + adapter_model.safetensors), and its optimizer holds the adapter's
    state only: the frozen base is the model folder the run started from."""
    ck_root = Path(run_dir) / "checkpoints"
    ck_root.mkdir(parents=True, exist_ok=True)
    final = ck_root / f"step_{step:06d}"
    with atomic_folder(final, before_rename=lambda: fault_point("checkpoint.before_rename")) as tmp:
        if is_lora(model):
            save_adapter(model, tmp / "policy")
        else:
            model.save_pretrained(str(tmp / "policy"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "policy"))
        extra = {"value_head": value_head.state_dict() if value_head is not None else None,
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state()}
        torch.save(extra, tmp / "trainer.pt")
        for name, obj in (files or {}).items():
            torch.save(obj, tmp / name)
        files = {p.relative_to(tmp).as_posix(): sha256_files([p]) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, "sha256": files}, indent=1))
    fault_point("checkpoint.after_rename")
    if keep > 0:  # 0 keeps every checkpoint (refit.core.validate: keep_checkpoints >= 0)
        for old in sorted(p for p in ck_root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    cks = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return cks[-1] if cks else None


def checkpoint_damage(path: Path) -> str | None:
    """None when ``path``'s state.json reads and every file it lists has its recorded sha256; else what is wrong.
    (Checkpoints written before the hashes existed are checked by loading them.)"""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json unreadable: {type(e).__name__}"
    for name, want in (state.get("sha256") or {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if sha256_files([f]) != want:
            return f"{name} does not match its recorded sha256"
    return None


def resume_latest(run_dir: Path, model, value_head, optimizer, scheduler, log=print) -> tuple[Path, dict]:
    """``--resume``: :func:`load_checkpoint` of the newest intact checkpoint in ``run_dir``; (its path, state.json).

    A damaged newer checkpoint (hash mismatch, truncated file, unreadable state) is skipped with one line."""
    root = Path(run_dir) / "checkpoints"
    cks = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    if not cks:
        raise RefitError(f"--resume: no checkpoint in {root}")
    damaged = []
    for ck in reversed(cks):
        problem = checkpoint_damage(ck)
        if problem is None:
            try:
                state = load_checkpoint(ck, model, value_head, optimizer, scheduler)
            except RefitError:
                raise  # intact but for another model: not damage
            except Exception as e:  # noqa: BLE001 - a damaged file of an older (hash-less) checkpoint
                problem = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
        if problem is None:
            if damaged:
                log(f"refit: --resume: checkpoint {damaged[0][0].name} is damaged ({damaged[0][1]})"
                    f"{f' and {len(damaged) - 1} more' if len(damaged) > 1 else ''}; resuming from {ck.name}, "
                    "the newest intact one")
            return ck, state
        damaged.append((ck, problem))
    raise RefitError(f"--resume: every checkpoint in {root} is damaged (newest {damaged[0][0].name}: "
                     f"{damaged[0][1]}); start a new run with --overwrite")


def load_checkpoint(path: Path, model, value_head, optimizer, scheduler) -> dict:
    """Load weights and trainer state in place; return state.json (RNG restored too)."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted((path / "policy").glob("*.safetensors")):
        sd.update(load_file(str(f)))
    if is_lora(model):  # a LoRA policy's checkpoint holds its adapter only (PEFT's adapter folder)
        if not (path / "policy" / "adapter_config.json").is_file():
            raise RefitError(f"checkpoint {path} holds a full model, this run trains a LoRA adapter (lora.r > 0); "
                             "resume with the lora settings it was written with")
        load_trainable_state(model, sd)
        missing, unexpected = [], []
    else:
        if (path / "policy" / "adapter_config.json").is_file():
            raise RefitError(f"checkpoint {path} holds a LoRA adapter, this run trains the full model (lora.r 0); "
                             "resume with the lora settings it was written with")
        missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {a for a, _ in getattr(model, "_tied_weights_keys", {}).items()} if isinstance(
        getattr(model, "_tied_weights_keys", None), dict) else set(getattr(model, "_tied_weights_keys", None) or [])
    real_missing = [m for m in missing if m not in tied]
    if real_missing or unexpected:
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
