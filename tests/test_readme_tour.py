"""The README's five-minute tour, as written: every command of its ``bash`` blocks is read from README.md.

The fast test parses each command's flags with the command's own parser (and with the flags REFIT_TOUR_SHORT adds);
the slow one runs the whole tour top to bottom in a fresh folder with ``REFIT_TOUR_SHORT=1`` (a few steps each),
as the README tells a newcomer to, and checks every exit code. ``python tests/test_readme_tour.py DIR`` runs it
the same way and prints each command with its exit code.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refit.cli import TOUR_SHORT
from refit.core.parsing import parse
from refit.learner.build_model import parser as build_model_parser
from refit.learner.demo import DemoConfig
from refit.learner.distill.config import BUILD_MODELS, DistillConfig
from refit.learner.ppo.config import PPOConfig
from refit.learner.run.config import parse_job
from refit.rollout.config import ExportConfig, GenerateConfig

ROOT = Path(__file__).resolve().parents[1]


def tour_commands(readme: Path = ROOT / "README.md") -> list[list[str]]:
    """The tour section's shell commands, in order, split as a shell would (comments dropped)."""
    text = readme.read_text()
    section = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        out += [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    return [c for c in out if c]


def _parse(argv: list[str]) -> None:
    """One tour line through the parser its command uses (no model is built, no run started)."""
    name, rest = argv[1], argv[2:]
    if name == "build-model":
        build_model_parser().parse_args(rest)
    elif name in ("ppo", "distill"):
        cls, opts = (PPOConfig, ()) if name == "ppo" else (DistillConfig, (BUILD_MODELS,))
        parse_job(cls, rest, f"refit {name}", options=opts)
    else:
        parse({"export": ExportConfig, "generate": GenerateConfig, "demo": DemoConfig}[name], rest, f"refit {name}")


def test_the_tour_is_read_and_every_line_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tour runs from the repository's folder (examples/ppo.yaml, examples/trl_chat/)
    commands = tour_commands()
    refit = [c for c in commands if c[0] == "refit"]
    assert len(refit) >= 12 and {c[1] for c in refit} >= {"build-model", "export", "generate", "ppo", "distill",
                                                          "demo"}, commands
    for argv in refit:
        _parse(argv)
        _parse(argv + TOUR_SHORT.get(argv[1], []))  # the short tour's flags are real flags of the command
    configs = [c[c.index("--config") + 1] for c in refit if "--config" in c]
    assert "examples/ppo.yaml" in configs and all((ROOT / f).is_file() for f in configs), configs
    scripts = [c for c in commands if c[0] == "python"]
    assert scripts and all((ROOT / c[1]).is_file() for c in scripts), scripts
    assert {c[0] for c in commands} == {"refit", "python"}, commands  # a new kind of line needs a runner below


def test_the_tours_folders_are_ignored():
    ignored = (ROOT / ".gitignore").read_text().split()
    outs = {Path(c[c.index("-o") + 1]).parts[0] for c in tour_commands() if "-o" in c}
    assert outs <= {"models", "engines", "runs"} and {"/models/", "/engines/", "runs/"} <= set(ignored), outs


def run_tour(folder: Path, log=print) -> list[tuple[str, int, float]]:
    """Run the tour as written in ``folder`` (examples/ linked in), short; (command, exit code, seconds) each."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "examples").exists():
        (folder / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "REFIT_TOUR_SHORT": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    results = []
    for argv in tour_commands():
        run = [sys.executable, "-m", "refit", *argv[1:]] if argv[0] == "refit" else [sys.executable, *argv[1:]]
        t0 = time.perf_counter()
        r = subprocess.run(run, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        results.append((shlex.join(argv), r.returncode, time.perf_counter() - t0))
        log(f"[exit {r.returncode}, {results[-1][2]:.0f} s] {shlex.join(argv)}")
        if r.returncode:
            log(r.stdout[-1500:] + r.stderr[-1500:])
    return results


@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path):
    results = run_tour(tmp_path)
    assert [c for c, rc, _ in results if rc] == [], results


if __name__ == "__main__":
    sys.exit(int(any(rc for _, rc, _ in run_tour(Path(sys.argv[1]).resolve()))))
