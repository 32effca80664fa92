"""File integrity shared by every room: sha256 of files, what a folder holds, leftover temporary folders.

Refit writes folders and files atomically: into ``.NAME.tmp-PID`` beside the target (engines, ``run.json``,
``final``, ``manifest.json``, a weight push's scratch ``.NAME.push-XXXX.tmp-PID``) or
``checkpoints/.step_N.tmp-PID`` (checkpoints), then one rename. A process killed before the rename leaves the
temporary folder or file; :func:`clean_stale_temps` removes those whose process is gone (a live PID's is another
process still writing, and is left alone).

Who may write a folder: :func:`hold_folder` takes an OS lock (``fcntl.flock``) on a lock file for the life
of the process: ``RUN/.refit.lock`` inside a run folder (exclusive), ``.NAME.lock`` beside an engine folder
(exclusive while it is exported, shared while runs only read it: readers exclude writers, not each other).
The kernel drops it when the process ends, however it ends, so a killed run never blocks the next; the file
records the writer's pid, which names it to a second process (refused in one line) and, left behind by a
process that did not end normally, is taken over, saying so.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from refit.core.errors import RefitError

_TEMP = re.compile(r"^\..+\.(tmp|old)-(\d+)$")  # .step_000004.tmp-1234, .engine.tmp-1234, .engine.old-1234
_LOCK = re.compile(r"^\..*\.lock$")  # .refit.lock (a run folder's), .NAME.lock (beside an engine folder)
RUN_LOCK = ".refit.lock"
_held: dict[str, tuple[int, bool]] = {}  # resolved lock file -> (open descriptor, shared), held until the process ends


def sha256_files(paths) -> str:
    """sha256 of the files' bytes in order (one digest over all of them)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (one file on disk, two names: a view or copy of a model costs no space for
    its weights, and writing the new folder never writes ``src``), a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def folder_hashes(folder: str | Path) -> dict[str, str]:
    """{file name: sha256} of every file directly in ``folder`` (an engine's ``tokenizer/``), sorted by name."""
    folder = Path(folder)
    return {p.name: sha256_files([p]) for p in sorted(folder.iterdir()) if p.is_file()} if folder.is_dir() else {}


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


def _holder(lock: Path) -> str:
    """The pid and command recorded in ``lock`` ("" when empty or unreadable)."""
    try:
        return lock.read_text(errors="replace").strip()
    except OSError:
        return ""


def _release_all() -> None:
    """At a normal exit: empty every lock file this process writes (a pid left behind means a killed holder)."""
    for fd, shared in _held.values():
        try:
            if not shared:
                os.ftruncate(fd, 0)
        except OSError:
            pass


def _refuse(lock: Path, what: str) -> RefitError:
    """The line for a lock another process holds, naming the holder (read again briefly: it writes its pid
    just after it takes the lock)."""
    holder = ""
    for _ in range(50):
        holder = _holder(lock)
        m = re.match(r"pid (\d+)", holder)
        if m and pid_alive(int(m.group(1))):
            break
        holder = ""
        time.sleep(0.01)
    return RefitError(f"{what} is in use by another Refit process{f' ({holder})' if holder else ''}; wait for it to "
                      "end, or choose another folder")


def engine_lock(engine_dir: str | Path) -> Path:
    """The lock file of an engine folder: beside it (``.NAME.lock``), so the folder itself can be renamed into
    place and removed while the lock is held."""
    engine_dir = Path(engine_dir)
    return engine_dir.parent / f".{engine_dir.name}.lock"


def hold_folder(lock: str | Path, what: str, log=print, shared: bool = False) -> None:
    """Hold ``lock`` (a ``flock``) until this process ends; a process that the lock excludes is refused in one line.

    ``shared``: a reader (a run that uses an engine folder as it is): readers exclude writers, not each other.
    Otherwise exclusive (a writer: a run folder, an export); a shared lock this process holds is turned into an
    exclusive one. ``what`` names the folder in the refusal ("run folder runs/a"). A lock this process already
    holds as strongly does nothing; an exclusive lock whose file names a process that is gone (killed: the
    kernel released its lock) is taken over, saying so."""
    lock = Path(lock)
    key = str(lock.resolve())
    if key in _held and (shared or not _held[key][1]):
        return
    if key in _held:
        fd = _held[key][0]
    else:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        if key not in _held:
            os.close(fd)
        raise _refuse(lock, what) from None
    if not _held:
        atexit.register(_release_all)
    _held[key] = (fd, shared)
    if shared:
        return
    before = _holder(lock)
    pid = re.match(r"pid (\d+)", before)
    if pid and int(pid.group(1)) != os.getpid() and not pid_alive(int(pid.group(1))):
        log(f"refit: {what} was held by {before}, which ended without releasing it; taking it over")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {' '.join(os.path.basename(a) for a in sys.argv[:3])}\n".encode(), 0)


