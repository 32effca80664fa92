"""docs/what-is-where.md, the module map, is the code's own: every module listed with its docstring's first sentence.

The map is written by ``scripts/what_is_where.py``; a module added, removed or re-described without rerunning it fails
here, naming the module and the command that fixes it.
"""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHAT_IS_WHERE = runpy.run_path(str(ROOT / "scripts" / "what_is_where.py"))


def test_every_module_has_a_docstring():
    bare = [p.as_posix() for p in WHAT_IS_WHERE["sources"]() if not WHAT_IS_WHERE["summary"](p)]
    assert not bare, f"modules without a docstring (the map's line comes from it): {bare}"


def test_the_map_lists_every_module_as_the_code_describes_it():
    page = WHAT_IS_WHERE["PAGE"].read_text()
    problems = WHAT_IS_WHERE["stale"](page)
    assert not problems, "docs/what-is-where.md is stale (python scripts/what_is_where.py):\n" + "\n".join(problems)
    assert WHAT_IS_WHERE["render"](page) == page, "docs/what-is-where.md's layout differs: python scripts/what_is_where.py"


def test_a_missing_module_is_named():
    page = WHAT_IS_WHERE["PAGE"].read_text()
    cut = "\n".join(ln for ln in page.splitlines() if not ln.startswith("| `refit/learner/run/sync.py`"))
    assert "missing from the map: refit/learner/run/sync.py" in WHAT_IS_WHERE["stale"](cut)
