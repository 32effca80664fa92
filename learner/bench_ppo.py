"""``refit bench ppo``: one PPO iteration with engine rollouts against the same learner with HF ``generate()``.

Both runs use one config (same model, prompts, batch, response length, PPO settings, a weight
push and parity probe every step); each backend runs a warm-up iteration, then ``repeats`` timed
ones, and the median wall time per phase is reported (rollout, score, update, weight push).

Default workload: the ``small-gpt2`` geometry (4 layers x 128, local tokenizer), 8 rows, 192 new
tokens: long responses from a small batch, so that generation is the largest phase of the HF
baseline, as in the published systems (there 80-90% of a step). On 2 CPU cores that share is
about 65%: the learner's forward/backward passes are compute-bound on the CPU, whereas on a
GPU they are the cheap part. The ratio therefore falls as the batch grows (more learner tokens
per decode step) and with the model size (``--geometry gpt2-small``: the 124M backward pass
dominates); the JSON carries the per-phase times so the reason is visible in every run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

PHASES = ("time/rollout", "time/score", "time/update", "time/weight_push", "time/step")


def _prompts_file(work: Path, n: int, length: int) -> Path:
    """Random-text prompts of about ``length`` tokens (the task is irrelevant to timing)."""
    import random

    rng = random.Random(0)
    words = ["refit", "engine", "policy", "learner", "token", "reward", "kl", "sample", "batch", "onnx"]
    f = work / "bench_prompts.txt"
    f.write_text("\n".join(" ".join(rng.choice(words) for _ in range(length // 2)) for _ in range(n)) + "\n")
    return f


def bench_ppo(model: Path, engine: Path, backend: str, batch_size: int, response_length: int, threads: int,
              work: Path, repeats: int = 2, log=print) -> dict:
    from learner.config import PPOConfig
    from learner.cycle import setup, train_step
    torch.set_num_threads(threads)
    prompts = _prompts_file(work, 4 * batch_size, 32)
    phases = {}
    for name in (backend, "hf"):
        cfg = PPOConfig(model_dir=str(model), engine_dir=str(engine), output_dir=str(work / f"ppo-{name}"),
                        backend=name, prompts_file=str(prompts), reward="learner.bench_ppo:length_reward", steps=repeats + 1, batch_size=batch_size,
                        num_generations=1, response_length=response_length, num_ppo_epochs=1, num_mini_batches=1,
                        engine_threads=threads, progress=False, tensorboard=False, plots=False, save_steps=1000)
        run = setup(cfg, resume=False, log=lambda *_: None)
        rows = [train_step(run, s, log=lambda *_: None) for s in range(1, repeats + 2)][1:]
        run.engine.close()
        phases[name] = {k: statistics.median(r[k] for r in rows) for k in PHASES}
        log(f"{name:<12} " + "  ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in phases[name].items()))
    speedup = phases["hf"]["time/step"] / phases[backend]["time/step"]
    return {"bench": "ppo", "model": str(model), "backend": backend, "batch_size": batch_size,
            "response_length": response_length, "threads": threads, "repeats": repeats,
            "phases_s": phases, "rollout_speedup": round(phases["hf"]["time/rollout"] / phases[backend]["time/rollout"], 3),
            "speedup": round(speedup, 3)}


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A cheap dense reward for timing runs: longer responses score higher (capped)."""
    return [min(len(r), 64) / 64.0 for r in responses]
