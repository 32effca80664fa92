"""The PPO-KL export/train cycle.

    export (or reuse) the policy engine, choose the update route (refit.learner.ppo.build: the run, built once)
    -> every step: 1. generate on the engine   2. reward + learner log-probs (policy, reference)
                   3. PPO update, on the run's route (refit.learner.ppo.route)   4. every ``sync_every`` steps push
                   weights into the engine; the next rollout's log-probs vs the learner's check it (the last push: a
                   fixed probe batch scored on both sides); stop on disagreement (refit.learner.run.sync)
                   5. checkpoint every ``save_steps`` steps (atomic)   6. metrics.jsonl / TensorBoard

With ``rollout.max_staleness`` k >= 1 the engine generates step s+1's batch on a background thread during
steps 2-3 of step s, and each push is queued behind it on that thread, checked on the probe batch there and
logged on the next step's row (refit.learner.ppo.overlap: the protocol, threads, resume).

Every random choice of step ``s`` (prompt order, sampling seed, minibatch order) is derived
from ``(seed, s)``, so ``--resume`` from a checkpoint reproduces the uninterrupted run's metrics.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from refit.learner.ppo.build import Run, setup
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.data import reward_inputs
from refit.learner.ppo.mismatch import tell_mismatch
from refit.learner.ppo.overlap import PENDING_FILE, check_staleness, torch_threads
from refit.learner.ppo.refsync import REFERENCE_FILE
from refit.learner.ppo.rewards import NamedReward, TrainerState, as_rewards, score_rewards, write_extras
from refit.learner.ppo.route import ScoreThenUpdate, on_cuda, update_settings
from refit.learner.ppo.update import distributed_ppo_update
from refit.learner.run.checkpoint import save_checkpoint
from refit.learner.run.data import prompt_indices
from refit.learner.run.dataset import PromptSet
from refit.learner.run.engines import learner_micro_rows
from refit.learner.run.final import write_final
from refit.learner.run.loop import Job, check_finite, due, run_job
from refit.learner.run.optim import neftune
from refit.rollout.types import RolloutBatch, SamplingParams

PLOT_PANELS = {"reward": ["reward/mean", "eval/reward/mean"], "KL to reference": ["kl/k1", "kl/k3", "kl/exact"],
               "PPO": ["ppo/clipfrac", "ppo/approx_kl"], "engine vs learner": ["mismatch/max_abs_diff"]}


def step_batch(run: Run, step: int, position: int) -> tuple[list[int], SamplingParams]:
    """The prompts (dataset rows from ``position``) and the sampling (seed) of ``step``'s rollout: a function of
    (seed, step, position), whether it is generated in its step or the step before (overlapped)."""
    cfg = run.cfg
    idx = prompt_indices(len(run.prompts), position, cfg.run.batch_size, cfg.data.order_seed(cfg.run.seed))
    sampling = cfg.sampling.params(cfg.response_length, n=cfg.num_generations, seed=cfg.run.seed * 1_000_003 + step,
                                   stop_ids=run.stop_ids)
    return idx, sampling


def take_rollout(run: Run, step: int, idx: list[int], sampling: SamplingParams) -> tuple[RolloutBatch, float, int]:
    """Overlapped (``run.ahead``): this step's batch (generated ahead, else now), its generation seconds and its lag
    in pushes (checked against rollout.max_staleness); then the next step's batch is started in the background."""
    cfg = run.cfg
    rollout, seconds = run.ahead.take(step) or run.ahead.generate([run.prompt_ids[i] for i in idx], sampling)
    lag = check_staleness(rollout, run.sync.version, cfg.rollout.max_staleness)
    if step < cfg.run.steps:  # the next step's batch, generated while this one is scored and updated on
        nidx, nsampling = step_batch(run, step + 1, run.state.data_position)
        run.ahead.submit(step + 1, [run.prompt_ids[i] for i in nidx], nsampling)
    return rollout, seconds, lag


def train_step(run: Run, step: int, log=print) -> dict[str, float]:
    with torch_threads(run.learner_threads):  # overlapped: the learner's share of the threads (else unchanged)
        m = _train_step(run, step, log)
        if run.ref_sync is not None:  # sync_ref_model: after the step's optimizer steps, on every rank holding one
            synced = run.ref_sync.after_step(run.policy, step)
            m.update(synced if run.dist.is_main else {})
        return m


