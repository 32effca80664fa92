"""Who owns a run folder, and whether ``--resume`` continues the run it left.

A run folder records what run it is in ``run.json``: Refit's schema marker (``"format": "refit-run/1"``), a run
id, the hash of its resolved config, the config itself, the sha256 of every model folder it was started from and
``foreign``, the names that were in the folder before the run (a user's files beside it). Ownership is by that
proof, never by file names: a folder with another tool's ``metrics.jsonl`` or a user's ``checkpoints/`` is not a
run (:func:`refit.core.integrity.folder_holds`). :func:`claim` runs first in
:func:`refit.learner.run.loop.run_job`, before any work:

- the folder is locked for the life of the process (``RUN/.refit.lock``, an OS lock:
  :func:`refit.core.integrity.hold_folder`): a second run on it is refused in one line naming the holder;
- a fresh start into a folder that holds a run (a Refit ``run.json``) is refused in one line, unless
  ``overwrite``: then the earlier run's own files (:data:`RUN_FILES` less its ``foreign`` names; inside
  ``checkpoints/`` only its ``step_N`` folders) are deleted, saying so, and nothing else (the run's engine folders
  stay: they are reused only when their weights match, :mod:`refit.export.guard`);
  a run that stopped before its first checkpoint has nothing to continue: the line names ``--overwrite``;
- a folder that is an HF model or an engine folder is never used as a run folder, nor the current folder
  (``-o .``) or one above it; a non-empty folder that holds no run is refused unless ``overwrite``, and
  even then never when the run would replace one of its files (a user's own ``config.yaml``, ``metrics.jsonl``,
  ``checkpoints/``): the run is then written beside them and they are recorded as ``foreign``; a damaged
  (not JSON) ``run.json`` proves nothing: refused, nothing written or deleted;
- ``--resume`` compares the config with the one recorded: a field in :data:`MAY_CHANGE` (the run's
  length, logging, scale-out) is applied and logged, any other changed field is refused in one line
  (``--optim.learning_rate 1e6`` on resume would otherwise be ignored by the restored optimizer); paths
  are compared resolved (``./r5/``, ``r5`` and its absolute path are one folder), the run folder is the one
  whose ``run.json`` is read (a moved run is the same run), a model folder named by another path is the same
  when its weights are; a model folder whose weights changed since the run started is refused too;
- what a killed write left in the run folder is removed (when that PID is gone): ``.step_N.tmp-PID`` checkpoint
  folders, ``.run.json.tmp-PID``, ``.final.tmp-PID`` and any other ``.NAME.tmp-PID`` / ``.NAME.old-PID``;
- every engine folder the job will use is checked (:func:`guard_engines`): another model's engine is
  refused unless ``overwrite``, a damaged one of this model is exported again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from refit.core.contract import ENGINE_BACKENDS, weights_hash
from refit.core.errors import RefitError
from refit.core.integrity import (HOLDS, RUN_FORMAT, RUN_LOCK, RUN_RECORD, clean_stale_temps, engine_lock,
                                  fault_point, folder_holds, folder_names, hold_folder, matches, read_json)
from refit.rollout.build import guard_engine  # the engine folder's guard, through its one entry point

# fields a resumed run may change (applied and logged); any other change is refused
MAY_CHANGE = ("run.steps", "run.max_steps_this_run", "run.device", "log.", "scale.", "rollout.engine_threads",
              "ckpt.keep_checkpoints", "ckpt.save_steps", "export_final", "eval_max_prompts")
# what a run writes into its folder (names or fnmatch globs): a fresh run never starts where one of these is another's
# file, and --overwrite deletes the ones a run's record owns (all but its "foreign" names); engine and model folders
# are kept (reused when their weights match)
RUN_FILES = (RUN_RECORD, "metrics.jsonl", "checkpoints", "tb", "config.yaml", "curves.png", "summary.json", "final",
             "final_engine", "final_value_head.safetensors", "completions.jsonl", "checkpoint-*")
CHECKPOINT_ENTRIES = ("step_*", ".step_*")  # what the run writes inside checkpoints/ (refit.learner.run.checkpoint)
PATH_FIELDS = ("_dir", "dataset", "prompts_file")  # config fields (by their ending) that name a file or folder
# inputs a Python caller stages in the run folder before the job starts (refit.learner.api: a datasets.Dataset;
# the TRL facade: a model object saved for the export); a folder holding only these is a fresh run's
STAGED = ("train_dataset", "model", "teacher")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def config_values(cfg) -> dict:
    """The config as {dotted path: JSON value} (tuples as lists)."""
    return json.loads(json.dumps(_flat(dataclasses.asdict(cfg))))


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(config_values(cfg), sort_keys=True).encode()).hexdigest()[:16]


def model_dirs(cfg) -> dict[str, str]:
    """{field path: folder} of every model folder the config names (``model.model_dir``, ``teacher.model_dir``)."""
    return {k: v for k, v in config_values(cfg).items() if k.endswith("model_dir") and v}


def model_hashes(cfg) -> dict[str, str]:
    return {k: weights_hash(Path(v)) for k, v in model_dirs(cfg).items() if Path(v).is_dir()}


def read_record(run_dir: Path) -> dict | None:
    """The run's record (``run.json``), or None when the folder holds none that Refit wrote."""
    record = read_json(run_dir / RUN_RECORD)
    return record if isinstance(record, dict) else None


