"""The report of ``refit bench grpo``: each side's steps in one row shape (Refit's metrics.jsonl, the TRL side's JSON),
one side's rounds summarised (medians over the steady steps, peaks, curves), and the reward gap between the sides.

A row: ``{"step", "step_s", "generation_s", "phases": {phase: seconds}, "reward", "completion_length"}``; Refit's
phases are its own ``time/rollout``, ``time/score``, ``time/update``, ``time/weight_push``, TRL's ``generate``,
``score`` and ``update`` (refit/bench/grpo.py's docstring says what each covers).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def refit_rows(out: Path) -> list[dict]:
    """Refit's steps from metrics.jsonl, in the bench's common row shape."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "time/step" not in m:
            continue
        phases = {k.split("/")[1]: m[k] for k in ("time/rollout", "time/score", "time/update", "time/weight_push")}
        rows.append({"step": m["step"], "step_s": m["time/step"], "generation_s": m["time/rollout"],
                     "phases": phases, "reward": m["reward/mean"], "completion_length": m["response/length"]})
    return rows


def trl_rows(side: dict) -> list[dict]:
    """TRL's steps from the side script's JSON, in the bench's common row shape."""
    rows = []
    for r in side["rows"]:
        gen, gas = r.get("generate_s", 0.0), r.get("generate_and_score_s", 0.0)
        rows.append({"step": r["step"], "step_s": r["step_s"], "generation_s": gen,
                     "phases": {"generate": gen, "score": gas - gen, "update": r["step_s"] - gas},
                     "reward": r["reward"], "completion_length": r["completion_length"]})
    return rows


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(runs: list[dict]) -> dict:
    """One side's rounds: medians over the steady steps (all but each run's first), peaks, curves."""
    rows = [r for run in runs for r in run["rows"]]
    steady = [r for r in rows if r["step"] > 1] or rows
    n_steps = min(len(run["rows"]) for run in runs)
    by_step = lambda key: [round(statistics.fmean(run["rows"][i][key] for run in runs), 4)  # noqa: E731
                           for i in range(n_steps)]
    return {
        "step_s": median([r["step_s"] for r in steady]),
        "first_step_s": median([r["step_s"] for r in rows if r["step"] == 1] or [0.0]),
        "generation_s": median([r["generation_s"] for r in steady]),
        "learner_s": median([r["step_s"] - r["generation_s"] for r in steady]),
        "phases_s": {k: median([r["phases"][k] for r in steady]) for k in steady[0]["phases"]},
        "step_s_by_round": [median([r["step_s"] for r in run["rows"] if r["step"] > 1] or
                                    [r["step_s"] for r in run["rows"]]) for run in runs],
        "peak_rss_gb": round(max(run["peak_rss_gb"] for run in runs), 3),
        "peak_rss_gb_by_round": [round(run["peak_rss_gb"], 3) for run in runs],
        "wall_s_by_round": [round(run["wall_s"], 1) for run in runs],
        "loadavg_1m_by_round": [round(run["loadavg_1m"], 2) for run in runs],
        "reward_by_step": by_step("reward"),
        "reward_by_round": [[round(r["reward"], 4) for r in run["rows"]] for run in runs],
        "reward_mean_by_round": [round(statistics.fmean(r["reward"] for r in run["rows"]), 4) for run in runs],
        "completion_length_by_step": by_step("completion_length"),
    }


def step_split(s: dict) -> str:
    return f"{s['step_s']:.3f} s (generation {s['generation_s']:.3f}, learner {s['learner_s']:.3f})"


def reward_gap(a: dict, b: dict) -> dict:
    """Mean reward of side ``a`` less side ``b`` over every step of every round, against the standard error of that
    difference from the steps: each step's batch-mean reward is one draw, and the steps are taken as independent (a
    short bench's policy barely moves). Two rounds' means alone made that error far too small to judge a gap by.
    None with fewer than 2 steps a side."""
    sa = [r for rs in a["reward_by_round"] for r in rs]
    sb = [r for rs in b["reward_by_round"] for r in rs]
    gap = statistics.fmean(sa) - statistics.fmean(sb)
    noise = None
    if len(sa) > 1 and len(sb) > 1:
        noise = (statistics.variance(sa) / len(sa) + statistics.variance(sb) / len(sb)) ** 0.5
    return {"gap": round(gap, 4), "noise": None if noise is None else round(noise, 4),
            "gap_over_noise": None if not noise else round(abs(gap) / noise, 2)}

