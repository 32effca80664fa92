"""Compare PPO runs (e.g. the three ``refit demo`` runs: fp32, int8 + TIS, int8 without correction): one PNG with
reward, exact KL and engine/learner mismatch per step for every run, and one JSON line with each run's reward
over its first and last 5 steps and its exact KL.

    python scripts/compare_runs.py --out docs/int8-demo.png fp32=runs/a/ppo int8+tis=runs/b/ppo int8-none=runs/c/ppo

``--seeds``: runs labelled ``NAME-sK`` are drawn as one line per NAME, the mean over its seeds with their range shaded
(the JSON line still has every run, and each NAME's mean last-5 reward).
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
    p.add_argument("--seeds", action="store_true", help="one line per NAME of runs labelled NAME-sK: the seeds' mean, "
                                                         "their range shaded")
    a = p.parse_args(argv)
    runs = {lab: read_metrics(Path(d)) for lab, d in (r.split("=", 1) for r in a.runs)}
    groups = by_name(runs) if a.seeds else {lab: [lab] for lab in runs}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (key, title) in zip(axes, PANELS.items()):
        for lab, members in groups.items():
            curves = [dict((r["step"], r[key]) for r in runs[m] if key in r and "reward/mean" in r) for m in members]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            vals = [[c[t] for c in curves] for t in steps]
            line, = ax.plot(steps, [sum(v) / len(v) for v in vals], label=lab, lw=1.2)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(),
                                alpha=0.15, lw=0)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes[0].legend()
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    summary = {lab: summarise(rows) for lab, rows in runs.items()}
    out = {"plot": a.out, "runs": summary}
    if a.seeds:
        out["last5_mean"] = {lab: round(sum(summary[m]["reward_last5"] for m in members) / len(members), 4)
                             for lab, members in groups.items()}
    print(json.dumps(out))
    return 0


def by_name(runs: dict[str, list[dict]]) -> dict[str, list[str]]:
    """{NAME: [its seeds' labels]} of runs labelled NAME-sK (a label without a seed is a NAME of its own)."""
    out: dict[str, list[str]] = {}
    for lab in runs:
        name, _, seed = lab.rpartition("-s")
        out.setdefault(name if name and seed.isdigit() else lab, []).append(lab)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