def own_names(run_dir: Path, record: dict | None) -> list[str]:
    """The names in ``run_dir`` that its run wrote and ``--overwrite`` may delete: :data:`RUN_FILES` less the names
    that were already there when the run claimed the folder (its record's ``foreign``)."""
    foreign = set((record or {}).get("foreign", []))
    return sorted(n for n in folder_names(run_dir) if matches(n, RUN_FILES) and n not in foreign)


def _remove_own(run_dir: Path, names: list[str], log) -> None:
    """Delete the run's own ``names`` (its record last, so a kill midway leaves a folder still known as a run);
    inside ``checkpoints/`` only the run's checkpoints: anything else there is kept, saying so."""
    for name in sorted(names, key=lambda n: n == RUN_RECORD):
        p = run_dir / name
        if name == "checkpoints" and p.is_dir() and not p.is_symlink():
            for c in p.iterdir():
                if matches(c.name, CHECKPOINT_ENTRIES):
                    shutil.rmtree(c) if c.is_dir() and not c.is_symlink() else c.unlink()
            kept = sorted(c.name for c in p.iterdir())
            if kept:
                log(f"refit: kept {len(kept)} file(s) in {p} that the run did not write ({', '.join(kept[:3])})")
            else:
                p.rmdir()
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def write_record(run_dir: Path, record: dict) -> None:
    tmp = run_dir / f".{RUN_RECORD}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(record, indent=1))
        fault_point("record.before_rename")
        os.replace(tmp, run_dir / RUN_RECORD)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing; a kill -9: the next claim


def _describe(run_dir: Path, record: dict | None) -> str:
    cks = _checkpoints(run_dir)
    who = f"run {record['run_id']}" if record else "a run"
    return f"{who}{f' (last checkpoint {cks[-1]})' if cks else ''}"


def _may_change(path: str) -> bool:
    return any(path == m or (m.endswith(".") and path.startswith(m)) for m in MAY_CHANGE)


def _is_path(key: str, value) -> bool:
    return isinstance(value, str) and bool(value) and key.endswith(PATH_FIELDS)


def _same_path(old, new, old_cwd: str) -> bool:
    """One file or folder, however spelled: ``old`` resolved from the recorded run's working folder."""
    if not (isinstance(old, str) and isinstance(new, str) and old and new):
        return old == new
    return (Path(old_cwd) / old).resolve() == Path(new).resolve()


def _moved(record: dict, new: dict, mine: dict[str, str]) -> dict[str, str]:
    """The path fields that name the same thing as recorded, spelled otherwise: {field: how it is the same}."""
    old, cwd, out = record.get("config", {}), record.get("cwd", os.getcwd()), {}
    for k, v in new.items():
        if old.get(k) == v or not _is_path(k, v) or not _is_path(k, old.get(k)):
            continue
        if _same_path(old[k], v, cwd):
            out[k] = "the same folder"
        elif k == "run.output_dir":
            out[k] = f"the run in it is run {record.get('run_id', '?')}"  # the folder whose run.json was read
        elif k in mine and record.get("models", {}).get(k) == mine[k]:
            out[k] = "the same weights"
    return out


