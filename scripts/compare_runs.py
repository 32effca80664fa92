"""Compare PPO runs (e.g. the three ``refit demo`` runs: fp32, int8 + TIS, int8 without correction): one PNG with
reward, exact KL and engine/learner mismatch per step for every run, and one JSON line with each run's reward
over its first and last 5 steps and its exact KL.

    python scripts/compare_runs.py --out docs/int8-demo.png fp32=runs/a/ppo int8+tis=runs/b/ppo int8-none=runs/c/ppo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = {"reward/mean": "reward (exact match)", "kl/exact": "exact KL(policy || reference)",
          "mismatch/mean_abs_diff": "mean |engine - learner| log-prob"}


def summarise(rows: list[dict]) -> dict:
    train = [r for r in rows if "reward/mean" in r]
    rew = [r["reward/mean"] for r in train]
    kl = [r["kl/exact"] for r in train]
    return {"steps": len(train), "reward_first5": round(sum(rew[:5]) / 5, 4),
            "reward_last5": round(sum(rew[-5:]) / 5, 4),
            "kl_exact_first": kl[0], "kl_exact_last": kl[-1], "kl_exact_min": min(kl),
            "mismatch_mean_abs_diff_mean": sum(r["mismatch/mean_abs_diff"] for r in train) / len(train),
            "tis_grad_scale_mean": (sum(r["mismatch/tis_grad_scale"] for r in train) / len(train)
                                    if "mismatch/tis_grad_scale" in train[0] else None)}


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from refit.learner.run.metrics import read_metrics

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="label=run_folder (with metrics.jsonl)")
    p.add_argument("--out", required=True, help="PNG to write")
    a = p.parse_args(argv)
    runs = {lab: read_metrics(Path(d)) for lab, d in (r.split("=", 1) for r in a.runs)}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (key, title) in zip(axes, PANELS.items()):
        for lab, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r and "reward/mean" in r]
            ax.plot(*zip(*pts), label=lab, lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes[0].legend()
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(json.dumps({"plot": a.out, "runs": {lab: summarise(rows) for lab, rows in runs.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
