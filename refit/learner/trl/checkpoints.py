"""TRL's checkpoint layout as a second view of Refit's checkpoints (docs/trl-facade.md, "Checkpoints").

Refit's checkpoint ``OUTPUT_DIR/checkpoints/step_S/`` (hashed, atomic; what ``--resume`` continues bit-exactly) is
the one resumable state. After it is written, the facade writes TRL's view of it, ``OUTPUT_DIR/checkpoint-N/``
with N = ``state.global_step`` (optimizer steps, TRL's count; S x the optimizer steps of a Refit step)::

    checkpoint-N/   config.json, model.safetensors, generation_config.json,     the policy: hard links to the
                    tokenizer files (a LoRA run: adapter_config.json,            files of step_S/policy/ (a copy
                    adapter_model.safetensors)                                   across file systems)
                    trainer_state.json                                          transformers' TrainerState with
                                                                                log_history, as TRL writes it
                    optimizer.pt, scheduler.pt, rng_state.pth                   TRL's formats, from step_S/trainer.pt
                                                                                (not with save_only_model)
                    training_args.bin                                           torch.save of the config object
                    entropy_ctrl_state.json                                     use_adaptive_entropy: the
                                                                                controller's coefficient and
                                                                                last entropy, as GRPOTrainer
                    refit_checkpoint.json                                       {"step": S, "path": ...}: the
                                                                                Refit checkpoint it shows

A view exists while its Refit checkpoint does: ``save_total_limit`` is Refit's ``ckpt.keep_checkpoints`` and a
view whose Refit checkpoint was rotated away goes with it, but for the best one (``metric_for_best_model``:
``state.best_model_checkpoint``), kept as transformers keeps it (:func:`rotate`, :mod:`refit.learner.trl.best`).
``trainer_state.json`` holds ``stateful_callbacks`` (the ExportableState callbacks' and the control's states at
the save) and the best-model fields, as transformers writes them. ``train(resume_from_checkpoint=True)`` takes the
newest ``checkpoint-N`` (transformers' ``get_last_checkpoint``), restores ``trainer.state`` from its
``trainer_state.json`` and continues Refit's checkpoint it names; a path must name that same newest view.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.integrity import atomic_folder, link_or_copy

PREFIX = "checkpoint-"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-N
STATE, POINTER = "trainer_state.json", "refit_checkpoint.json"
ENTROPY_CTRL = "entropy_ctrl_state.json"  # TRL GRPO's use_adaptive_entropy state
TRL_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")  # transformers' OPTIMIZER_NAME, SCHEDULER_NAME, RNG


def refit_checkpoint(run_dir: Path, step: int) -> Path:
    """Refit's checkpoint folder of ``step`` (:func:`refit.learner.run.checkpoint.save_checkpoint`'s name)."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def trl_rng(rng: dict) -> dict:
    """Refit's RNG record (:func:`refit.learner.run.checkpoint.rng_state`) in transformers' ``rng_state.pth`` keys
    (one process: the CUDA state of the current device)."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda is not None:
        out["cuda"] = cuda[torch.cuda.current_device()] if isinstance(cuda, (list, tuple)) else cuda
    return out


def save_args(args, path: Path) -> None:
    """``training_args.bin`` as transformers writes it (``torch.save`` of the config object); a config that does
    not pickle (a class defined in a function, a lambda in ``refit={...}``) is saved as its ``to_dict()``, each
    value that does not pickle as its repr, so a checkpoint never fails over it."""
    try:
        blob = pickle.dumps(args)
    except (pickle.PicklingError, AttributeError, TypeError):
        blob = None
    if blob is not None:
        torch.save(args, path)
        return
    record = {}
    for k, v in args.to_dict().items():
        try:
            pickle.dumps(v)
            record[k] = v
        except (pickle.PicklingError, AttributeError, TypeError):
            record[k] = repr(v)
    torch.save(record, path)


def write_view(run_dir: Path, step: int, state, args, with_optimizer: bool = True) -> Path:
    """``run_dir/checkpoint-{state.global_step}``: TRL's view of Refit's checkpoint of ``step`` (the module's
    layout), written atomically; then :func:`rotate`. The path."""
    run_dir = Path(run_dir)
    source = refit_checkpoint(run_dir, step)
    view = run_dir / f"{PREFIX}{state.global_step}"
    with atomic_folder(view) as tmp:
        tmp.mkdir(parents=True)
        for f in sorted((source / "policy").iterdir()):
            if f.is_file():
                link_or_copy(f, tmp / f.name)
        if with_optimizer:
            extra = torch.load(source / "trainer.pt", weights_only=False)
            torch.save(extra["optimizer"], tmp / TRL_FILES[0])
            torch.save(extra["scheduler"], tmp / TRL_FILES[1])
            torch.save(trl_rng(extra["rng"]), tmp / TRL_FILES[2])
        save_args(args, tmp / "training_args.bin")
        state.save_to_json(str(tmp / STATE))
        (tmp / POINTER).write_text(json.dumps({"step": step, "path": str(source.relative_to(run_dir))}))
        if getattr(args, "use_adaptive_entropy", False):  # GRPOTrainer's controller file (Refit's state holds it)
            saved = json.loads((source / "state.json").read_text())
            (tmp / ENTROPY_CTRL).write_text(json.dumps({k: saved[k] for k in ("entropy_coef", "last_world_entropy")}))
    rotate(run_dir, args.save_total_limit, state.best_model_checkpoint)
    return view


def rotate(run_dir: Path, limit: int | None, best: str | None) -> None:
    """``save_total_limit``: Refit rotated its checkpoints and the views follow, but for ``best`` (the state's
    best_model_checkpoint: its files are the view's own, hard links outlive their source); then transformers'
    ``rotate_checkpoints``: at most max(limit, protected) views, the oldest unprotected deleted first, the newest
    and ``best`` protected."""
    best_path = Path(best).resolve() if best else None
    found = views(run_dir)
    for old in found:
        if old.resolve() != best_path and not refit_checkpoint(run_dir, _pointed_step(old)).is_dir():
            shutil.rmtree(old, ignore_errors=True)
    found = views(run_dir)
    if not limit or limit <= 0 or len(found) <= limit:
        return
    protected = {found[-1].resolve()} | ({best_path} if best_path else set())
    extra = len(found) - max(limit, len(protected & {v.resolve() for v in found}))
    for old in found:
        if extra <= 0:
            break
        if old.resolve() not in protected:
            shutil.rmtree(old, ignore_errors=True)
            extra -= 1


def views(run_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``run_dir``, oldest first (by N, as transformers sorts them)."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.iterdir() if CHECKPOINT_RE.match(p.name) and p.is_dir()] if run_dir.is_dir() else []
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.match(p.name).group(1)))


def _pointed_step(view: Path) -> int:
    try:
        return int(json.loads((view / POINTER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # not a view Refit wrote (or damaged): no Refit checkpoint behind it


def resume_point(run_dir: Path, resume_from_checkpoint: bool | str) -> tuple[Path, int]:
    """The view ``train(resume_from_checkpoint=...)`` continues and the Refit step it shows: True, the newest
    ``checkpoint-N`` (transformers' ``get_last_checkpoint``); a path, that folder, which must be the newest.
    Anything else is one line, before any work."""
    run_dir = Path(run_dir)
    found = views(run_dir)
    if not found:
        raise RefitError(f"resume_from_checkpoint: no checkpoint-N folder in output_dir {run_dir} (as TRL: no "
                         "valid checkpoint to continue); train without resume_from_checkpoint")
    newest = found[-1]
    view = newest
    if resume_from_checkpoint is not True:
        view = Path(resume_from_checkpoint)
        if not (view / STATE).is_file():
            raise RefitError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r}: not a checkpoint folder "
                             f"(no {STATE})")
        if view.resolve() != newest.resolve():
            raise RefitError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r}: Refit continues the newest "
                             f"checkpoint of output_dir {run_dir}, {newest.name}; to go back to {view.name}, start "
                             "a new output_dir from its model folder")
    step = _pointed_step(view)
    if not (refit_checkpoint(run_dir, step) / "state.json").is_file():
        raise RefitError(f"resume_from_checkpoint: {view} names no Refit checkpoint in {run_dir / 'checkpoints'} "
                         f"(no {POINTER}, or its step_N is gone: rotated by save_total_limit while the view was kept "
                         "as the best one); a checkpoint-N written by TRL itself cannot be continued here")
    return view, step


def load_state(view: Path):
    """transformers' ``TrainerState`` of ``view`` (its ``log_history`` included), as ``Trainer.train`` restores it."""
    from transformers import TrainerState

    return TrainerState.load_from_json(str(Path(view) / STATE))


def restored_rate(run_dir: Path, step: int) -> float:
    """The learning rate Refit's checkpoint of ``step`` holds (its scheduler's last rate; else its optimizer's first
    group): the rate the first step after a resume uses, which TRL logs for it."""
    extra = torch.load(refit_checkpoint(run_dir, step) / "trainer.pt", weights_only=False)
    last = (extra.get("scheduler") or {}).get("_last_lr")
    return float(last[0]) if last else float(extra["optimizer"]["param_groups"][0]["lr"])