def _compare(record: dict, cfg, log) -> None:
    old, new, mine = record.get("config", {}), config_values(cfg), model_hashes(cfg)
    moved = _moved(record, new, mine)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in moved]
    refused = [k for k in changed if not _may_change(k)]
    if refused:
        k = refused[0]
        more = f" (and {', '.join(refused[1:4])}{', ...' if len(refused) > 4 else ''})" if len(refused) > 1 else ""
        raise RefitError(f"--resume: {k} changed ({old.get(k)!r} -> {new.get(k)!r}){more}; a resumed run keeps its "
                         "config: drop the flag, or start a new run (another -o, or --overwrite)")
    if changed:
        log("refit: --resume: applying changed " + ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed))
    moved = {k: why for k, why in moved.items() if why != "the same folder"}
    if moved:
        log("refit: --resume: moved, " + ", ".join(f"{k} {old[k]!r} -> {new[k]!r} ({why})" for k, why in moved.items()))
    for k, h in record.get("models", {}).items():
        if k in mine and mine[k] != h:
            raise RefitError(f"--resume: the weights in {new.get(k)} ({k}) changed since the run started (sha256 "
                             f"{h[:12]} -> {mine[k][:12]}); the run continues from its checkpoint but its reference "
                             "and engine come from that folder: restore it, or start a new run")


def _refuse_foreign(run_dir: Path, holds: str, resume: bool, overwrite: bool) -> None:
    """The refusals that need no lock: a file, an engine, a model, the current folder, a folder of other files."""
    if holds in ("file", "engine", "model"):
        raise RefitError(f"run folder {run_dir} holds {HOLDS[holds]}; choose another run folder (-o / "
                         "--run.output_dir)")
    here = Path.cwd().resolve()
    if run_dir.resolve() == here or run_dir.resolve() in here.parents:
        raise RefitError(f"run folder {run_dir} is the current folder{'' if run_dir.resolve() == here else ' or above it'}"
                         "; give the run a folder of its own (-o runs/NAME)")
    record = run_dir / RUN_RECORD
    if holds == "other" and record.is_file() and read_json(record) is None:
        raise RefitError(f"{record} is damaged (not JSON), so Refit cannot tell whether {run_dir} holds its run: it "
                         "writes and deletes nothing there; restore run.json, or choose another run folder (-o)")
    if resume and holds != "run":
        raise RefitError(f"--resume: {run_dir} holds no run to continue (no {RUN_RECORD}, metrics or checkpoints); "
                         "start it without --resume")
    if holds == "other" and all(p.name in STAGED or p.name.startswith(".") for p in run_dir.iterdir()):
        return  # only what the caller staged for this run
    if holds == "other":
        mine = sorted(n for n in folder_names(run_dir) if matches(n, RUN_FILES))
        if mine:
            raise RefitError(f"run folder {run_dir} holds files that are not a Refit run's, and the run would "
                             f"replace {', '.join(mine[:3])}{', ...' if len(mine) > 3 else ''} (never done, "
                             "--overwrite included); choose another run folder (-o)")
        if not overwrite:
            raise RefitError(f"run folder {run_dir} is not empty and holds no Refit run; choose an empty or new "
                             "folder (-o), or pass --overwrite to write the run beside its files")


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def _has_rows(run_dir: Path) -> bool:
    """True when ``metrics.jsonl`` holds anything (a step-0 row counts: the run got that far)."""
    f = run_dir / "metrics.jsonl"
    return f.is_file() and f.stat().st_size > 0


def _own_names(run_dir: Path, cfg) -> set[str]:
    """Names in ``run_dir`` that the run's own config puts there: its default engine folders, model and engine
    folders it names inside the run folder (``refit distill``'s embedded pair in ``RUN/models``)."""
    root, out = run_dir.resolve(), set()
    paths = [v for k, v in config_values(cfg).items() if k.endswith("_dir") and v and k != "run.output_dir"]
    for p in [*paths, *(e for _, e in engine_pairs(cfg))]:
        try:
            out.add(Path(p).resolve().relative_to(root).parts[0])
        except (ValueError, IndexError):
            pass
    return out


def _holds(run_dir: Path, cfg) -> str:
    """:func:`folder_holds`, with a folder that holds only what the run's config puts there counted as empty."""
    holds = folder_holds(run_dir)
    if holds == "other":
        if folder_names(run_dir) <= _own_names(run_dir, cfg):
            return "empty"
    return holds


