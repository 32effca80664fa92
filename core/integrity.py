"""File integrity shared by every room: sha256 of files, what a folder holds, leftover temporary folders.

Refit writes folders atomically: into ``.NAME.tmp-PID`` beside the target (engines) or
``checkpoints/.step_N.tmp-PID`` (checkpoints), then one rename. A process killed before the rename
leaves the temporary folder; :func:`clean_stale_temps` removes those whose process is gone (a live
PID's folder is another process still writing, and is left alone).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

_TEMP = re.compile(r"^\..+\.(tmp|old)-(\d+)$")  # .step_000004.tmp-1234, .engine.tmp-1234, .engine.old-1234


def sha256_files(paths) -> str:
    """sha256 of the files' bytes in order (one digest over all of them)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_temps(folder: str | Path, log=print, prefix: str = "") -> list[Path]:
    """Remove ``folder/.NAME.tmp-PID`` (and ``.old-PID``) folders and files left by a process that is gone."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        m = _TEMP.match(p.name)
        if m is None or not p.name.startswith(f".{prefix}") or pid_alive(int(m.group(2))):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    if removed:
        log(f"refit: removed {len(removed)} leftover temporary folder{'s' if len(removed) > 1 else ''} of killed "
            f"runs in {folder} ({', '.join(p.name for p in removed[:3])}{', ...' if len(removed) > 3 else ''})")
    return removed


def folder_holds(path: str | Path) -> str:
    """What ``path`` is: "missing", "file", "empty", "engine" (manifest.json), "run" (run.json, metrics.jsonl,
    checkpoints/), "model" (config.json: an HF checkpoint) or "other"."""
    path = Path(path)
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "file"
    names = {p.name for p in path.iterdir() if not _TEMP.match(p.name)}
    if not names:
        return "empty"
    if "manifest.json" in names:
        return "engine"
    if names & {"run.json", "metrics.jsonl", "checkpoints"}:
        return "run"
    if "config.json" in names:
        return "model"
    return "other"


HOLDS = {"engine": "an engine folder", "run": "a training run", "model": "an HF model checkpoint",
         "other": "other files", "file": "a file"}


FAULT_ENV = "REFIT_FAULT_POINT"  # tests: "NAME" or "NAME:N" kills the process (os._exit) at the N-th pass of NAME
_hits: dict[str, int] = {}


def fault_due(name: str) -> bool:
    """True when ``REFIT_FAULT_POINT=NAME[:N]`` names ``name`` and this is its N-th pass (default the first)."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return False
    target, _, nth = want.partition(":")
    if target != name:
        return False
    _hits[name] = _hits.get(name, 0) + 1
    return _hits[name] >= int(nth or 1)


def fault_point(name: str) -> None:
    """A kill -9 stand-in for the fault-injection tests (tests/test_faults.py): ends the process at once, with
    no cleanup (``os._exit``), at the pass of ``name`` that ``REFIT_FAULT_POINT`` names (:func:`fault_due`)."""
    if fault_due(name):
        os._exit(137)


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file's contents, or one RefitError line naming it (missing, not UTF-8)."""
    path = Path(path)
    if not path.is_file():
        from refit.core.errors import RefitError

        raise RefitError(f"{what} {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        from refit.core.errors import RefitError

        raise RefitError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
