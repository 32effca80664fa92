"""The PPO-KL export/train cycle.

    export (or reuse) the policy engine
    -> every step: 1. generate on the engine   2. reward + learner log-probs (policy, reference)
                   3. PPO update                4. every ``sync_every`` steps push weights into the
                   engine; the next rollout's log-probs vs the learner's check it (the last push: a
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
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from refit.core.hf_folder import load_model, load_tokenizer, model_info
from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.memory import Geometry, geometry
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.mismatch import tell_mismatch
from refit.learner.ppo.overlap import PENDING_FILE, RolloutAhead, check_staleness, torch_threads
from refit.learner.ppo.data import load_prompt_sets, reward_inputs
from refit.learner.ppo.rewards import (NamedReward, RewardLog, TrainerState, as_rewards, load_rewards, score_rewards,
                                       write_extras)
from refit.learner.ppo.models import (decode_threads, make_optimizer, overlap_threads, reference_engine, resolve_shards,
                                      torch_reference)
from refit.learner.ppo.onepass import ReferenceAhead, onepass_update, streamable
from refit.learner.ppo.refsync import REFERENCE_FILE, RefSync, reference_sync, restore_reference
from refit.learner.ppo.update import (Experience, KLCoef, UpdateSettings, distributed_ppo_update, make_experience,
                                      needs_reference, policy_forward, score_chunks, single_pass)
from refit.learner.run.chat import encode_prompts, end_of_turn_ids
from refit.learner.run.checkpoint import resume_latest, save_checkpoint
from refit.learner.run.data import prompt_indices
from refit.learner.run.dataset import PromptSet
from refit.learner.run.final import write_final
from refit.learner.run.distributed import DistContext
from refit.learner.run.engines import engine_for_model, learner_micro_rows, pick_device
from refit.learner.run.lora import adapter_dropout, apply_lora
from refit.learner.run.matmul import use_cpu_matmul
from refit.learner.run.optim import neftune
from refit.learner.run.loop import Job, check_finite, due, run_job
from refit.learner.run.precision import mixed_bf16, settle_precision
from refit.learner.run.policy import ForwardOut, ValueHead, hidden_size, vocab_size
from refit.learner.run.sync import Contract, WeightSync, make_probe, push_checkpoint
from refit.rollout.engine import Engine
from refit.rollout.types import RolloutBatch, SamplingParams

PLOT_PANELS = {"reward": ["reward/mean", "eval/reward/mean"], "KL to reference": ["kl/k1", "kl/k3", "kl/exact"],
               "PPO": ["ppo/clipfrac", "ppo/approx_kl"], "engine vs learner": ["mismatch/max_abs_diff"]}


@dataclass
class Run:
    """Everything the cycle holds (built by :func:`setup`)."""

    cfg: PPOConfig
    run_dir: Path
    tok: PreTrainedTokenizerBase
    engine: Engine | None  # None on ranks > 0 of a torchrun job
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # frozen reference (the policy at step 0); None when no step needs it in PyTorch
    value_head: ValueHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    prompts: list  # training prompts: text or chat messages (data.prompts)
    prompt_ids: list[list[int]]  # rendered (chat template) and tokenized
    reward_fn: list[NamedReward]  # (a bare callable is taken as one reward: tests, library use)
    kl: KLCoef  # the KL penalty's coefficient (adaptive: changes every step), its one owner
    data: PromptSet | None = None  # the training prompts with their dataset columns
    eval_set: PromptSet | None = None  # held-out prompts with their columns (eval_split / eval_fraction)
    eval_ids: list[list[int]] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # the chat template's end-of-turn token(s): generation stops there too
    start_step: int = 0
    data_position: int = 0  # prompts consumed so far (the next step starts at this one)
    tis_warned: bool = False  # the small-TIS-weights warning is given once per run
    sync: WeightSync | None = None  # the engine's pushes and their checks (rank 0; refit.learner.run.sync)
    ref_engine: Engine | None = None  # the frozen reference on an engine (ref_backend onnxruntime), else None
    ahead: RolloutAhead | None = None  # rollout.max_staleness >= 1: the next step's batch, generated in the background
    learner_threads: int | None = None  # with ``ahead``: the learner's torch threads in a step (the engine: the rest)
    dist: DistContext = field(default_factory=DistContext)  # [dist] this process's rank (torchrun); 1 = plain
    reward_log: RewardLog = field(default_factory=RewardLog)  # TRL's log_metric / log_extra, flushed every step
    geometry: Geometry | None = None  # the policy's shape, for the update's micro-batch rows (refit.core.memory)
    ref_sync: RefSync | None = None  # sync_ref_model: the reference mixed with the policy (refit.learner.ppo.refsync)


def setup(cfg: PPOConfig, resume: bool, log=print, dist: DistContext | None = None,
          rewards: list[NamedReward] | None = None) -> Run:
    """Everything the cycle holds; ``rewards``: already loaded (callables from Python), else ``cfg``'s specs."""
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model.model_dir)
    tok = load_tokenizer(cfg.model.model_dir, info)
    dist = dist or DistContext()  # [dist] ranks > 0 hold no engine: rank 0 drives the rollouts
    device = dist.device or pick_device(cfg.run.device)
    cfg = settle_precision(cfg, device, log)  # run.precision, lora.base_dtype, rollout.quantize: auto resolved, one line
    data, held = load_prompt_sets(cfg)
    chat = cfg.data.chat_template_kwargs
    prompt_ids = encode_prompts(tok, data.prompts, info.max_positions, cfg.response_length, data.source, chat)
    eval_ids = (encode_prompts(tok, held.prompts, info.max_positions, cfg.response_length, held.source, chat)
                if held else [])
    if cfg.eval_steps and held is None:
        raise RefitError("eval_steps needs held-out prompts: set data.eval_split or data.eval_fraction with a dataset")
    max_len = max(len(p) for p in prompt_ids + eval_ids) + cfg.response_length + 8
    shards_auto = cfg.rollout.engine_shards == 0
    cfg = resolve_shards(cfg, log)
    engine = None  # [dist] ranks > 0 hold no engine
    overlap = cfg.rollout.max_staleness > 0 and dist.is_main
    engine_cfg, learner_threads = (overlap_threads(cfg, log) if overlap else
                                   (decode_threads(cfg, log) if shards_auto else cfg, None))
    if dist.is_main:
        engine = engine_for_model(engine_cfg, cfg.model.model_dir, cfg.model.engine_dir or run_dir / "engine",
                                  cfg.run.batch_size * cfg.num_generations, max_len, log, lora=cfg.lora)
    policy = load_model(cfg.model.model_dir, info).to(device)
    if cfg.lora.enabled:  # an adapter over the frozen base (PEFT); the engine takes the adapter only
        policy = apply_lora(policy, cfg.lora, cfg.run.seed)
    use_cpu_matmul(policy, cfg.run.cpu_matmul, device)
    ref = torch_reference(cfg, policy, info, device, dist.is_main)
    critic = cfg.advantage_estimator == "gae"  # rloo / grpo: no value head in the update
    value_head = ValueHead(hidden_size(policy)).to(device).requires_grad_(critic)
    optimizer, scheduler = make_optimizer(cfg, policy, value_head if critic else None)
    rewards = rewards or load_rewards(list(cfg.reward_funcs) or [cfg.reward], list(cfg.reward_weights))
    if not resume:
        (run_dir / "completions.jsonl").unlink(missing_ok=True)  # log_extra rows of an earlier run here
    run = Run(cfg=cfg, run_dir=run_dir, tok=tok, engine=engine, policy=policy, ref=ref, value_head=value_head,
              optimizer=optimizer, scheduler=scheduler, prompts=data.prompts, prompt_ids=prompt_ids,
              reward_fn=rewards, kl=KLCoef(cfg.kl_coef, cfg.target if cfg.adap_kl_ctrl else None, cfg.horizon), data=data, eval_set=held, eval_ids=eval_ids,
              stop_ids=end_of_turn_ids(tok), dist=dist, learner_threads=learner_threads,
              geometry=geometry(cfg.model.model_dir),
              ref_sync=reference_sync(cfg, ref, info, device) if ref is not None or dist.is_main else None)
    ck = None
    # the probe batch: greedy from the engine as exported, before a resumed run pushes its checkpoint (the same batch
    # in every process of the run)
    probe = make_probe(engine, prompt_ids, cfg.rollout, cfg.response_length, run.stop_ids) if engine else None
    if resume:
        ck, state = resume_latest(run_dir, policy, value_head, optimizer, scheduler, log)
        restore_reference(run.ref_sync, ck)  # sync_ref_model's mixed reference (nothing without one)
        run.start_step, run.kl.value = state["step"], state["kl_coef"]
        run.data_position = state.get("data_position", run.start_step * cfg.run.batch_size)
        if engine is not None:  # the checkpoint's weights, under the version the engine had then
            push_checkpoint(engine, policy, state.get("engine_weights_version"))
            # checked by the first rollout (Contract.check_on_rollout; else by no probe until a push; overlapped: on
            # the probe batch, below)
            log(f"refit ppo: resumed from {ck} (step {run.start_step}, data position {run.data_position}, "
                f"engine weights_version {engine.weights_version})")
    dist.wrap(policy, value_head if critic else None)  # [dist] DDP (a no-op for one process)
    if engine is not None:
        connect_engine(run, probe, ck, overlap, max_len)
    return run