def _train_step(run: Run, step: int, log=print) -> dict[str, float]:
    """One step in its phases: 1. the rollout  2. rewards  3. experience (the check of an unchecked push)
    4. the PPO update  5. the weight sync (refit.learner.run.sync)  6. the mismatch named, the row."""
    cfg, kl = run.cfg, run.state.kl
    update_gen = torch.Generator().manual_seed(cfg.run.seed * 1_000_033 + step)  # minibatch order, same on every rank
    if not run.dist.is_main:  # [dist] ranks > 0: rank 0's experience, this rank's slice of the update, no metrics
        exp, kl.value = run.dist.share((None, kl.value))
        with neftune(run.policy, cfg.optim.neftune_noise_alpha):  # NEFTune in the training forwards (else no-op)
            distributed_ppo_update(run.dist, run.policy, run.value_head, run.optimizer, run.scheduler, exp,
                                   update_settings(cfg, kl.value, on_cuda(run.policy), run.state.entropy), update_gen,
                                   ref_model=run.ref)
        return {}
    timings = {}
    t0 = time.perf_counter()
    state = trainer_state(cfg, len(run.prompts), run.state.data_position, step)
    idx, sampling = step_batch(run, step, run.state.data_position)  # 1.
    run.state.data_position += cfg.run.batch_size
    rollout, lag = rollout_phase(run, step, idx, sampling, timings)
    timings["time/rollout"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores, reward_stats, per_func = reward_phase(run, step, rollout, idx, state)  # 2.
    timings["time/reward"] = time.perf_counter() - t1
    with neftune(run.policy, cfg.optim.neftune_noise_alpha):  # NEFTune: the learner's forwards of 3. and 4.
        stats, upd = learn_phase(run, step, rollout, scores, lag, update_gen, timings, per_func, log)  # 3. and 4.
    check_finite(upd, f"loss at step {step}", run.run_dir)
    if "kl/k1_seq" in stats:  # the reference was scored (needs_reference)
        kl.adapt(stats["kl/k1_seq"], rollout.num_rows)
    run.sync.after_update(run.policy, due(step, cfg.rollout.sync_every, cfg.run.steps), step == cfg.run.steps,
                          stats, timings)  # 5.
    tell_mismatch(run, step, stats, sampling, log)  # 6.
    tokens = float(rollout.response_mask.sum())
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            **reward_stats, **stats, **{f"ppo/{k}": v for k, v in upd.items()}, "kl/coef": kl.value,
            "response/length": tokens / rollout.num_rows, "engine/weights_version": run.sync.version,
            "tokens_per_s": tokens / max(timings.get("time/generate") or timings["time/rollout"], 1e-9), **timings,
            "time/step": time.perf_counter() - t0}


