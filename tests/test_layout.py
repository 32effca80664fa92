"""The package's shape, checked: one installed namespace, rooms on floors, no import circle.

Floors, bottom to top: ``refit.core`` (errors, the manifest record, the padding rule, the parser, checkpoint
loading) <- ``refit.export`` (HF -> graphs + manifest) <- ``refit.rollout`` (engines and the one decode loop)
<- ``refit.learner`` (losses, jobs) <- ``refit.bench``. An import may only point down or sideways within its
room; ``refit/__init__.py`` (the public face) may name anything. Imports inside functions count: a lazy import
is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"core": 0, "export": 1, "rollout": 2, "learner": 3, "bench": 4}


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module in the rooms, as installed (refit.<room>.<...>)."""
    out = {}
    for room in FLOORS:
        for f in (ROOT / room).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["refit", *parts])] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports (anywhere in the file; ``from pkg import mod`` resolved)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, set(mods)) for m, f in mods.items()}


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[1]]


def _is_package(module: str, graph) -> bool:
    return any(other.startswith(module + ".") for other in graph)


def test_no_import_points_up_a_floor():
    up = sorted(f"{a} -> {b}" for a, deps in _graph().items() for b in deps if _floor(b) > _floor(a))
    assert not up, f"{len(up)} import(s) run back up the floors: {up}"


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ importing its own submodules is not a circle
    edges = {a: {b for b in deps if not (_is_package(a, graph) and b.startswith(a + "."))} for a, deps in graph.items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"{len(circles)} import circle(s): {circles}"


def test_one_decode_loop():
    """Tokens are chosen in one file: every caller (generate on each backend, the export parity gate, the
    benchmarks) drives rollout/decode.py, whose static loop and in-flight scheduler are the only code that
    picks a next token (``sample_step``) and feeds it back."""
    callers = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "refit.rollout.sampling":
                if {a.name for a in node.names} & {"sample", "sample_step"}:
                    callers.add(module)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "sample_step":
                callers.add(module)
    assert callers == {"refit.rollout.decode"}, callers
    parity = (ROOT / "rollout" / "parity.py").read_text()
    assert "decode_loop(" in parity, "the parity gate must drive the engines' decode loop"


# the records that cross a stage boundary (rollout -> learner -> update, the distill batch, the jobs' state)
RECORDS = {"RolloutBatch", "ScoreResult", "SamplingParams", "DistillBatch", "EvalSet", "Experience", "Scored",
           "ForwardOut", "UpdateSettings", "PromptSet", "RunResult", "Run", "NamedReward", "TrainerState"}


def test_records_are_built_with_keywords():
    """A record with many fields built positionally breaks silently when a field is added or reordered: every
    construction of a stage-boundary record in the rooms passes at most one argument by position."""
    defined, bad = set(), []
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} & RECORDS
        for n in ast.walk(tree):
            f = n.func if isinstance(n, ast.Call) else None
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in RECORDS and len(n.args) > 1:
                bad.append(f"{path.relative_to(ROOT)}:{n.lineno} {name}({len(n.args)} positional)")
    assert defined == RECORDS, f"records renamed or gone: {sorted(RECORDS - defined)}"
    assert not bad, bad
