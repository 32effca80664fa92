"""Frozen dataclass records to and from their JSON, checked: every field present, no unknown key, each value its type.

The manifest (:mod:`refit.core.manifest`) is read and written through these: a misspelt or half-written file fails
where it is read, in one line naming the dotted path, not as a KeyError deep inside a reader.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from refit.core.errors import RefitError

OMIT_IF_NONE = {"omit_if_none": True}  # field metadata: a None value is left out of the JSON


def read_json(f: Path, broken: str) -> object:
    """The JSON in file ``f``; RefitError (one line) saying ``f {broken}: why`` when it does not parse."""
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise RefitError(f"{f} {broken}: {e}") from None


class LayoutError(ValueError):
    """A layout problem at a dotted path inside a record's JSON; the reader adds the file name."""


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def build_record(cls, raw: object, path: str, fixed: dict | None = None):
    """Record ``cls`` from its JSON object: every field present (optional ones may be absent), no other key."""
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: expected an object, got {type(raw).__name__}")
    fixed = fixed or {}
    hints = typing.get_type_hints(cls)
    own = [f for f in fields(cls) if f.name not in fixed]
    unknown = sorted(set(raw) - {f.name for f in own})
    missing = [f.name for f in own if f.name not in raw and f.default is MISSING and f.default_factory is MISSING]
    if unknown or missing:
        what = "; ".join(s for s in (missing and f"missing {', '.join(missing)}",
                                     unknown and f"unknown key(s) {', '.join(unknown)}") if s)
        raise LayoutError(f"{path}: {what}" if path else what)
    kw = {f.name: _value(raw[f.name], hints[f.name], _at(path, f.name)) for f in own if f.name in raw}
    return cls(**kw, **fixed)


def _value(v: object, hint, path: str):
    """``v`` as ``hint`` (a record, tuple[X, ...], Mapping[str, X], X | None, int, float, str or object)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _value(v, next(a for a in args if a is not type(None)), path)
    if is_dataclass(hint):
        return build_record(hint, v, path)
    if origin is tuple:
        if not isinstance(v, list):
            raise LayoutError(f"{path}: expected a list, got {type(v).__name__}")
        return tuple(_value(x, args[0], f"{path}[{i}]") for i, x in enumerate(v))
    if origin in (Mapping, dict):
        if not isinstance(v, dict):
            raise LayoutError(f"{path}: expected an object, got {type(v).__name__}")
        return {k: _value(x, args[1], _at(path, k)) for k, x in v.items()}
    if hint is object:
        return v
    ok = {bool: lambda x: isinstance(x, bool),
          int: lambda x: isinstance(x, int) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          str: lambda x: isinstance(x, str)}[hint]
    if not ok(v):
        raise LayoutError(f"{path}: expected {hint.__name__}, got {json.dumps(v)[:40]}")
    return v


def plain(v: object):
    """A record as its JSON value: fields in order (a None optional field left out), tuples as lists."""
    if is_dataclass(v):
        return {f.name: plain(getattr(v, f.name)) for f in fields(v)
                if not (f.metadata.get("omit_if_none") and getattr(v, f.name) is None)}
    if isinstance(v, tuple):
        return [plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: plain(x) for k, x in v.items()}
    return v
