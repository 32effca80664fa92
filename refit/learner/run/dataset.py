"""Datasets with columns, loaded with the ``datasets`` library, in TRL's conventions.

``dataset:`` is a local file (``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv``, read by the ``datasets``
builder of that name) or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
Nothing is fetched from a hub.

- Splits: a file is one split, ``train``; a ``save_to_disk`` folder has its own (a single ``Dataset`` is
  ``train``). ``dataset_split`` and ``eval_split`` are split specs in the ``datasets`` syntax, slices
  included (``train[:90%]``, ``train[90%:]``, ``test``), resolved by ``datasets.ReadInstruction``; or
  ``eval_fraction`` holds out that share of the training split (``Dataset.train_test_split``, seeded).
- Columns: ``prompt`` (rename with ``prompt_column``, or ``dataset_text_field`` as in TRL's SFT) holds
  text or a list of chat messages (``{"role", "content"}``); every other column is carried along and
  handed to reward functions by name, row-aligned with the prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit.core.errors import RefitError
from refit.core.integrity import read_text

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class PromptSet:
    """Prompts and their row-aligned columns (one split)."""

    prompts: list[Any]  # text or a list of chat messages, per row
    columns: dict[str, list] = field(default_factory=dict)  # other dataset columns, each len(prompts)
    source: str = ""  # "PATH (split SPEC)", for messages

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, idx: list[int]) -> dict[str, list]:
        """The other columns' values of rows ``idx`` (in that order)."""
        return {k: [v[i] for i in idx] for k, v in self.columns.items()}

    def subset(self, idx: list[int]) -> "PromptSet":
        return PromptSet(prompts=[self.prompts[i] for i in idx], columns=self.take(idx), source=self.source)


def _load_all(path: Path):
    """The file or folder as a ``DatasetDict`` (a file and a lone ``Dataset`` are its ``train`` split)."""
    import datasets

    datasets.disable_progress_bars()
    if not path.exists():
        raise RefitError(f"dataset {path} does not exist")
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            return ds if isinstance(ds, datasets.DatasetDict) else datasets.DatasetDict({"train": ds})
        if path.suffix.lower() == ".jsonl":
            check_jsonl(path, "dataset")
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise RefitError(f"dataset {path}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet, .csv "
                             "or a save_to_disk folder (prompts_file for one prompt per line)")
        return datasets.load_dataset(builder, data_files={"train": str(path)})
    except RefitError:
        raise
    except Exception as e:  # noqa: BLE001 - parse errors etc. are the user's file: one line
        if "corresponds to no data" in str(e):  # what datasets says of a file without rows
            raise RefitError(f"dataset {path} is empty") from None
        first = (str(e).strip().splitlines() or [""])[0]
        raise RefitError(f"dataset {path}: cannot load: {type(e).__name__}: {first}") from None


def check_jsonl(path: Path, what: str) -> list[dict]:
    """The rows of a JSON-lines file; one line naming the file and the row when it is empty, not UTF-8, or a line
    is not a JSON object."""
    lines = read_text(path, what).splitlines()
    rows = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError as e:
            raise RefitError(f"{what} {path} line {i + 1} is not valid JSON ({e.msg} at column {e.colno}): fix or "
                             "remove that line") from None
        if not isinstance(row, dict):
            raise RefitError(f"{what} {path} line {i + 1} is a {type(row).__name__}, not a JSON object of columns")
        rows.append(row)
    if not rows:
        raise RefitError(f"{what} {path} is empty (no JSON lines)")
    return rows


def select_split(dd, spec: str, where: str):
    """The rows of split spec ``spec`` (``name`` or ``name[a:b]`` / ``name[a%:b%]``) of ``dd``."""
    import datasets

    if spec in dd:
        return dd[spec]
    try:
        (ins,) = datasets.ReadInstruction.from_spec(spec).to_absolute({k: len(v) for k, v in dd.items()})
    except (ValueError, KeyError, AssertionError) as e:
        raise RefitError(f"{where}: split {spec!r} is not one of {sorted(dd)} (or a slice of one): {e}") from None
    return dd[ins.splitname].select(range(ins.from_, ins.to))


def _to_prompt_set(ds, column: str, source: str) -> PromptSet:
    if len(ds) == 0:
        raise RefitError(f"dataset {source} is empty")
    if column not in ds.column_names:
        raise RefitError(f"dataset {source} has no column {column!r} (columns: {', '.join(ds.column_names)}); set "
                         "prompt_column (or dataset_text_field)")
    cols = {c: list(ds[c]) for c in ds.column_names if c != column}
    return PromptSet(prompts=list(ds[column]), columns=cols, source=source)


def load_prompt_dataset(path: str, split: str = "train", prompt_column: str = "prompt", eval_split: str = "",
                        eval_fraction: float = 0.0, seed: int = 0) -> tuple[PromptSet, PromptSet | None]:
    """(train, held-out or None) from ``path``; every failure is one line naming the dataset."""
    if eval_split and eval_fraction:
        raise RefitError("give eval_split or eval_fraction, not both")
    if not 0.0 <= eval_fraction < 1.0:
        raise RefitError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    p = Path(path)
    dd = _load_all(p)
    train = select_split(dd, split, f"dataset {p}")
    held = select_split(dd, eval_split, f"dataset {p}") if eval_split else None
    if eval_fraction:
        if len(train) < 2:
            raise RefitError(f"dataset {p} (split {split}): {len(train)} rows cannot be split by eval_fraction")
        parts = train.train_test_split(test_size=eval_fraction, seed=seed)
        train, held = parts["train"], parts["test"]
    out = _to_prompt_set(train, prompt_column, f"{p} (split {split})")
    return out, (_to_prompt_set(held, prompt_column, f"{p} (eval)") if held is not None else None)


def text_file_prompts(path: str) -> PromptSet:
    """The plain path: one prompt per line, no columns."""
    p = Path(path)
    if not p.exists():
        raise RefitError(f"prompts file {p} does not exist")
    lines = [ln for ln in read_text(p, "prompts file").splitlines() if ln.strip()]
    if not lines:
        raise RefitError(f"prompts file {p} holds no prompts")
    return PromptSet(prompts=lines, source=str(p))


def cap(ps: PromptSet | None, n: int, seed: int) -> PromptSet | None:
    """At most ``n`` rows of ``ps`` (a seeded choice, in order; ``n`` = 0: all)."""
    if ps is None or not n or len(ps) <= n:
        return ps
    return ps.subset(sorted(random.Random(seed).sample(range(len(ps)), n)))