def learn_phase(run: Run, step: int, rollout: RolloutBatch, scores: torch.Tensor, lag: int,
                update_gen: torch.Generator, timings: dict[str, float], per_func: list | None = None, log=print,
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Steps 3 and 4 on the run's update route (``run.route``, chosen once by :func:`setup`; refit.learner.ppo.route):
    the experience (learner log-probs, reference, advantages), the check of an unchecked push before any update uses
    the batch, and the PPO update; (experience stats, update stats). A step the route declines (a batch over one
    forward's rows for the single pass) runs as score-then-update, told once."""
    kl = run.state.kl.value
    settings = replace(update_settings(run.cfg, kl, on_cuda(run.policy), run.state.entropy),
                       micro_rows=micro_rows(run, rollout))
    route, declined = run.route, run.route.declines(settings, rollout.num_rows, kl)
    if declined is not None:
        route = ScoreThenUpdate(declined)
        if not run.state.route_told:
            run.state.route_told = True
            log(f"refit ppo: step {step} runs {route.name}, not {run.route.name}: {declined} (told once)")

    def check(stats: dict[str, float]) -> None:  # before any update uses the batch
        if run.ahead is not None:
            stats["mismatch/version_lag"] = float(lag)
        checked = run.sync.check_rollout(rollout, stats["mismatch/max_abs_diff"])
        if checked is not None:
            stats["probe/max_abs_logprob_diff"] = checked

    return route.learn(run, rollout, scores, settings, update_gen, check, timings, per_func)


def micro_rows(run: Run, rollout: RolloutBatch) -> int:
    """Rows per learner forward with autograd in this step's update (refit.learner.run.engines.learner_micro_rows:
    optim.micro_batch_rows, or what fits the memory); 0 (no cap) under torchrun, whose ranks split alike."""
    if run.geometry is None or run.dist.enabled:
        return 0
    cfg = run.cfg
    rows = rollout.num_rows // cfg.num_mini_batches // cfg.optim.gradient_accumulation_steps
    tr = rollout.response_ids.shape[1]
    return learner_micro_rows(run.geometry, rows, rollout.prompt_ids.shape[1] + tr, tr, cfg.optim.micro_batch_rows)


def rollout_phase(run: Run, step: int, idx: list[int], sampling: SamplingParams,
                  timings: dict[str, float]) -> tuple[RolloutBatch, int]:
    """Step 1: this step's batch from the engine, its weights checked to be the last push's (overlapped: generated
    ahead, its lag in pushes; ``time/generate`` its own generation); (batch, lag)."""
    if run.ahead is not None:  # time/rollout: the wait for it
        rollout, timings["time/generate"], lag = take_rollout(run, step, idx, sampling)
        return rollout, lag
    rollout = run.engine.generate([run.prompt_ids[i] for i in idx], sampling)
    run.sync.check_version(rollout)
    return rollout, 0


def reward_phase(run: Run, step: int, rollout: RolloutBatch, idx: list[int],
                 state: TrainerState) -> tuple[torch.Tensor, dict[str, float], list | None]:
    """Step 2: the reward functions on the decoded completions; (scores (B,), reward stats with TRL's log_metric
    means, with multi_objective_aggregation normalize_then_sum each function's values (B, F) and weights (F,), else
    None); the log_extra columns into completions.jsonl."""
    rows = [idx[i] for i in rollout.prompt_index.tolist()]  # dataset row of each rollout row
    data = run.data or PromptSet(run.prompts)
    prompts, completions, columns = reward_inputs(run.tok, rollout, data, rows)
    per: list = []
    scores, reward_stats = score_rewards(as_rewards(run.reward_fn), prompts, completions,
                                         {**columns, **run.reward_log.kwargs(state)}, per_func=per)
    logged, extra = run.reward_log.flush()  # TRL's log_metric means and log_extra columns
    write_extras(run.run_dir / "completions.jsonl", step, prompts, completions, extra)
    if run.cfg.multi_objective_aggregation == "normalize_then_sum":  # GDPO: advantages from each function's values
        return scores, {**reward_stats, **logged}, per
    return scores, {**reward_stats, **logged}, None


def save(run: Run, step: int) -> Path:
    # overlapped: the batch in flight (its weights are gone) and the queued pushes' results, waited for first, so
    # the engine's version is the pushed one and a failed probe stops the run before the checkpoint
    held = run.ahead.held() if run.ahead is not None else None
    files = ({PENDING_FILE: {"step": held[0], "batch": held[1], "pushed": [tuple(p) for p in held[2]]}}
             if held is not None else {})
    if run.ref_sync is not None:
        files[REFERENCE_FILE] = run.ref_sync.state()
    state = {"kl_coef": run.state.kl.value, "data_position": run.state.data_position,
             "engine_weights_version": run.engine.weights_version, **run.state.entropy.state()}
    return save_checkpoint(run.run_dir, step, run.policy, run.tok, run.value_head, run.optimizer, run.scheduler,
                           state, run.cfg.ckpt.keep_checkpoints, files=files)


def trainer_state(cfg: PPOConfig, num_prompts: int, data_position: int, step: int,
                  evaluating: bool = False) -> TrainerState:
    """TRL's view of the run at the rollout of ``step`` (or at the evaluation after ``step``): the optimizer
    steps taken before it and the passes over the ``num_prompts`` training prompts (``data_position`` used)."""
    n = max(1, num_prompts)
    per = cfg.num_ppo_epochs * cfg.num_mini_batches  # optimizer steps per rollout
    done = step if evaluating else max(step - 1, 0)  # rollouts whose update is in the weights
    return TrainerState(global_step=done * per, max_steps=cfg.run.steps * per, epoch=data_position / n,
                        num_train_epochs=cfg.run.steps * cfg.run.batch_size / n, step=step)


def evaluate(run: Run, step: int = 0) -> dict[str, float]:
    """Greedy generation of the held-out prompts through the engine; their reward means (rank 0)."""
    cfg, t0 = run.cfg, time.perf_counter()
    if run.eval_set is None or not cfg.eval_steps:
        return {}
    if run.ahead is not None:
        run.ahead.wait()  # the engine idle and pushed: the generation in flight, then the push queued behind it
    k = cfg.num_generations_eval  # 0: one greedy completion a prompt; k: k sampled (TRL's num_generations_eval)
    chunk = max(1, cfg.run.batch_size * cfg.num_generations // max(k, 1))  # prompts: the rows the engine was sized for
    sampling = (cfg.sampling.params(cfg.response_length, n=k, seed=cfg.run.seed * 1_000_037 + step,
                                    stop_ids=run.stop_ids) if k else
                SamplingParams(max_new_tokens=cfg.response_length, greedy=True, stop_ids=run.stop_ids))
    prompts, completions, extra, tokens = [], [], {}, 0.0
    for i in range(0, len(run.eval_ids), chunk):
        rows = list(range(i, min(i + chunk, len(run.eval_ids))))
        out = run.engine.generate([run.eval_ids[r] for r in rows], sampling)
        p, c, x = reward_inputs(run.tok, out, run.eval_set, [rows[j] for j in out.prompt_index.tolist()])
        prompts, completions, tokens = prompts + p, completions + c, tokens + float(out.response_mask.sum())
        for k, v in x.items():
            extra.setdefault(k, []).extend(v)
    hooks = run.reward_log.kwargs(trainer_state(run.cfg, len(run.prompts), run.state.data_position, step,
                                                evaluating=True))
    total, stats = score_rewards(as_rewards(run.reward_fn), prompts, completions, {**extra, **hooks},
                                 prefix="eval/reward")
    logged, _ = run.reward_log.flush(prefix="eval/")
    return {"eval/reward/mean": float(total.mean()), **stats, **logged, "eval/response_length": tokens / len(prompts),
            "time/eval": time.perf_counter() - t0}


def step_and_evaluate(run: Run, step: int, log=print) -> dict[str, float]:
    """:func:`train_step`, plus the held-out evaluation every ``eval_steps`` steps and at the last (rank 0)."""
    m = train_step(run, step, log)
    if run.dist.is_main and run.cfg.eval_steps and due(step, run.cfg.eval_steps, run.cfg.run.steps):
        m.update(evaluate(run, step))
    return m


def finish(run: Run, log=print) -> None:
    """A run that reached its last step: overlapped, the engine's queued jobs waited for, a failed push's or probe's
    one line raised (the last step of ``run.max_steps_this_run`` queues a push no step collects; closing would
    drop its error), and a push that passed its probe there logged in one line (no step's row carries it)."""
    if run.sync is not None:
        run.sync.finish(log)


def final(run: Run, log=print) -> None:
    """OUTPUT_DIR/final (from_pretrained), final_engine/ and the value head beside them (refit.learner.run.final)."""
    cfg = run.cfg
    if not cfg.export_final:
        return
    max_len = max(len(p) for p in run.prompt_ids + run.eval_ids) + cfg.response_length + 8
    write_final(run.run_dir, run.policy, run.tok, run.value_head if cfg.advantage_estimator == "gae" else None,
                cfg.rollout.backend, cfg.run.batch_size * cfg.num_generations, max_len, run.stop_ids, log)


def ppo_job(log=print, rewards: list[NamedReward] | None = None) -> Job:
    """The PPO job for :func:`refit.learner.run.loop.run_job`; ``rewards``: loaded already (Python callables)."""
    return Job("ppo", setup=partial(setup, rewards=rewards), step=partial(step_and_evaluate, log=log), save=save,
               engines=lambda run: [run.ahead, run.engine, run.ref_engine],  # the thread first: it uses the engine
               postfix=lambda m: {"reward": f"{m['reward/mean']:.3f}", "kl": f"{m.get('kl/exact', 0.0):.4f}"},
               plot_panels=PLOT_PANELS, initial=evaluate, final=partial(final, log=log),
               finish=partial(finish, log=log))


def run_ppo(cfg: PPOConfig, resume: bool = False, log=print, overwrite: bool = False) -> Path:
    """Run the cycle; return the run folder (metrics.jsonl, tb/, curves.png, checkpoints/, engine/)."""
    return run_job(ppo_job(log), cfg, resume, log, overwrite)[0]
