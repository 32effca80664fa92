"""``refit ppo [--config FILE.yaml] [--section.field value ...] [--resume]``: the PPO-KL cycle."""

from __future__ import annotations

import json
import os
from pathlib import Path

from refit.learner.ppo.config import PPOConfig, parse_ppo
from refit.learner.ppo.cycle import run_ppo
from refit.learner.run.metrics import read_metrics


def summary(run_dir) -> dict:
    every = read_metrics(run_dir)
    rows = [r for r in every if "reward/mean" in r]  # training steps (a step-0 row holds the evaluation only)
    if not rows:
        return {}
    first, last = rows[0], rows[-1]
    k = max(1, min(5, len(rows) // 4))
    out = {"run_dir": str(run_dir), "steps": last["step"], "reward_start": first["reward/mean"],
           "reward_end": last["reward/mean"],
           f"reward_first{k}_mean": sum(r["reward/mean"] for r in rows[:k]) / k,
           f"reward_last{k}_mean": sum(r["reward/mean"] for r in rows[-k:]) / k,
           "min_exact_kl": min((r["kl/exact"] for r in rows if "kl/exact" in r), default=None),  # None: no reference
           "max_probe_diff": max((r.get("probe/max_abs_logprob_diff") or 0.0) for r in rows)}
    evals = [r for r in every if r.get("eval/reward/mean") is not None]
    if evals:
        out.update(eval_reward_start=evals[0]["eval/reward/mean"], eval_reward_end=evals[-1]["eval/reward/mean"],
                   eval_steps=[r["step"] for r in evals])
    final = Path(run_dir) / "final"
    if (final / "config.json").exists():
        out["final"] = str(final)
    return out


def main(argv: list[str] | None = None) -> int:
    return run(*parse_ppo(argv))


def run(cfg: PPOConfig, opts) -> int:
    """``refit ppo`` after :func:`~refit.learner.ppo.config.parse_ppo` checked its line (no torch)."""
    run_dir = run_ppo(cfg, resume=opts.resume, overwrite=opts.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:  # [dist] under torchrun one summary line, from rank 0
        print(json.dumps(summary(run_dir)))
    return 0
