"""The TRL facade's fields in use: a config's given values checked against the tables, the counts by kind, and
docs/trl-facade.md's generated table.

The tables themselves (every TRL / ``transformers.TrainingArguments`` name, honoured, accepted or refused) are
:mod:`refit.learner.trl.field_tables`'s. A name in none of the tables is refused as unknown. ``python -m
refit.learner.trl.fields --write docs/trl-facade.md`` rewrites the generated part of the page
(tests/test_trl_compat.py checks it is current).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from refit.core.errors import RefitError
from refit.learner.trl.field_tables import CONFIG_FIELDS, KINDS, NOT_IN_TRL_116, REFUSED, TrlField


def check_values(owner: str, table: dict[str, TrlField], given: dict[str, Any], hints: dict[str, str]) -> None:
    """One line for the first unknown name or refused value in ``given`` (``hints``: Refit's nearest name)."""
    for k, v in given.items():
        f = table.get(k)
        if f is None:
            raise RefitError(f"{owner}: {k!r} is not supported" + (f" (Refit's nearest: {hints[k]})" if k in hints
                                                                   else "")
                             + f"; the names {owner} takes: docs/trl-facade.md")
        if f.kind == REFUSED and not _same(v, f.default):
            raise RefitError(f"{owner}: {k}={v!r}: {f.note}")


def _same(value, default) -> bool:
    empty = (None, "", [], {}, ())
    return value == default or (value in empty and default in empty)


def counts(name: str) -> dict[str, int]:
    """How many of TRL 1.16's fields of config ``name`` are of each kind (the names in NOT_IN_TRL_116 left out)."""
    table = CONFIG_FIELDS[name]
    return {k: sum(f.kind == k for n, f in table.items() if n not in NOT_IN_TRL_116[name]) for k in KINDS}


BEGIN, END = "<!-- generated: refit.learner.trl.fields (do not edit by hand) -->", "<!-- end generated -->"


def field_table() -> str:
    """The markdown of every config's fields by kind (docs/trl-facade.md holds it between BEGIN and END)."""
    out = ["| config | TRL 1.16 fields | honoured | accepted | refused | also known, not TRL 1.16's |",
           "|---|---|---|---|---|---|"]
    for name in CONFIG_FIELDS:
        c = counts(name)
        out.append(f"| `{name}` | {sum(c.values())} | " + " | ".join(str(n) for n in c.values())
                   + f" | {', '.join(f'`{k}`' for k in sorted(NOT_IN_TRL_116[name]))} |")
    for name, table in CONFIG_FIELDS.items():
        out += ["", f"### {name}", "", "| field | kind | TRL default | in Refit |", "|---|---|---|---|"]
        for kind in KINDS:
            for k, f in sorted((k, f) for k, f in table.items() if f.kind == kind):
                extra = " (not TRL 1.16's)" if k in NOT_IN_TRL_116[name] else ""
                out.append(f"| `{k}` | {kind}{extra} | `{f.default!r}` | {f.note.replace('|', '/')} |")
    return "\n".join(out)


def write_doc(path: Path) -> None:
    """Replace the generated part of ``path`` (between BEGIN and END) with :func:`field_table`."""
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{field_table()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_doc(Path(sys.argv[2]))
    else:
        print(field_table())