def claim(run_dir: Path, cfg, resume: bool, overwrite: bool, log=print) -> dict:
    """Make ``run_dir`` this run's (see the module doc); returns its record. Raises before anything is written
    but the folder itself and its lock file."""
    run_dir = Path(run_dir)
    _refuse_foreign(run_dir, _holds(run_dir, cfg), resume, overwrite)  # nothing created for these
    run_dir.mkdir(parents=True, exist_ok=True)
    hold_folder(run_dir / RUN_LOCK, f"run folder {run_dir}", log)
    holds = _holds(run_dir, cfg)  # again, under the lock: another run may have written it in between
    _refuse_foreign(run_dir, holds, resume, overwrite)
    clean_stale_temps(run_dir, log)  # any killed write's: .run.json.tmp-PID, .final.tmp-PID, .engine.tmp-PID, ...
    clean_stale_temps(run_dir / "checkpoints", log, prefix="step_")
    record = read_record(run_dir) if holds == "run" else None
    if resume:
        if not _checkpoints(run_dir):
            raise RefitError(f"--resume: {_describe(run_dir, record)} in {run_dir} stopped before its first "
                             "checkpoint: nothing to continue; start it again with --overwrite")
        _compare(record, cfg, log)
        record.setdefault("format", RUN_FORMAT)  # a record written before the marker existed gets it now
    else:
        foreign = (record or {}).get("foreign", []) if holds == "run" else sorted(
            folder_names(run_dir) - _own_names(run_dir, cfg))  # the user's files beside the run: never touched
        if holds == "run":
            empty = not _checkpoints(run_dir) and not _has_rows(run_dir)
            if not overwrite and not empty:
                if not _checkpoints(run_dir):
                    raise RefitError(f"run folder {run_dir} already holds {_describe(run_dir, record)}, which "
                                     "stopped before its first checkpoint; start it again with --overwrite "
                                     "(deletes its metrics), or choose another -o")
                raise RefitError(f"run folder {run_dir} already holds {_describe(run_dir, record)}; continue it with "
                                 "--resume, replace it with --overwrite (deletes its metrics and checkpoints), or "
                                 "choose another -o")
            mine = own_names(run_dir, record)
            if empty:
                log(f"refit: {_describe(run_dir, record)} in {run_dir} stopped before its first step (nothing "
                    "recorded); starting afresh")
            else:
                log(f"refit: --overwrite: deleting {_describe(run_dir, record)} from {run_dir} ({', '.join(mine)})"
                    + (f"; keeping {', '.join(foreign)} (not the run's)" if foreign else ""))
            _remove_own(run_dir, [n for n in mine if n != RUN_RECORD], log)  # the record is rewritten, not removed
        record = {"format": RUN_FORMAT, "run_id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "foreign": foreign}
    record.update(config_hash=config_hash(cfg), config=config_values(cfg), models=model_hashes(cfg), cwd=os.getcwd())
    return record


def engine_pairs(cfg) -> list[tuple[str, Path]]:
    """(model folder, engine folder) of every model the job runs on an engine (its default engine folder too)."""
    if getattr(getattr(cfg, "rollout", None), "backend", None) not in ENGINE_BACKENDS:
        return []
    run_dir, out = Path(cfg.run.output_dir), []
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec) and hasattr(sec, "model_dir") and hasattr(sec, "engine_dir") and sec.model_dir:
            default = "engine" if f.name == "model" else f"{f.name}_engine"
            out.append((sec.model_dir, Path(sec.engine_dir) if sec.engine_dir else run_dir / default))
    return out


def guard_engines(cfg, overwrite: bool, log=print) -> None:
    """:func:`refit.rollout.build.guard_engine` for every engine folder the job will use, then a shared lock on
    each that exists (:func:`refit.core.integrity.engine_lock`: no other process exports into it while the job
    reads it; runs that only read it share it)."""
    for model_dir, engine_dir in engine_pairs(cfg):
        guard_engine(model_dir, engine_dir, overwrite, log)
        if engine_dir.is_dir():
            hold_folder(engine_lock(engine_dir), f"engine folder {engine_dir}", log, shared=True)