def share_folder(lock: str | Path) -> None:
    """Turn this process's exclusive hold on ``lock`` into a shared one (a written engine folder now only read)."""
    key = str(Path(lock).resolve())
    if key in _held and not _held[key][1]:
        fd = _held[key][0]
        os.ftruncate(fd, 0)  # the write is complete: no pid left to read as a holder that died mid-write
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held[key] = (fd, True)


def clean_stale_temps(folder: str | Path, log=print, prefix: str = "") -> list[Path]:
    """Remove ``folder/.NAME.tmp-PID`` (and ``.old-PID``) folders and files left by a process that is gone."""
    folder, removed, dirs = Path(folder), [], 0
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        m = _TEMP.match(p.name)
        if m is None or not p.name.startswith(f".{prefix}") or pid_alive(int(m.group(2))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            dirs += 1
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    if removed:
        n, files = len(removed), len(removed) - dirs
        what = (f"folder{'s' if n > 1 else ''}" if not files else f"file{'s' if n > 1 else ''}" if not dirs
                else "files and folders")
        log(f"refit: removed {n} leftover temporary {what} of killed runs in {folder} "
            f"({', '.join(p.name for p in removed[:3])}{', ...' if n > 3 else ''})")
    return removed


def folder_names(path: str | Path) -> set[str]:
    """The names in folder ``path``, less Refit's lock files and leftover temporary files and folders."""
    return {p.name for p in Path(path).iterdir() if not _TEMP.match(p.name) and not _LOCK.match(p.name)}


RUN_RECORD = "run.json"  # a run folder's record: the proof that Refit's run owns the folder
RUN_FORMAT = "refit-run/1"  # run.json's schema marker
ENGINE_FORMAT = "refit-engine/"  # manifest.json's schema marker (refit.core.manifest: "refit-engine/1")
# what an engine folder holds: a folder of these names alone, with graphs, is an engine whose manifest is damaged
ENGINE_NAMES = ("manifest.json", "config.json", "generation_config.json", "tokenizer", "*.onnx", "*.onnx.data",
                "*.data", "*.plan", ".*.plan.building-*")


def read_json(path: str | Path):
    """The JSON value in file ``path``; None when it is missing or not JSON (damaged, another tool's binary)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None


def is_run_record(d) -> bool:
    """True for a ``run.json`` Refit wrote: its schema marker and run id (or, written before the marker existed,
    its run id beside the config and the config's hash). Another tool's ``run.json`` is not one."""
    if not isinstance(d, dict) or not isinstance(d.get("run_id"), str):
        return False
    return d.get("format") == RUN_FORMAT or (isinstance(d.get("config"), dict) and "config_hash" in d)


def matches(name: str, patterns) -> bool:
    """True when ``name`` is one of ``patterns`` (plain names or fnmatch globs: ``checkpoint-*``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _is_engine(path: Path, names: set[str]) -> bool:
    """A Refit engine folder: its manifest carries Refit's schema marker; or its manifest is damaged (not JSON)
    in a folder that holds graphs and nothing an engine folder does not."""
    m = read_json(path / "manifest.json")
    if isinstance(m, dict):
        return str(m.get("format", "")).startswith(ENGINE_FORMAT)
    graphs = any(n.endswith((".onnx", ".plan")) for n in names)
    return m is None and graphs and all(matches(n, ENGINE_NAMES) for n in names)


def folder_holds(path: str | Path) -> str:
    """What ``path`` is, by proof rather than by file names: "missing", "file", "empty", "engine" (a Refit
    manifest.json), "run" (a Refit run.json: :func:`is_run_record`), "model" (config.json: an HF checkpoint) or
    "other" (anything else: another tool's metrics.jsonl, run.json or manifest.json, a user's checkpoints/)."""
    path = Path(path)
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "file"
    names = folder_names(path)
    if not names:
        return "empty"
    if "manifest.json" in names and _is_engine(path, names):
        return "engine"
    if RUN_RECORD in names and is_run_record(read_json(path / RUN_RECORD)):
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
        raise RefitError(f"{what} {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RefitError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


@contextmanager
def atomic_folder(final: Path, before_rename=lambda: None):
    """Write a folder atomically: yield a temporary folder path (``.NAME.tmp-PID`` beside ``final``) to write into; when the block ends without an error, ``final`` (an older one removed) becomes it in
    one rename. The temporary folder is removed whatever happens, so a failure leaves ``final`` as it was."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        before_rename()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as e:
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC
        if (full and not e.filename) or (not full and out_of_space(final.parent)):
            # torch.save's writer says only "unexpected pos" on a full disk, safetensors names no file: name the folder
            raise OSError(errno.ENOSPC, "No space left on device", str(final)) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def out_of_space(folder: str | Path, margin: int = 1 << 20) -> bool:
    """True when the file system of ``folder`` has less than ``margin`` bytes left for this user."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < margin
