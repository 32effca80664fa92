"""Write docs/what-is-where.md's module map from the code: every module's docstring summary, room by room.

    python scripts/what_is_where.py            # rewrite the map between the page's markers
    python scripts/what_is_where.py --check    # exit 1, naming what differs, when the page is stale

A module's line is the first paragraph of its docstring up to the end of its first sentence; a shell driver's is its
first comment line. ``tests/test_what_is_where.py`` runs the check, so the map cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "what-is-where.md"
MARKS = ("<!-- what-is-where:start -->", "<!-- what-is-where:end -->")
# the rooms, bottom floor first: the package's subpackages, then the face (refit/'s own modules), scripts, examples
ROOMS = ("refit/core", "refit/export", "refit/rollout", "refit/learner", "refit/bench", "refit", "scripts", "examples")


def room(path: Path) -> str:
    """The room ``path`` (relative to the repository root) sits in: the first of :data:`ROOMS` that holds it."""
    return next(r for r in ROOMS if path.parts[: len(Path(r).parts)] == Path(r).parts)


def sources() -> list[Path]:
    """Every module and shell driver the map lists, relative to the repository root, room by room: the files git
    tracks (a new module counts once it is added, so the map matches what a commit holds), every file outside git."""
    tracked = subprocess.run(["git", "ls-files", "--", *ROOMS], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:
        files = [ROOT / f for f in tracked.stdout.splitlines()]
    else:
        files = {f for r in ROOMS for f in (ROOT / r).rglob("*") if "__pycache__" not in f.parts}
    rel = [f.relative_to(ROOT) for f in files if f.suffix in (".py", ".sh") and f.is_file()]
    return sorted(rel, key=lambda p: (ROOMS.index(room(p)), p.parts))


def summary(path: Path) -> str:
    """The module's one line: its docstring's first sentence (a shell script's first comment line); '' if none."""
    text = (ROOT / path).read_text()
    if path.suffix == ".sh":
        comments = [ln[1:].strip() for ln in text.splitlines()[1:] if ln.startswith("#")]
        return comments[0] if comments else ""
    doc = ast.get_docstring(ast.parse(text)) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)\.(\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def table() -> str:
    """The map: one row per module, grouped by room; a module without a docstring is listed with a gap to fill."""
    lines, current = [], None
    for path in sources():
        if room(path) != current:
            current = room(path)
            lines += ["", f"### `{current}/`", "", "| module | what it is |", "|---|---|"]
        lines.append(f"| `{path.as_posix()}` | {summary(path).replace('|', '&#124;') or '(no docstring)'} |")
    return "\n".join(lines[1:])


def render(page: str) -> str:
    """``page`` with the map between its markers replaced by the one the code gives now."""
    start, end = MARKS
    if start not in page or end not in page:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {start} ... {end} markers")
    head, rest = page.split(start, 1)
    return f"{head}{start}\n{table()}\n{end}{rest.split(end, 1)[1]}"


def stale(page: str) -> list[str]:
    """What the page gets wrong: modules missing from its map, modules it lists that are gone, changed lines."""
    listed = dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", page, flags=re.M))
    now = {p.as_posix(): summary(p).replace("|", "&#124;") or "(no docstring)" for p in sources()}
    out = [f"missing from the map: {m}" for m in sorted(now.keys() - listed.keys())]
    out += [f"listed but gone: {m}" for m in sorted(listed.keys() - now.keys())]
    out += [f"stale line for {m}: the code says {now[m]!r}" for m in sorted(now.keys() & listed.keys())
            if listed[m] != now[m]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="report what is stale and exit 1 instead of writing")
    a = p.parse_args(argv)
    page = PAGE.read_text()
    if a.check:
        problems = stale(page) or (["the map's layout differs from the generator's"] if render(page) != page else [])
        for line in problems:
            print(f"{PAGE.relative_to(ROOT)}: {line}; run python scripts/what_is_where.py")
        return 1 if problems else 0
    PAGE.write_text(render(page))
    print(f"{PAGE.relative_to(ROOT)}: {len(sources())} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
