"""List the modules over 450 lines and the functions over 80 lines (the project's size rule, docs/design.md), benchmarks and scripts included.

    python scripts/sizes.py            # refit/ (every room), scripts/ and examples/; one line each, then one JSON line
    python scripts/sizes.py --tests    # tests/ too

A function's lines run from its ``def`` (decorators not counted) to its last line, docstring included; a module's
are its newlines. ``tests/test_layout.py`` runs :func:`over_limits` and fails on anything new over them.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("refit", "scripts", "examples")  # refit/ holds the rooms (refit/core, refit/export, ...)
MODULE_LINES, FUNCTION_LINES = 450, 80


def over_limits(rooms: tuple[str, ...] = ROOMS) -> dict[str, int]:
    """{``path`` or ``path:function``: its lines} for every module over :data:`MODULE_LINES` lines and every function
    (methods and nested functions included, by their qualified name) over :data:`FUNCTION_LINES`."""
    out = {}
    for room in rooms:
        for f in sorted((ROOT / room).rglob("*.py")):
            rel, src = f.relative_to(ROOT).as_posix(), f.read_text()
            if src.count("\n") > MODULE_LINES:
                out[rel] = src.count("\n")
            for name, node in _functions(ast.parse(src)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    out[f"{rel}:{name}"] = n
    return out


def _functions(tree, prefix: str = ""):
    """(qualified name, node) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, f"{name}.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", action="store_true", help="include tests/")
    a = p.parse_args(argv)
    found = over_limits(ROOMS + (("tests",) if a.tests else ()))
    for where, n in sorted(found.items(), key=lambda kv: -kv[1]):
        print(f"{where}: {n} lines (limit {FUNCTION_LINES if ':' in where else MODULE_LINES})")
    print(json.dumps({"over_limits": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