def connect_engine(run: Run, probe: RolloutBatch, ck: Path | None, overlap: bool, max_len: int) -> None:
    """The engine's side of :func:`setup`: the contract the pushes are checked by, the reference engine, the sync
    room; an overlapped resumed run's checkpoint checked on the probe batch and its batch in flight taken back."""
    cfg, run_dir, engine, policy, learner_threads = run.cfg, run.run_dir, run.engine, run.policy, run.learner_threads
    # an int8 engine: the probe compares it with the learner quantized as the engine is, on the probe batch, not on
    # the rollout (its fp32 log-probs differ); overlapped: the next rollout comes from older weights than the push
    int8 = Manifest.read(cfg.model.engine_dir or run_dir / "engine") if cfg.rollout.quantize != "none" else None
    # a bf16 LoRA base: the rollout's log-probs (the engine's fp32 arithmetic) differ from the update's (bf16) by
    # rounding, so a push is checked on the probe batch, computed in fp32 (refit.learner.run.sync.probe_learner_side)
    contract = Contract(temperature=cfg.sampling.temperature, probe_tol=cfg.rollout.probe_tol, int8_manifest=int8,
                        check_on_rollout=cfg.probe_on_rollout and not overlap and int8 is None
                        and not cfg.lora.bf16_base and not cfg.optim.neftune_noise_alpha)  # NEFTune: noisy old lp
    if needs_reference(cfg, cfg.kl_coef):
        run.ref_engine = reference_engine(cfg, run_dir, rows=cfg.run.batch_size * cfg.num_generations,
                                          max_len=max_len, threads=learner_threads, policy_engine=engine)
        if run.ref_sync is not None:
            run.ref_sync.attach(run.ref_engine)
    run.ahead = RolloutAhead(engine) if overlap else None
    run.sync = WeightSync(engine, probe, contract, run_dir, ahead=run.ahead,
                          unchecked=ck is not None and contract.check_on_rollout)
    if overlap:
        if ck is not None:  # the checkpoint's weights checked on the probe batch; its batch in flight taken back
            run.sync.check_now(policy)
            if (ck / PENDING_FILE).is_file():
                pending = torch.load(ck / PENDING_FILE, weights_only=False)
                run.ahead.restore(pending["step"], pending["batch"], pending.get("pushed", []))


