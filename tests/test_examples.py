"""The README's Python example runs as written (examples/python_api.py): build, export, generate, 3 PPO steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_api_example_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = next(ln for ln in r.stdout.splitlines() if ln.startswith("steps:"))
    assert steps.startswith("steps: [1, 2, 3]")
    kl0 = float(steps.rsplit(":", 1)[1])
    assert abs(kl0) <= 1e-6  # policy == reference at the first step
    parity = float(next(ln for ln in r.stdout.splitlines() if ln.startswith("parity:")).split()[1])
    assert parity < 1e-4
