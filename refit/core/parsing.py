"""One parser for every ``refit`` subcommand: frozen dataclasses -> tyro, with a YAML file as the defaults.

``parse(Config, argv, prog)`` turns ``[--config FILE.yaml] [--section.field value ...]`` into a frozen
``Config`` (why tyro and not HfArgumentParser: see ``refit/learner/run/config.py``). It lives in ``refit/core/``,
the bottom room, because ``refit export`` uses it and nothing below ``learner`` may import ``learner``.

- Precedence: field defaults < YAML file (``--config``) < flags. YAML sections are native
  (``rollout: {backend: torch}`` is ``--rollout.backend torch``); an unknown key is one line naming it.
- Help: every field carries ``metadata["help"]`` (the HfArgumentParser convention, which tyro reads).
  Flags are printed with underscores, as the YAML keys and the Python names; hyphens are accepted too.
- Bools are flags (``--log.progress``, ``--log.no_progress``) and also take a value
  (``--progress false``, as HfArgumentParser's did).
- A section annotated ``tyro.conf.arg(name="")`` (:data:`FLAT`) keeps no prefix: its fields are
  spelled as the job's own fields in flags, YAML and the saved config (``--top_k``, ``top_k: 5``), though
  the Python path is ``sampling.top_k`` (:func:`flat_leaves`).
- ``legacy`` maps old flat names (``rollout_workers``) to their dotted paths (``scale.workers``): in YAML
  and on the command line they still work, with one deprecation line on stderr naming the new spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import sys
import typing
from pathlib import Path
from types import SimpleNamespace, UnionType
from typing import Annotated, Any, Literal

import tyro
import yaml

from refit.core.errors import RefitError
from refit.core.integrity import read_text
from refit.core.validate import validate

BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}

FLAT = tyro.conf.arg(name="")  # Annotated[Section, FLAT]: a section whose fields keep no prefix (--top_k, --work_dir)


def opt(default: Any = dataclasses.MISSING, help_: str = "", *, factory=None) -> Any:
    """A dataclass field with its help text (``factory``: a section's per-job defaults)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help_})
    return dataclasses.field(default=default, metadata={"help": help_})


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:  # typing.get_type_hints is slow (it evaluates every annotation): once per class
    return typing.get_type_hints(cls)


def _strip(tp):
    """``Annotated[X, ...]`` -> ``X``."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _flat_sections(cls) -> list[str]:
    """Names of the top-level fields of ``cls`` that are :data:`FLAT` sections."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return [f.name for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Annotated and dataclasses.is_dataclass(_strip(hints[f.name]))
            and any(getattr(m, "name", None) == "" for m in typing.get_args(hints[f.name])[1:])]


def flat_leaves(cls) -> dict[str, str]:
    """The spelled name -> dotted path of every field in a :data:`FLAT` section (``top_k`` -> ``sampling.top_k``)."""
    flat = tuple(f"{s}." for s in _flat_sections(cls))
    return {path.rpartition(".")[2]: path for path in leaves(cls) if path.startswith(flat)} if flat else {}