def experience(run: Run, rollout: RolloutBatch, scores: torch.Tensor, policy_out: ForwardOut | None = None,
               ref_ahead: ReferenceAhead | None = None, per_func: list | None = None
               ) -> tuple[Experience, dict[str, float]]:
    """:func:`refit.learner.ppo.update.make_experience` on the run's models (the reference: its engine when it
    scores on one, else the PyTorch reference) at the current KL coefficient."""
    critic = run.cfg.advantage_estimator == "gae"
    ref = run.ref_engine if run.ref_engine is not None else run.ref
    return make_experience(run.cfg, run.policy, run.value_head if critic else None, ref, rollout, scores,
                           run.kl.value, policy_out, ref_ahead, per_func)


def reference_beside(run: Run, rollout: RolloutBatch) -> ReferenceAhead | None:
    """``reference_ahead`` with the reference on an engine: its scoring started on a thread of its own (ONNX Runtime
    releases the GIL) before the policy's forward, which it then runs beside; else None (scored in turn)."""
    cfg = run.cfg
    if not (cfg.reference_ahead and run.ref_engine is not None and needs_reference(cfg, run.kl.value)):
        return None
    return ReferenceAhead(run.ref_engine, rollout, score_chunks(rollout.num_rows), cfg.sampling.temperature,
                          vocab_size(run.policy), ahead=True)


