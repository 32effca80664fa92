"""The package's shape, checked: one installed namespace, rooms on floors, no import circle.

Floors, bottom to top: ``refit.core`` (errors, the manifest record, the padding rule, the parser, HF folder
loading) <- ``refit.export`` (HF -> graphs + manifest) <- ``refit.rollout`` (engines and the one decode loop)
<- ``refit.learner`` (losses, jobs) <- ``refit.bench`` <- the face ``refit`` (``refit/__init__.py``, the public
names, and ``refit/cli.py``, the front door's command table). An import may only point down or sideways within
its room; the face may name every floor. Imports inside functions count: a lazy import is still an arrow, and no
module outside the face and the optional backends' registry names a module in an ``importlib`` string, which no
reader or test could follow.
"""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"core": 0, "export": 1, "rollout": 2, "learner": 3, "bench": 4, "refit": 5}

# Floors inside the learner, bottom to top: the pure losses and the builtin tasks and model builders; what the jobs
# share (run/: config sections, checkpoints, the sync room); the two jobs (ppo/, distill/: side by side, neither
# imports the other); what drives a job (the api, the demo, build-model); the TRL facade over all of it.
LEARNER_FLOORS = {"losses": 0, "builtin": 0, "run": 1, "ppo": 2, "distill": 2, "api": 3, "demo": 3,
                  "build_model": 3, "trl": 4}

# Where importlib may take a module name from a string: the face's lazy names, the engine backends' lazy
# registry (tensorrt is imported only when asked for), user reward functions named on the command line,
# and a benchmark that loads one file by path into another package's venv.
IMPORTLIB_ALLOWED = {"refit", "refit.rollout.engine", "refit.learner.ppo.rewards", "refit.bench.trl_grpo_side"}


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module in the package: refit/ is ``refit``, so a file's path is its name
    (refit/cli.py is refit.cli, refit/learner/ppo/cycle.py refit.learner.ppo.cycle), as in the wheel."""
    out = {}
    for f in (ROOT / "refit").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
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
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 and parts[1] in FLOORS else FLOORS["refit"]


def _is_package(module: str, graph) -> bool:
    return any(other.startswith(module + ".") for other in graph)


def test_no_import_points_up_a_floor():
    graph = _graph()
    commands = {"refit.learner.build_model", "refit.rollout.build", "refit.rollout.cli", "refit.bench.cli",
                "refit.learner.ppo.cli", "refit.learner.distill.cli", "refit.learner.demo"}
    assert commands <= graph["refit.cli"], \
        "the front door's table must reach each command by a plain import"
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if _floor(b) > _floor(a))
    assert not up, f"{len(up)} import(s) run back up the floors: {up}"


def _learner_part(module: str) -> str | None:
    """The learner folder (or top-level module) ``module`` belongs to: refit.learner.ppo.update -> "ppo"."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "learner" else None


def learner_floor_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Arrows between the learner's folders that point up :data:`LEARNER_FLOORS` or sideways between two
    different folders on one floor (either makes a folder loop possible), and folders the table does not know."""
    out = []
    for a, deps in graph.items():
        pa = _learner_part(a)
        for b in deps:
            pb = _learner_part(b)
            if pa is None or pb is None or pa == pb:
                continue
            if pa not in LEARNER_FLOORS or pb not in LEARNER_FLOORS:
                out.append(f"{a} -> {b} (a learner part LEARNER_FLOORS does not place)")
            elif LEARNER_FLOORS[pb] >= LEARNER_FLOORS[pa]:
                out.append(f"{a} -> {b} ({pa} on floor {LEARNER_FLOORS[pa]}, {pb} on {LEARNER_FLOORS[pb]})")
    return sorted(out)


def test_the_learner_folders_sit_on_floors():
    """Inside refit/learner/: the builtin tasks and models below the jobs, the demo above them, no folder loop."""
    breaks = learner_floor_breaks(_graph())
    assert not breaks, f"{len(breaks)} arrow(s) against the learner's floors: {breaks}"


def test_the_learner_floor_check_catches_a_folder_loop():
    """The check on a planted loop, as it stood before the demo left builtin/: a builtin module naming a job while
    the job imports the builtin tasks, and two jobs importing each other."""
    planted = {"refit.learner.builtin.demo": {"refit.learner.ppo.cycle"},
               "refit.learner.ppo.data": {"refit.learner.builtin.tasks"},
               "refit.learner.distill.batch": {"refit.learner.ppo.rewards"},
               "refit.learner.ppo.rewards": {"refit.learner.builtin.tasks"}}
    assert learner_floor_breaks(planted) == [
        "refit.learner.builtin.demo -> refit.learner.ppo.cycle (builtin on floor 0, ppo on 2)",
        "refit.learner.distill.batch -> refit.learner.ppo.rewards (distill on floor 2, ppo on 2)"]


# internal imports inside functions (issue 33): the ratchet, lowered as they move to the modules' headers. Left: the
# stages of refit/bench/lora.py (each runs in a child whose peak RSS is measured: it loads only what it needs)
INSIDE_FUNCTIONS_AT_MOST = 13


def test_the_learner_imports_nothing_from_export():
    """The learner talks to engines through the rollout protocol and shares the engine/learner contract through
    refit.core (refit/core/contract.py; the int8 arithmetic an int8 engine's probe compares with,
    refit/core/int8.py)."""
    graph = _graph()
    arrows = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("refit.learner.")
                    for b in deps if b.startswith("refit.export"))
    assert not arrows, f"the learner reaches into export/: {arrows}"


def test_imports_inside_functions_are_counted():
    """A module's header shows what it depends on: internal imports inside functions are reported (the face's lazy
    names and the front door's commands are lazy by design) and may only shrink."""
    inside, total = [], 0
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("refit") or (
                    isinstance(node, ast.Import) and any(a.name.startswith("refit") for a in node.names)):
                total += 1
                if id(node) not in top and not module.startswith("refit.cli") and module != "refit":
                    inside.append(f"{module}:{node.lineno}")
    print(f"{len(inside)} of {total} internal imports inside functions")
    assert len(inside) <= INSIDE_FUNCTIONS_AT_MOST, f"{len(inside)} internal imports inside functions: {inside[:20]}"


def test_no_importlib_strings_outside_the_face_and_the_backends():
    """A command, a backend or a helper reached by ``importlib.import_module("refit....")`` is an arrow no test
    sees: the front door (refit/cli.py) dispatches by plain imports."""
    users = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(n == "importlib" or n.startswith("importlib.") and n != "importlib.metadata" for n in names):
                    users.add(module)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
                users.add(module)
    assert users <= IMPORTLIB_ALLOWED, f"importlib outside the face and the backends: {sorted(users - IMPORTLIB_ALLOWED)}"


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
    benchmarks) drives refit/rollout/decode.py, whose static loop and in-flight scheduler are the only code that
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
    parity = (ROOT / "refit" / "rollout" / "parity.py").read_text()
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


# over the size rule (docs/design.md: modules 450 lines, functions 80) while being reworked; none today
OVER_LIMITS_KNOWN: set[str] = set()


def test_modules_and_functions_stay_under_the_size_limits():
    """Every module under 450 lines and every function under 80, benchmarks and scripts included
    (``python scripts/sizes.py`` lists them)."""
    found = runpy.run_path(str(ROOT / "scripts" / "sizes.py"))["over_limits"]()
    print(f"over the size limits: {found or 'nothing'}")
    new = sorted(set(found) - OVER_LIMITS_KNOWN)
    assert not new, f"over the size limits (python scripts/sizes.py): {[f'{w}: {found[w]} lines' for w in new]}"
