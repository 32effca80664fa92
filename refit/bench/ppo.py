"""``refit bench ppo``: one PPO iteration with engine rollouts against the same learner with HF ``generate()``.

Both runs use one config (same model, prompts, batch, response length, PPO settings, a weight
push every step, each one checked on the next rollout: ``probe_on_rollout``); each backend runs a
warm-up iteration, then ``repeats`` timed ones, and the median wall time per phase is reported
(rollout, score, update, weight push). The run is one step longer than the iterations timed, so
every timed one is a steady-state iteration (only a run's last push is checked on the probe batch).

Default workload: the ``small-gpt2`` geometry (4 layers x 128, local tokenizer), 8 rows, 192 new
tokens: long responses from a small batch, so that generation is the largest phase of the HF
baseline, as in the published systems (there 80-90% of a step). On 2 CPU cores that share is
about 65%: the learner's forward/backward passes are compute-bound on the CPU, whereas on a
GPU they are the cheap part. The ratio therefore falls as the batch grows (more learner tokens
per decode step) and with the model size (``--geometry gpt2-small``: the 124M backward pass
dominates); the JSON carries the per-phase times so the reason is visible in every run.

``--max_staleness k`` (k >= 1) adds a third run, the engine loop with generation overlapped with the update
(``rollout.max_staleness``, refit.learner.ppo.overlap), set up and interleaved with the other two: its
``time/rollout`` is the wait for a batch generated during the previous update, ``time/generate`` that generation's
own time. It runs in blocks (:func:`overlapped_block`): each round, after one step of each other run, two
consecutive overlapped steps, the second timed, then the engine drained, so the timed step waits for the batch made
during the step before it and no background generation runs during the other runs' steps. Its pushes run on the
engine's thread, queued behind the generation in flight: on the learner's critical path are ``time/weight_push``
(the snapshot of the weights), ``time/probe_learner`` (the probe's learner half) and ``time/push_wait`` (the wait
for the previous step's push and probe, collected after the update); ``time/push_engine`` and ``time/probe_engine``
are the engine thread's own push and probe seconds (every push is checked on the probe batch there).
``push_probe_share_of_step`` is the learner's three over its step. Its engine and learner split the threads
(``threads`` 2: one each); the synchronous runs keep all of them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from refit.core.manifest import Manifest
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import setup, train_step
from refit.learner.ppo.overlap import split_threads

PHASES = ("time/rollout", "time/score", "time/update", "time/weight_push", "time/step")
OVERLAP_PHASES = ("time/generate", "time/push_wait", "time/probe_learner", "time/push_engine",
                  "time/probe_engine")  # the overlapped run's own


def _prompts_file(work: Path, n: int, length: int) -> Path:
    """Random-text prompts of about ``length`` tokens (the task is irrelevant to timing)."""
    import random

    rng = random.Random(0)
    words = ["refit", "engine", "policy", "learner", "token", "reward", "kl", "sample", "batch", "onnx"]
    f = work / "bench_prompts.txt"
    f.write_text("\n".join(" ".join(rng.choice(words) for _ in range(length // 2)) for _ in range(n)) + "\n")
    return f


def _overlap_summary(phases: dict, rows: dict, run, backend: str, overlapped: str, max_staleness: int,
                     threads: int) -> dict:
    """The overlapped run against HF and the synchronous engine loop: speedups, the push and probe's share of its
    step (on the learner's path and on the engine's thread), the generation it hid, the version lag per step."""
    o, e, h = phases[overlapped], phases[backend], phases["hf"]
    return {
        "max_staleness": max_staleness, "engine_threads": split_threads(0, threads)[0],
        "learner_threads": run.learner_threads, "correction": run.cfg.correction,
        "speedup_vs_hf": round(h["time/step"] / o["time/step"], 3),
        "speedup_vs_sync": round(e["time/step"] / o["time/step"], 3),
        "speedup_vs_hf_per_iteration": [round(hr["time/step"] / orow["time/step"], 3)
                                        for orow, hr in zip(rows[overlapped][1:], rows["hf"][1:])],
        # the push and probe on the learner's critical path: snapshot, learner half, wait for the queued push
        "push_probe_share_of_step": round(sum(o[k] for k in ("time/weight_push", "time/probe_learner",
                                                            "time/push_wait")) / o["time/step"], 4),
        # the engine thread's push and probe (overlapped with the learner's next step)
        "push_probe_engine_share_of_step": round((o["time/push_engine"] + o["time/probe_engine"])
                                                 / o["time/step"], 4),
        # the part of the generation not waited for (the wait before the step's batch)
        "hidden_generation_share": round(1 - o["time/rollout"] / max(o["time/generate"], 1e-9), 4),
        "version_lag": [r["mismatch/version_lag"] for r in rows[overlapped]]}


def bench_ppo(model: Path, engine: Path, backend: str, batch_size: int, response_length: int, threads: int,
              work: Path, repeats: int = 2, log=print, max_staleness: int = 0, num_generations: int = 1,
              engine_shards: int = 0) -> dict:
    """The runs are set up side by side and their iterations interleaved (engine, HF, engine, HF, ...), so
    a change in the machine's load during the benchmark falls on all alike; one warm-up iteration each.
    ``max_staleness`` >= 1: a third run, the engine loop overlapped (``<backend>-overlap``), two consecutive steps
    a round with the second timed (:func:`overlapped_block`). ``num_generations`` > 1: GRPO, ``batch_size`` prompts x
    that many samples; ``engine_shards``: the synchronous engine run's ``rollout.engine_shards``."""
    torch.set_num_threads(threads)
    prompts = _prompts_file(work, 4 * batch_size, 32)
    overlapped = f"{backend}-overlap"
    names = (backend, "hf") + ((overlapped,) if max_staleness else ())
    runs = {}
    for name in names:
        k = max_staleness if name == overlapped else 0
        cfg = PPOConfig.from_flat(
            model_dir=str(model), engine_dir=str(engine), output_dir=str(work / f"ppo-{name}"),
            backend=backend if name == overlapped else name, prompts_file=str(prompts),
            reward="refit.bench.ppo:length_reward", steps=(BLOCK if k else 1) * (repeats + 1) + 1,
            batch_size=batch_size, num_generations=num_generations,
            advantage_estimator="grpo" if num_generations > 1 else "auto",
            engine_shards=engine_shards if name == backend else 1,
            response_length=response_length, num_ppo_epochs=1, num_mini_batches=1,
            engine_threads=0 if k else threads,  # overlapped: split between engine and learner (overlap.py)
            max_staleness=k, progress=False, tensorboard=False, plots=False,
            save_steps=1000)
        runs[name] = setup(cfg, resume=False, log=lambda *_: None)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    done = dict.fromkeys(names, 0)  # steps each run has made

    def step(name: str) -> dict:
        done[name] += 1
        return train_step(runs[name], done[name], log=lambda *_: None)

    try:
        for _ in range(repeats + 1):  # round 0 is the warm-up
            for name in (backend, "hf"):
                rows[name].append(step(name))
            if max_staleness:
                rows[overlapped].append(overlapped_block(runs[overlapped], step, overlapped))
    finally:
        for run in runs.values():
            if run.ahead is not None:
                run.ahead.close()
            run.engine.close()
            if run.ref_engine is not None:
                run.ref_engine.close()
    phases = {}
    for name in names:
        timed = rows[name][1:]  # the first iteration is the warm-up
        phases[name] = {k: statistics.median(r[k] for r in timed) for k in PHASES + OVERLAP_PHASES if k in timed[0]}
        log(f"{name:<20} " + "  ".join(f"{k.split('/')[1]} {v:.3f}s" for k, v in phases[name].items()))
    paired = [h["time/step"] / e["time/step"] for e, h in zip(rows[backend][1:], rows["hf"][1:])]
    out = {"bench": "ppo", "model": str(model), "backend": backend, "batch_size": batch_size,
            "num_generations": num_generations, "engine_shards": engine_shards,
            "response_length": response_length, "threads": threads, "repeats": repeats,
            "phases_s": phases, "rollout_speedup": round(phases["hf"]["time/rollout"] / phases[backend]["time/rollout"], 3),
            "speedup": round(phases["hf"]["time/step"] / phases[backend]["time/step"], 3),
            "speedup_per_iteration": [round(x, 3) for x in paired],
            "push_share_of_step": round(phases[backend]["time/weight_push"] / phases[backend]["time/step"], 4),
            "learner": {k: getattr(runs[backend].cfg, k) for k in ("single_pass", "probe_on_rollout")},
            "engine_attention": _attention(engine), "ref_backend": {n: "onnxruntime" if runs[n].ref_engine is not None
                                                                   else "torch" for n in names}}
    if max_staleness:
        out["overlap"] = _overlap_summary(phases, rows, runs[overlapped], backend, overlapped, max_staleness, threads)
        log(f"overlapped (k={max_staleness}): {out['overlap']['speedup_vs_hf']}x HF generate() per iteration, "
            f"{out['overlap']['speedup_vs_sync']}x the synchronous engine loop; push+probe "
            f"{100 * out['overlap']['push_probe_share_of_step']:.1f}% of its step on the learner "
            f"({100 * out['overlap']['push_probe_engine_share_of_step']:.1f}% on the engine's thread, overlapped)")
    return out


BLOCK = 2  # the overlapped run's consecutive steps per round: the first one's batch was generated before the round


def overlapped_block(run, step, name: str) -> dict:
    """One round of the overlapped run: :data:`BLOCK` consecutive steps, the last one's row returned, then the
    engine drained (untimed) so that its background work never runs during another run's step.

    The first step of a round takes the batch generated at the end of the previous round, ready before the round
    began (its wait is 0 whatever the generation costs), so only a later step is a steady-state iteration: it
    waits for the batch generated during the step before it, as every step of a real run does. (Interleaving
    single steps, as the bench once did, let each batch be generated during the other runs' steps: the overlapped
    iteration then read as the learner's phases alone, however long the generation.)"""
    for _ in range(BLOCK):
        row = step(name)
    run.ahead.wait()
    return row


def _attention(engine: Path) -> str:
    return Manifest.read(engine).attention or "plain"


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A cheap dense reward for timing runs: longer responses score higher (capped)."""
    return [min(len(r), 64) / 64.0 for r in responses]