def on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).is_cuda


def update_settings(cfg: PPOConfig, kl_coef: float, on_cuda: bool) -> UpdateSettings:
    """The update's knobs from ``cfg``, at the current (adaptive) ``kl_coef``; bf16 autocast as ``cfg`` resolved it."""
    return UpdateSettings(num_ppo_epochs=cfg.num_ppo_epochs, num_mini_batches=cfg.num_mini_batches,
                          gradient_accumulation_steps=cfg.optim.gradient_accumulation_steps,
                          cliprange=cfg.cliprange, cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef,
                          entropy_coef=cfg.entropy_coef, max_grad_norm=cfg.optim.max_grad_norm,
                          temperature=cfg.sampling.temperature, kl_coef=kl_coef, kl_in_loss=cfg.kl_penalty == "loss",
                          kl_estimator=cfg.kl_estimator, use_critic=cfg.advantage_estimator == "gae",
                          autocast_bf16=mixed_bf16(cfg), loss_type=cfg.loss_type,
                          cliprange_high=cfg.cliprange_high, delta=cfg.delta,
                          importance_sampling_level=cfg.importance_sampling_level,
                          top_entropy_quantile=cfg.top_entropy_quantile,
                          off_policy_mask_threshold=cfg.off_policy_mask_threshold,
                          kl_bias_correction=cfg.kl_bias_correction, max_completion_length=cfg.response_length,
                          sapo_temperatures=tuple(cfg.sapo_temperatures), vespo_params=tuple(cfg.vespo_params),
                          minibatch_order=cfg.minibatch_order)


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
        nidx, nsampling = step_batch(run, step + 1, run.data_position)
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
    cfg = run.cfg
    update_gen = torch.Generator().manual_seed(cfg.run.seed * 1_000_033 + step)  # minibatch order, same on every rank
    if not run.dist.is_main:  # [dist] ranks > 0: rank 0's experience, this rank's slice of the update, no metrics
        exp, run.kl.value = run.dist.share((None, run.kl.value))
        with neftune(run.policy, cfg.optim.neftune_noise_alpha):  # NEFTune in the training forwards (else no-op)
            distributed_ppo_update(run.dist, run.policy, run.value_head, run.optimizer, run.scheduler, exp,
                                   update_settings(cfg, run.kl.value, on_cuda(run.policy)), update_gen,
                                   ref_model=run.ref)
        return {}
    timings = {}
    t0 = time.perf_counter()
    state = trainer_state(cfg, len(run.prompts), run.data_position, step)
    idx, sampling = step_batch(run, step, run.data_position)  # 1.
    run.data_position += cfg.run.batch_size
    rollout, lag = rollout_phase(run, step, idx, sampling, timings)
    timings["time/rollout"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores, reward_stats, per_func = reward_phase(run, step, rollout, idx, state)  # 2.
    timings["time/reward"] = time.perf_counter() - t1
    with neftune(run.policy, cfg.optim.neftune_noise_alpha):  # NEFTune: the learner's forwards of 3. and 4.
        stats, upd = learn_phase(run, step, rollout, scores, lag, update_gen, timings, per_func)  # 3. and 4.
    check_finite(upd, f"loss at step {step}", run.run_dir)
    if "kl/k1_seq" in stats:  # the reference was scored (needs_reference)
        run.kl.adapt(stats["kl/k1_seq"], rollout.num_rows)
    run.sync.after_update(run.policy, due(step, cfg.rollout.sync_every, cfg.run.steps), step == cfg.run.steps,
                          stats, timings)  # 5.
    tell_mismatch(run, step, stats, sampling, log)  # 6.
    tokens = float(rollout.response_mask.sum())
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            **reward_stats, **stats, **{f"ppo/{k}": v for k, v in upd.items()}, "kl/coef": run.kl.value,
            "response/length": tokens / rollout.num_rows, "engine/weights_version": run.sync.version,
            "tokens_per_s": tokens / max(timings.get("time/generate") or timings["time/rollout"], 1e-9), **timings,
            "time/step": time.perf_counter() - t0}


