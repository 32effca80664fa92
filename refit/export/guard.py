"""Before an engine folder is used or written: is it this model's, and is it intact?

:func:`guard_engine` is called by ``refit export`` and by the training jobs (through
:func:`refit.learner.run.folder.guard_engines`) before :func:`refit.rollout.build.build`:

- missing or empty: fine (it will be exported);
- an HF model, a run or other files: refused (an export never writes over something else);
- an engine of other weights (its manifest's ``hf_weights_sha256`` differs from the model's): refused,
  unless ``overwrite``, which removes it, saying so (it is then exported afresh);
- an engine of these weights whose files no longer match its manifest (a ``.onnx``, ``.onnx.data`` or
  ``tokenizer/`` file changed, truncated or missing: :func:`engine_damage`) or whose manifest cannot be read: said in one
  line and removed, so it is exported again from the model (it was this model's engine);
- leftover ``.NAME.tmp-PID`` folders of killed exports beside it are removed.

:func:`engine_damage` is also what ``refit generate`` checks before opening an engine folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.integrity import (ENGINE_NAMES, HOLDS, clean_stale_temps, engine_lock, folder_hashes, folder_holds,
                                  folder_names, hold_folder, matches, sha256_files)
from refit.core.manifest import Manifest
from refit.export.onnx_export import weights_hash


def engine_damage(engine_dir: str | Path) -> str | None:
    """None when every graph file of ``engine_dir`` matches its manifest (sha256 of ``.onnx`` and ``.onnx.data``)
    and the manifest's sizes match the folder's config.json; else what is wrong, in words."""
    engine_dir = Path(engine_dir)
    try:
        m = Manifest.read(engine_dir)
    except RefitError as e:
        return f"its manifest is unusable ({e})"
    for g, spec in m.graphs.items():
        for name, want in ((spec.file, spec.sha256), (spec.data, spec.weights_sha256)):
            f = engine_dir / name
            if not f.is_file():
                return f"{name} is missing"
            if sha256_files([f]) != want:
                return f"{name} does not match its manifest (sha256 differs: changed, truncated or replaced)"
    problem = _tokenizer_damage(engine_dir, m.hashes.tokenizer_sha256)
    if problem:
        return problem
    cfg = engine_dir / "config.json"
    if cfg.is_file():  # the source model's config.json, copied at export
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(str(engine_dir)).get_text_config()
        vocab, positions = text.vocab_size, getattr(text, "max_position_embeddings", None)
        if vocab != m.dims.vocab_size:
            return f"manifest vocab_size {m.dims.vocab_size} differs from the model's {vocab} (config.json)"
        if m.dims.max_positions is not None and m.dims.max_positions != positions:
            return f"manifest max_positions {m.dims.max_positions} differs from the model's {positions} (config.json)"
    return None


def _tokenizer_damage(engine_dir: Path, recorded: dict[str, str] | None) -> str | None:
    """What is wrong with the engine's ``tokenizer/`` against its recorded hashes; a folder exported before they
    were recorded: its ``tokenizer.json`` at least parses."""
    tok = engine_dir / "tokenizer"
    if recorded:
        found = folder_hashes(tok)
        for name, want in recorded.items():
            if name not in found:
                return f"tokenizer/{name} is missing"
            if found[name] != want:
                return f"tokenizer/{name} does not match its manifest (sha256 differs: changed, truncated or replaced)"
        return None
    f = tok / "tokenizer.json"
    if f.is_file():
        try:
            json.loads(f.read_bytes())
        except ValueError as e:
            return f"tokenizer/tokenizer.json is damaged (not JSON: {str(e)[:80]})"
    return None


def require_intact(engine_dir: str | Path, model_hint: str = "MODEL") -> None:
    """One line when ``engine_dir`` is damaged (:func:`engine_damage`): for commands that only read an engine."""
    problem = engine_damage(engine_dir)
    if problem:
        raise RefitError(f"engine folder {engine_dir} is damaged: {problem}; export it again "
                         f"(refit export {model_hint} -o {engine_dir} --overwrite)")


def require_tokenizer(model_dir: str | Path) -> None:
    """An export needs the model's tokenizer files (an engine folder carries them for generate and the jobs)."""
    model_dir = Path(model_dir)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model", "source.spm",
             "sentencepiece.bpe.model", "tokenizer.model")
    if model_dir.is_dir() and not any((model_dir / n).exists() for n in names):
        raise RefitError(f"{model_dir} has no tokenizer files ({', '.join(names[:2])}, ...): save the tokenizer "
                         "into the model folder (tokenizer.save_pretrained(MODEL_DIR)) before exporting")


def _take(engine_dir: Path, log) -> None:
    """The engine folder's exclusive lock before it is removed: refused while another process uses it; refused
    too when the folder holds files an export did not write (they would go with it)."""
    hold_folder(engine_lock(engine_dir), f"engine folder {engine_dir}", log)
    require_only_engine_files(engine_dir)


def require_only_engine_files(engine_dir: str | Path) -> None:
    """One line when ``engine_dir`` holds anything an export does not write (a user's notes beside the graphs):
    an engine folder is replaced whole (removed, or renamed over), and Refit deletes nothing it did not write."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        return
    foreign = sorted(n for n in folder_names(engine_dir) if not matches(n, ENGINE_NAMES))
    if foreign:
        raise RefitError(f"engine folder {engine_dir} also holds {', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}, which no export wrote; Refit deletes nothing it did "
                         "not write: move them out of the folder, or choose another engine folder")


def guard_engine(model_dir: str | Path, engine_dir: str | Path, overwrite: bool = False, log=print,
                 flag: str = "--overwrite") -> None:
    """Make ``engine_dir`` safe to reuse or export into for ``model_dir`` (see the module doc), or refuse."""
    model_dir, engine_dir = Path(model_dir), Path(engine_dir)
    clean_stale_temps(engine_dir.parent, log, prefix=engine_dir.name + ".")
    clean_stale_temps(engine_dir, log, prefix="manifest.json")  # a manifest rewrite killed before its rename
    holds = folder_holds(engine_dir)
    if holds in ("missing", "empty") or not model_dir.is_dir():
        return  # nothing to protect, or no model (the export says so in its own line)
    if holds != "engine":
        raise RefitError(f"engine folder {engine_dir} holds {HOLDS[holds]}, not an engine; refusing to write into it: "
                         "choose another engine folder")
    try:
        source = Manifest.read(engine_dir).hashes.hf_weights_sha256
    except RefitError as e:
        if not overwrite:
            raise RefitError(f"engine folder {engine_dir} has an unusable manifest ({e}); pass {flag} to export "
                             "over it") from None
        source = None
    mine = weights_hash(model_dir)
    if source != mine:
        if not overwrite:
            raise RefitError(f"engine folder {engine_dir} holds an engine of other weights (source sha256 "
                             f"{str(source)[:12]}, {model_dir} is {mine[:12]}); give another engine folder, or pass "
                             f"{flag} to replace it")
        log(f"refit: {flag}: removing engine folder {engine_dir} (exported from other weights) to export {model_dir}")
        _take(engine_dir, log)
        shutil.rmtree(engine_dir)
        return
    problem = engine_damage(engine_dir)
    if problem:
        log(f"refit: engine folder {engine_dir} is damaged ({problem}); exporting it again from {model_dir}")
        _take(engine_dir, log)
        shutil.rmtree(engine_dir)