def leaves(cls, prefix: str = "") -> dict[str, Any]:
    """Every leaf field of ``cls`` by dotted path (``optim.learning_rate``) -> its type."""
    out = {}
    for name, tp in _hints(cls).items():
        tp = _strip(tp)
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue  # ClassVar
        if dataclasses.is_dataclass(tp):
            out.update(leaves(tp, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return tyro.MISSING  # a required field (tyro asks for it on the command line)


def build(cls, values: dict[str, Any], base=None, prefix: str = ""):
    """``cls`` from dotted-path ``values``; fields not given keep ``base``'s values (else the defaults)."""
    hints, kw = _hints(cls), {}
    for f in dataclasses.fields(cls):
        tp, path = _strip(hints[f.name]), prefix + f.name
        current = getattr(base, f.name) if base is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            kw[f.name] = build(tp, values, current, path + ".")
        else:
            kw[f.name] = values.get(path, current)
    return cls(**kw)


def resolve(cls, values: dict[str, Any], legacy: dict[str, str], where: str) -> tuple[dict[str, Any], list[str]]:
    """Dotted or old flat names -> dotted paths of ``cls``; (values, deprecation notes); unknown: one line.

    An old name is read only as it was spelled: a bare name at the top level (``learning_rate``), a moved
    dotted path (``rollout.temperature``) or its section spelling (``rollout: {workers: 2}``, ``rollout_workers``). A bare name under a section that is not its own (``eval: {steps: 2}``,
    ``optimm: {learning_rate: 1e-4}``) is unknown, refused with the nearest valid name."""
    known, flat, out, notes, unknown = leaves(cls), flat_leaves(cls), {}, [], []
    for key, v in values.items():
        if key in known or key in flat:
            out[flat.get(key, key)] = v
        elif key in legacy or key.replace(".", "_", 1) in legacy:  # `rollout: {workers: 2}` was rollout_workers
            old = key if key in legacy else key.replace(".", "_", 1)
            notes.append(f"{key} -> {next((n for n, p in flat.items() if p == legacy[old]), legacy[old])}")
            out[legacy[old]] = v
        else:
            unknown.append(key)
    if unknown:
        raise RefitError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(hinted(cls, k) or suggest(cls, k) for k in unknown)} (see --help)")
    return out, notes


def suggest(cls, name: str) -> str:
    """``name``, with the nearest valid spelling when there is a close one (``learing_rate`` -> ``did you mean
    optim.learning_rate?``): the same leaf under another section, else the closest name by edit ratio."""
    flat = flat_leaves(cls)
    spelled = {**{p: p for p in leaves(cls) if p not in set(flat.values())}, **flat}
    key = name.replace("-", "_")
    leaf = key.rpartition(".")[2]
    joined = [key.replace(".", "_")] if key.replace(".", "_") in spelled else []  # eval.steps -> eval_steps
    same_leaf = [n for n, p in spelled.items() if p.rpartition(".")[2] == leaf]
    by_leaf = []  # no section given: the closest leaf, the first such field in the config's order on a tie
    if "." not in key:
        ratio = {n: difflib.SequenceMatcher(None, leaf, n.rpartition(".")[2]).ratio() for n in spelled}
        best = max(ratio.values(), default=0.0)
        by_leaf = [next(n for n, r in ratio.items() if r == best)] if best >= 0.8 else []
    near = joined or same_leaf or by_leaf or difflib.get_close_matches(key, list(spelled), n=1, cutoff=0.75) or [
        n for n in spelled if difflib.get_close_matches(leaf, [n.rpartition(".")[2]], n=1, cutoff=0.8)]
    return f"{name} (did you mean {near[0]}?)" if near else name


def hinted(cls, name: str) -> str:
    """``name`` with the field that does it when ``cls.NAME_HINTS`` knows it as another tool's name (TRL's
    ``beta`` -> ``beta (TRL's name; here: kl_coef with ...)``); "" when it does not."""
    hint = getattr(cls, "NAME_HINTS", {}).get(name.replace("-", "_"))
    return f"{name} (TRL's name; here: {hint})" if hint else ""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{rollout: {backend: torch}}`` -> ``{"rollout.backend": "torch"}`` (a mapping is a section)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _coerce(tp, v, where: str):
    """A YAML value -> the field's type (``1e-4`` is a string to YAML 1.1; ints for floats are fine)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if v not in args:
            raise RefitError(f"{where}: {v!r} is not one of {list(args)}")
        return v
    if origin in (typing.Union, UnionType):
        if v is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        for a in members[:-1]:  # the first member that takes the value (Literal["group", ...] | bool)
            try:
                return _coerce(a, v, where)
            except RefitError:
                pass
        return _coerce(members[-1], v, where)
    try:
        if tp is bool:
            return v if isinstance(v, bool) else BOOL_WORDS[str(v).lower()]
        if tp in (int, float, str):
            return tp(v)
        if origin is tuple:
            return tuple(v) if isinstance(v, list) else (v,)
    except (KeyError, TypeError, ValueError):
        raise RefitError(f"{where}: {v!r} is not a {getattr(tp, '__name__', tp)}") from None
    return v


def load_yaml(cls, path: str | Path, legacy: dict[str, str] | None = None):
    """A YAML file (native sections, old flat names with a note) -> (``cls`` instance, deprecation notes)."""
    path = Path(path)
    if not path.is_file():
        raise RefitError(f"config file {path} does not exist")

    try:
        raw = yaml.safe_load(read_text(path, "config file")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise RefitError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise RefitError(f"config file {path}: expected a mapping of fields, got {type(raw).__name__}")
    sections = {k.partition(".")[0] for k in leaves(cls) if "." in k} - {s for s in _flat_sections(cls)}
    for k, v in raw.items():
        if k in sections and not isinstance(v, dict):
            raise RefitError(f"config file {path}: {k} is a section: give it as a mapping of its fields "
                             f"({k}: {{field: value}}), not {v!r}")
    values, notes = resolve(cls, _flatten(raw), legacy or {}, f"config file {path}")
    types = leaves(cls)
    values = {k: _coerce(types[k], v, f"config file {path}: {k}") for k, v in values.items()}
    return build(cls, values), notes


def save_yaml(cfg, path: Path) -> str:
    """The resolved config in its sectioned layout (loads back through ``--config`` to an equal config)."""
    flat = set(_flat_sections(type(cfg)))
    layout = {}
    for k, v in dataclasses.asdict(cfg).items():  # a FLAT section's fields in its place, unprefixed
        layout.update(v if k in flat else {k: v})
    text = yaml.safe_dump(layout, sort_keys=False)
    path.write_text(text)
    return text


def check(checks: list[tuple[bool, str]]) -> None:
    """Raise the first failing ``(bad, message)`` of a config's ``__post_init__`` as one ``config:`` line."""
    for bad, msg in checks:
        if bad:
            raise RefitError(f"config: {msg}")


def with_values(cfg, legacy: dict[str, str] | None = None, **values):
    """A copy of ``cfg`` with fields set by dotted path (``**{"scale.workers": 2}``) or old flat name."""
    values, _ = resolve(type(cfg), values, legacy or {}, type(cfg).__name__)
    return build(type(cfg), values, base=cfg)


def _negate(path: str) -> str:
    section, _, leaf = path.rpartition(".")
    return f"{section}.no_{leaf}" if section else f"no_{leaf}"


def normalise_argv(argv: list[str], cls, legacy: dict[str, str], bools: set[str]) -> tuple[list[str], list[str]]:
    """Old flat flags -> dotted ones (with notes); ``--flag true|false`` -> ``--flag`` / ``--no_flag``."""
    known = set(leaves(cls)) | set(flat_leaves(cls)) | bools
    spelled = {path: name for name, path in flat_leaves(cls).items()}  # a FLAT field's flag has no prefix
    types = leaves(cls)
    bool_or = {p for p, tp in types.items() if typing.get_origin(tp) in (typing.Union, UnionType)
               and bool in typing.get_args(tp)}
    argv, out, notes, i = list(argv), [], [], 0
    while i < len(argv):
        tok, i = argv[i], i + 1
        if not tok.startswith("--") or tok == "--":
            out.append(tok)
            continue
        name, eq, val = tok[2:].partition("=")
        key = name.replace("-", "_")
        neg = key.startswith("no_") and key not in known and key[3:] in legacy
        if key not in known and (key in legacy or neg):
            new = legacy[key[3:]] if neg else legacy[key]
            new = spelled.get(new, new)
            notes.append(f"--{name} -> --{_negate(new) if neg else new}")
            key = name = _negate(new) if neg else new
        if key in bool_or and not eq and i < len(argv) and argv[i].lower() in ("true", "false"):
            argv[i] = argv[i].capitalize()  # a str-or-bool field (scale_rewards): tyro spells True, False
        if key in bools:
            if not eq and i < len(argv) and argv[i].lower() in BOOL_WORDS:
                val, eq, i = argv[i], "=", i + 1
            if eq:
                if val.lower() not in BOOL_WORDS:
                    raise RefitError(f"--{name}: expected true or false, got {val!r}")
                name, eq = (key if BOOL_WORDS[val.lower()] else _negate(key)), ""
        out.append(f"--{name}" + (f"={val}" if eq else ""))
    return out, notes


def _config_path(argv: list[str]) -> str:
    """The value of ``--config`` (read first: the YAML becomes the defaults of the one parse)."""
    for i, tok in enumerate(argv):
        if tok == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--config="):
            return tok.split("=", 1)[1]
    return ""


CONFIG_OPTION = ("config", str, opt("", "YAML file with any of the fields below, a section as a mapping "
                                        "('section: {field: value}'); flags override it"))


def parse(cls, argv: list[str] | None, prog: str, options: tuple = (), legacy: dict[str, str] | None = None):
    """``[--config FILE.yaml] [flags]`` -> (frozen ``cls``, namespace of ``options``).

    ``options``: ``(name, type, field)`` triples for run options that are not part of the saved config
    (``--resume``, ``--build_models``); ``--config`` is always one of them.
    """
    legacy = legacy or {}
    opts = (CONFIG_OPTION, *options)
    args = dataclasses.make_dataclass(
        "Args", [("cfg", Annotated[cls, FLAT], dataclasses.field()), *opts], frozen=True)
    types = leaves(cls)
    bools = ({p for p, tp in types.items() if tp is bool} | {n for n, tp, _ in opts if tp is bool}
             | {n for n, p in flat_leaves(cls).items() if types[p] is bool})
    argv, notes = normalise_argv(list(sys.argv[1:] if argv is None else argv), cls, legacy, bools)
    default, path = None, _config_path(argv)
    if path:
        cfg, yaml_notes = load_yaml(cls, path, legacy)
        notes = [f"{n} (in {path})" for n in yaml_notes] + notes
        default = args(cfg=cfg, **{n: _default(f) for n, _, f in opts})
    if notes:
        print(f"{prog}: deprecated names, removed in the next release: {'; '.join(notes)}", file=sys.stderr)
    parsed, rest = tyro.cli(args, args=argv, prog=prog, description=inspect.cleandoc(cls.__doc__ or ""), default=default,
                            use_underscores=True, return_unknown_args=True)
    if rest:
        words = [f"--{hinted(cls, t[2:]) or suggest(cls, t[2:])}" if t.startswith("--") and "=" not in t else t
                 for t in rest]
        raise RefitError(f"unknown arguments: {' '.join(words)} (see {prog} --help)")

    validate(parsed.cfg)  # the value ranges, every command alike (refit.core.validate.RULES)
    return parsed.cfg, SimpleNamespace(**{n: getattr(parsed, n) for n, _, _ in opts})
