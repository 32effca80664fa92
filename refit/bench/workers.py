"""``refit bench workers``: wall time of a demo-sized PPO iteration with 1 and with N Ray rollout workers.

The embedded demo's policy (built and warmed up locally) and its PPO settings (32 prompts x 4
samples, 6 new tokens, 2 epochs x 2 minibatches, a weight push and probe every step); the same
run with ``scale.workers=1`` (one engine in this process, ``threads`` intra-op threads) and
``scale.workers=N`` (N Ray actors, ``scale.worker_cpus`` each, one engine thread each). The
first ``warmup`` steps of each run are dropped (engine and actor start-up), the median of the rest
reported. A pool samples in fixed chunks of prompts, so its tokens are the same for any N (see
:mod:`refit.rollout.ray_pool`) but not those of the in-process engine, which samples the batch in one
piece: the mean rewards of the two runs differ a little for that reason alone.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from refit.bench.ppo import PHASES
from refit.learner.demo import build_policy
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo
from refit.learner.run.metrics import read_metrics


def bench_workers(work: Path, workers: int, steps: int, threads: int, warmup: int = 2, log=print) -> dict:
    torch.set_num_threads(threads)
    policy = work / "policy"
    if not (policy / "config.json").exists():
        build_policy(work, sft_steps=150, max_operand=9, seed=0, log=lambda *_: None)
    out = {}
    for n in (1, workers):
        cfg = PPOConfig.from_flat(
            model_dir=str(policy), engine_dir=str(work / "engine"), output_dir=str(work / f"ppo-w{n}"),
            steps=steps, batch_size=32, num_generations=4, advantage_estimator="gae", max_operand=9, learning_rate=3e-4,
            num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.01, response_length=6, save_steps=steps,
            engine_threads=threads if n == 1 else 1, rollout_workers=n,
            rollout_worker_cpus=max(threads / n, 0.5), progress=False, tensorboard=False, plots=False)
        rows = read_metrics(run_ppo(cfg, log=lambda *_: None, overwrite=True))[warmup:]  # the bench's folder
        out[n] = {k: statistics.median(r[k] for r in rows) for k in PHASES}
        out[n]["reward_mean"] = statistics.mean(r["reward/mean"] for r in rows)
        log(f"workers {n}: " + "  ".join(f"{k.split('/')[1]} {out[n][k]:.3f}s" for k in PHASES))
    return {"bench": "workers", "workers": workers, "steps": steps, "timed_steps": steps - warmup,
            "threads": threads, "phases_s": {str(n): v for n, v in out.items()},
            "step_ratio_1_over_n": round(out[1]["time/step"] / out[workers]["time/step"], 3),
            "rollout_ratio_1_over_n": round(out[1]["time/rollout"] / out[workers]["time/rollout"], 3)}