def learn_phase(run: Run, step: int, rollout: RolloutBatch, scores: torch.Tensor, lag: int,
                update_gen: torch.Generator, timings: dict[str, float], per_func: list | None = None,
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Steps 3 and 4: the experience (learner log-probs, reference, advantages; the check of an unchecked push
    before any update uses the batch) and the PPO update; (experience stats, update stats). Where the step allows
    it (refit.learner.ppo.onepass.streamable) both come from one learner pass, micro-batch by micro-batch
    (time/score is then 0: the scoring is inside time/update); else a scoring pass, then the update."""
    cfg = run.cfg
    settings = replace(update_settings(cfg, run.kl.value, on_cuda(run.policy)), micro_rows=micro_rows(run, rollout))
    ref = run.ref_engine if run.ref_engine is not None else run.ref

    def check(stats: dict[str, float]) -> None:  # before any update uses the batch
        if run.ahead is not None:
            stats["mismatch/version_lag"] = float(lag)
        checked = run.sync.check_rollout(rollout, stats["mismatch/max_abs_diff"])
        if checked is not None:
            stats["probe/max_abs_logprob_diff"] = checked

    t1 = time.perf_counter()
    if streamable(cfg, settings, run.dist.enabled, run.kl.value):
        with adapter_dropout(run.policy):  # (no-op: streamable needs LoRA dropout 0)
            _, stats, upd = onepass_update(cfg, settings, run.policy, run.optimizer, run.scheduler, rollout, scores,
                                           ref, run.kl.value, before_step=check, per_func=per_func)
        timings["time/score"], timings["time/update"] = 0.0, time.perf_counter() - t1
        return stats, upd
    # single pass: the update's forward runs now and also gives the old log-probs (time/score holds it)
    # (LoRA dropout > 0: the update's forward has dropout, the old log-probs must not: two passes)
    one_pass = (cfg.single_pass and single_pass(settings, run.dist.enabled, rollout.num_rows)
                and not cfg.lora.dropout > 0)
    beside = reference_beside(run, rollout)
    try:
        fwd = policy_forward(run.policy, run.value_head, rollout, settings) if one_pass else None
        exp, stats = experience(run, rollout, scores, fwd, beside, per_func)
    finally:
        if beside is not None:
            beside.close()
    check(stats)
    timings["time/score"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    exp, _ = run.dist.share((exp, run.kl.value))  # [dist] to ranks > 0 (no-op for one process)
    with adapter_dropout(run.policy):  # LoRA dropout in the update's forward only (a no-op without it)
        upd = distributed_ppo_update(run.dist, run.policy, run.value_head, run.optimizer, run.scheduler, exp,
                                     settings, update_gen, ref_model=run.ref, forward=fwd)  # [dist] one process
    del fwd  # its autograd graph is freed by the backward; drop the logits too
    timings["time/update"] = time.perf_counter() - t2
    return stats, upd


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
    state = {"kl_coef": run.kl.value, "data_position": run.data_position,
             "engine_weights_version": run.engine.weights_version}
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
    hooks = run.reward_log.kwargs(trainer_state(run.cfg, len(run.prompts), run.data_position, step, evaluating=True))
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
