"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard events, PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.integrity import fault_due


def parse_rows(path: Path, log=None) -> list[dict]:
    """The rows of a metrics.jsonl; a torn last line (a run killed mid-write) is dropped, with one line to
    ``log`` when given; a damaged line before the last is one RefitError line naming it."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        try:
            row = json.loads(ln)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a metrics row")
        except ValueError:
            if i == len(lines) - 1:
                if log is not None:
                    log(f"refit: dropped the torn last line of {path} (line {i + 1}, {len(ln)} characters: a run "
                        "killed mid-write)")
                break
            raise RefitError(f"{path} line {i + 1} is damaged (not a JSON metrics row); fix or delete that line")
        rows.append(row)
    return rows


class MetricsLog:
    """Append-only JSONL (flushed per line) plus optional TensorBoard scalars."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None, log=print):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # keep the history up to the checkpoint, drop steps the resumed run will redo (and a torn last line)
            kept = [json.dumps(r) for r in parse_rows(self.path, log) if r["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:  # tensorboard is a dependency, but a stripped install still trains
                self.tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        line = json.dumps(row) + "\n"
        with open(self.path, "a") as f:
            if fault_due("metrics.torn"):  # tests: a kill -9 in the middle of a line
                f.write(line[: len(line) // 2])
                f.flush()
                os._exit(137)
            f.write(line)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    return parse_rows(p) if p.exists() else []


def plot_metrics(run_dir: Path, panels: dict[str, list[str]]) -> Path | None:
    """One PNG with a panel per entry of ``panels`` ({title: [metric keys]}); returns its path."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # a dependency, but a stripped install still trains: metrics.jsonl holds the curves
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (title, keys) in zip(axes, panels.items()):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            if pts:
                ax.plot(*zip(*pts), label=k.split("/")[-1], marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
