"""Any exception that reaches the ``refit`` command line -> one line that says what happened and what to do.

``refit.cli.main`` (the front door) is the one dispatch point: a :class:`RefitError` is printed as is; the
exceptions that come from files, graphs and the operating system are named here (:func:`explain`);
anything else is an unexpected error, printed as one line with a hint to rerun with ``--debug``,
which re-raises it with its traceback.
"""

from __future__ import annotations

import errno

DEBUG_HINT = "rerun with --debug for the traceback"


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# after a full disk, how each command recovers (a command not named: "then rerun it")
RECOVER = {
    "ppo": "then rerun (with --resume once the run has a checkpoint: those before this one are intact)",
    "distill": "then rerun (with --resume once the run has a checkpoint: those before this one are intact)",
    "demo": "then rerun refit demo",
    "export": "then rerun the same refit export (an engine folder is renamed into place only when complete)",
    "build-model": "then rerun the same refit build-model (the model folder is renamed into place only when complete)",
    "generate": "then rerun refit generate",
    "bench": "then rerun the benchmark (built models and engines are reused)",
}


def _disk_full(where: str, command: str) -> str:
    return f"disk full while writing {where}: free space, {RECOVER.get(command, 'then rerun it')}"


def _os_error(e: OSError, command: str = "") -> str | None:
    where = e.filename or "a file"
    if e.errno == errno.ENOSPC or "No space left on device" in str(e):
        return _disk_full(where, command)
    if e.errno == errno.EROFS:
        return f"cannot write {where}: read-only file system; choose a writable folder (-o / --run.output_dir)"
    if isinstance(e, PermissionError) or e.errno == errno.EACCES:
        return f"cannot write {where}: permission denied; choose a folder you can write (-o / --run.output_dir)"
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return f"{where} is in the way: a file where a folder is needed (or the reverse); choose another path"
    if isinstance(e, FileNotFoundError):
        return f"{where} does not exist: check the path"
    if isinstance(e, IsADirectoryError):
        return f"{where} is a folder where a file is needed: check the path"
    return None


def explain(e: BaseException, command: str = "") -> str | None:
    """One line for an exception from a file, a graph or the system; None when it is not one of those.
    ``command`` (``ppo``, ``export``, ...) picks the way to recover from a full disk (:data:`RECOVER`)."""
    if isinstance(e, OSError):
        return _os_error(e, command)
    if isinstance(e, UnicodeDecodeError):
        return f"a text file is not UTF-8 ({_first(e)}): save it as UTF-8"
    name, module = type(e).__name__, type(e).__module__ or ""
    if name == "SafetensorError":
        if "No space left on device" in str(e):
            return _disk_full("a .safetensors file", command)
        return f"a .safetensors file is damaged or incomplete ({_first(e)}): replace it (re-save the model)"
    if name == "DecodeError" and "protobuf" in module:
        return ("an .onnx graph is damaged (protobuf could not parse it): re-export the engine folder "
                "(refit export MODEL -o ENGINE_DIR --overwrite)")
    if "onnxruntime" in module:
        return (f"ONNX Runtime refused the engine: {_first(e)}; the engine folder may be damaged or from another "
                "model: re-export it (refit export MODEL -o ENGINE_DIR --overwrite)")
    if name in ("YAMLError", "ParserError", "ScannerError") and "yaml" in module:
        return f"a YAML file is not valid YAML: {_first(e)}"
    return None


def unexpected(e: BaseException) -> str:
    """The one line for an exception nobody named: its type and first line, and the --debug hint."""
    return f"unexpected {type(e).__name__}: {_first(e)} ({DEBUG_HINT})"
