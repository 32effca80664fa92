"""The PPO run built once: :func:`setup` makes the :class:`Run` (what is fixed for the run: config, tokenizer,
models, engines, prompts, the update route) and its :class:`StepState` (what changes step by step), in its seams:
the prompts, the policy's engine, the learner's models, a resume, the engine's side (contract, reference engine,
sync room, the rollout thread), and the update route (refit.learner.ppo.route), logged in one line."""

from __future__ import annotations

from dataclasses import dataclass, field
import gc
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from refit.core.errors import RefitError
from refit.core.hf_folder import LEARNER_ATTN, ModelInfo, load_model, load_tokenizer, model_info
from refit.core.manifest import Manifest
from refit.core.memory import Geometry, geometry, release_freed_memory
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.data import load_prompt_sets
from refit.learner.ppo.models import (decode_threads, engine_dir, engine_rows, make_optimizer, overlap_threads,
                                      reference_engine, resolve_shards, torch_reference)
from refit.learner.ppo.overlap import PENDING_FILE, RolloutAhead
from refit.learner.ppo.refsync import RefSync, reference_sync, restore_reference
from refit.learner.ppo.rewards import NamedReward, RewardLog, load_rewards
from refit.learner.ppo.route import UpdateRoute, choose_route, on_cuda, update_settings
from refit.learner.ppo.experience import needs_reference
from refit.learner.ppo.update import EntropyCoef, KLCoef
from refit.learner.run.activations import learner_kernels
from refit.learner.run.chat import encode_prompts, end_of_turn_ids
from refit.learner.run.checkpoint import resume_latest
from refit.learner.run.dataset import PromptSet
from refit.learner.run.distributed import DistContext
from refit.learner.run.engines import engine_folder, engine_for_model, pick_device
from refit.learner.run.lora import apply_lora, hold_int8
from refit.learner.run.policy import ValueHead, hidden_size
from refit.learner.run.precision import settle_precision
from refit.learner.run.sync import Contract, WeightSync, make_probe, push_checkpoint
from refit.rollout.engine import Engine
from refit.rollout.types import RolloutBatch


@dataclass
class StepState:
    """What changes as the run goes, step by step (the checkpoint's state.json keeps what a resume needs)."""

    kl: KLCoef  # the KL penalty's coefficient (adaptive: changes every step), its one owner
    entropy: EntropyCoef  # a TRL loss type's entropy bonus coefficient (adaptive: changes every optimizer step)
    data_position: int = 0  # prompts consumed so far (the next step starts at this one)
    tis_warned: bool = False  # the small-TIS-weights warning is given once per run
    route_told: bool = False  # a step the update route declined (run as score-then-update) is told once per run


@dataclass(frozen=True)
class Run:
    """What the cycle holds, fixed for the run (built once by :func:`setup`); what changes step by step is in
    ``state``. The objects here own their own moving parts: the models and the optimizer their weights, the sync room
    the weights version, ``ahead`` the batch in flight, ``reward_log`` the step's logged values."""

    cfg: PPOConfig
    run_dir: Path
    tok: PreTrainedTokenizerBase
    engine: Engine | None  # None on ranks > 0 of a torchrun job
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # frozen reference (the policy at step 0); None when no step needs it in PyTorch
    value_head: ValueHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    route: UpdateRoute  # how a step's experience and update run (refit.learner.ppo.route), chosen once
    state: StepState  # what changes per step
    prompts: list  # training prompts: text or chat messages (data.prompts)
    prompt_ids: list[list[int]]  # rendered (chat template) and tokenized
    reward_fn: list[NamedReward]  # (a bare callable is taken as one reward: tests, library use)
    start_step: int = 0  # the step a resumed run continues after (0: a fresh run)
    data: PromptSet | None = None  # the training prompts with their dataset columns
    eval_set: PromptSet | None = None  # held-out prompts with their columns (eval_split / eval_fraction)
    eval_ids: list[list[int]] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # the chat template's end-of-turn token(s): generation stops there too
    sync: WeightSync | None = None  # the engine's pushes and their checks (rank 0; refit.learner.run.sync)
    ref_engine: Engine | None = None  # the frozen reference on an engine (ref_backend onnxruntime), else None
    ahead: RolloutAhead | None = None  # rollout.max_staleness >= 1: the next step's batch, generated in the background
    learner_threads: int | None = None  # with ``ahead``: the learner's torch threads in a step (the engine: the rest)
    dist: DistContext = field(default_factory=DistContext)  # [dist] this process's rank (torchrun); 1 = plain
    reward_log: RewardLog = field(default_factory=RewardLog)  # TRL's log_metric / log_extra, flushed every step
    geometry: Geometry | None = None  # the policy's shape, for the update's micro-batch rows (refit.core.memory)
    ref_sync: RefSync | None = None  # sync_ref_model: the reference mixed with the policy (refit.learner.ppo.refsync)


class Prompts(NamedTuple):
    """The run's prompts, rendered and tokenized (:func:`prompt_sets`)."""

    data: PromptSet  # the training prompts with their dataset columns
    held: PromptSet | None  # held-out prompts (eval_split / eval_fraction)
    ids: list[list[int]]
    eval_ids: list[list[int]]
    max_len: int  # the longest prompt plus response_length (and 8): the engine's positions


class Learner(NamedTuple):
    """The learner's models and optimizer (:func:`learner_models`)."""

    policy: torch.nn.Module
    ref: torch.nn.Module | None
    value_head: ValueHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: bool  # advantage_estimator gae: the value head trains


class EngineSide(NamedTuple):
    """What rank 0 holds beside its engine (:func:`connect_engine`)."""

    sync: WeightSync | None = None
    ref_engine: Engine | None = None
    ahead: RolloutAhead | None = None


def setup(cfg: PPOConfig, resume: bool, log=print, dist: DistContext | None = None,
          rewards: list[NamedReward] | None = None) -> Run:
    """Everything the cycle holds; ``rewards``: already loaded (callables from Python), else ``cfg``'s specs."""
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model.model_dir)
    tok = load_tokenizer(cfg.model.model_dir, info)
    dist = dist or DistContext()  # [dist] ranks > 0 hold no engine: rank 0 drives the rollouts
    device = dist.device or pick_device(cfg.run.device)
    cfg = settle_precision(cfg, device, log, processes=dist.world_size)  # the auto precisions resolved, one line
    p = prompt_sets(cfg, tok, info)
    state = StepState(kl=KLCoef(cfg.kl_coef, cfg.target if cfg.adap_kl_ctrl else None, cfg.horizon),
                      entropy=EntropyCoef(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta,
                                          cfg.entropy_coef_min, cfg.entropy_coef_max))
    if cfg.lora.base_dtype == "int8":  # the engine's folder first (its manifest names the twins), then the learner
        # held in int8 with its checkpoint's file mapping released, then the engine's sessions: the fp32 base and
        # the engine are never resident together
        src = engine_folder(cfg, cfg.model.model_dir, engine_dir(cfg, run_dir), engine_rows(cfg), p.max_len, log,
                            cfg.lora)
        m = learner_models(cfg, info, device, dist.is_main, state.kl.value)
        cfg, engine, learner_threads = policy_engine(cfg, dist, run_dir, p.max_len, log, src)
    else:
        cfg, engine, learner_threads = policy_engine(cfg, dist, run_dir, p.max_len, log)
        m = learner_models(cfg, info, device, dist.is_main, state.kl.value)
    rewards = rewards or load_rewards(list(cfg.reward_funcs) or [cfg.reward], list(cfg.reward_weights))
    if not resume:
        (run_dir / "completions.jsonl").unlink(missing_ok=True)  # log_extra rows of an earlier run here
    ref_sync = reference_sync(cfg, m.ref, info, device) if m.ref is not None or dist.is_main else None
    stop_ids = end_of_turn_ids(tok)
    # the probe batch: greedy from the engine as exported, before a resumed run pushes its checkpoint (the same batch
    # in every process of the run)
    probe = make_probe(engine, p.ids, cfg.rollout, cfg.response_length, stop_ids) if engine else None
    ck, start_step = resume_run(cfg, run_dir, m, ref_sync, engine, state, log) if resume else (None, 0)
    dist.wrap(m.policy, m.value_head if m.critic else None)  # [dist] DDP (a no-op for one process)
    side = (connect_engine(cfg, run_dir, engine, m.policy, probe, ck, p.max_len, learner_threads, ref_sync,
                           state.kl.value) if engine is not None else EngineSide())
    route = choose_route(cfg, update_settings(cfg, state.kl.value, on_cuda(m.policy), state.entropy), dist.enabled,
                         state.kl.value)
    if dist.is_main:
        log(f"refit ppo: update route {route.name} ({route.why})")
    return Run(cfg=cfg, run_dir=run_dir, tok=tok, engine=engine, policy=m.policy, ref=m.ref, value_head=m.value_head,
               optimizer=m.optimizer, scheduler=m.scheduler, route=route, state=state, prompts=p.data.prompts,
               prompt_ids=p.ids, reward_fn=rewards, start_step=start_step, data=p.data, eval_set=p.held,
               eval_ids=p.eval_ids, stop_ids=stop_ids, sync=side.sync, ref_engine=side.ref_engine, ahead=side.ahead,
               learner_threads=learner_threads, dist=dist, geometry=geometry(cfg.model.model_dir), ref_sync=ref_sync)


def prompt_sets(cfg: PPOConfig, tok: PreTrainedTokenizerBase, info: ModelInfo) -> Prompts:
    """The training and held-out prompts, rendered (chat template) and tokenized."""
    data, held = load_prompt_sets(cfg)
    chat = cfg.data.chat_template_kwargs
    ids = encode_prompts(tok, data.prompts, info.max_positions, cfg.response_length, data.source, chat)
    eval_ids = (encode_prompts(tok, held.prompts, info.max_positions, cfg.response_length, held.source, chat)
                if held else [])
    if cfg.eval_steps and held is None:
        raise RefitError("eval_steps needs held-out prompts: set data.eval_split or data.eval_fraction with a dataset")
    return Prompts(data, held, ids, eval_ids, max(len(q) for q in ids + eval_ids) + cfg.response_length + 8)


def policy_engine(cfg: PPOConfig, dist: DistContext, run_dir: Path, max_len: int, log,
                  src: Path | None = None) -> tuple[PPOConfig, Engine | None, int | None]:
    """The policy's engine (rank 0; exported or reused) with its threads and shards resolved; (the config with
    them, the engine or None, the learner's torch threads in an overlapped step or None)."""
    shards_auto = cfg.rollout.engine_shards == 0
    cfg = resolve_shards(cfg, log)
    overlap = cfg.rollout.max_staleness > 0 and dist.is_main
    engine_cfg, learner_threads = (overlap_threads(cfg, log) if overlap else
                                   (decode_threads(cfg, log) if shards_auto else cfg, None))
    if not dist.is_main:  # [dist] ranks > 0 hold no engine
        return cfg, None, learner_threads
    engine = engine_for_model(engine_cfg, cfg.model.model_dir, engine_dir(cfg, run_dir), engine_rows(cfg), max_len,
                              log, lora=cfg.lora, src=src)
    return cfg, engine, learner_threads


def learner_models(cfg: PPOConfig, info: ModelInfo, device, main: bool, kl_coef: float) -> Learner:
    """The policy (a LoRA adapter over its frozen base with ``lora.r``), the PyTorch reference where one scores, the
    value head (trained with gae) and their optimizer and schedule."""
    policy = load_model(cfg.model.model_dir, info, attn=LEARNER_ATTN).to(device)
    if cfg.lora.enabled:  # an adapter over the frozen base (PEFT); the engine takes the adapter only
        policy = apply_lora(policy, cfg.lora, cfg.run.seed)
        if cfg.lora.base_dtype == "int8":  # the base as the int8 engine holds it (rank 0 exported it already)
            hold_int8(policy, Manifest.read(engine_dir(cfg, Path(cfg.run.output_dir))))
            gc.collect()
            release_freed_memory()  # the fp32 base's pages back to the system (a heap kept by an engine keeps them)
    learner_kernels(policy, cfg.run.cpu_matmul, device)  # oneDNN linears, the fused GELU
    ref = torch_reference(cfg, policy, info, device, main, kl_coef)
    critic = cfg.advantage_estimator == "gae"  # rloo / grpo: no value head in the update
    value_head = ValueHead(hidden_size(policy)).to(device).requires_grad_(critic)
    optimizer, scheduler = make_optimizer(cfg, policy, value_head if critic else None)
    return Learner(policy, ref, value_head, optimizer, scheduler, critic)


def resume_run(cfg: PPOConfig, run_dir: Path, m: Learner, ref_sync: RefSync | None, engine: Engine | None,
               state: StepState, log) -> tuple[Path, int]:
    """``--resume``: the newest intact checkpoint into the models, the optimizer, the mixed reference and the step
    state, its weights pushed into the engine under the version the engine had then; (the checkpoint, its step)."""
    ck, saved = resume_latest(run_dir, m.policy, m.value_head, m.optimizer, m.scheduler, log)
    restore_reference(ref_sync, ck)  # sync_ref_model's mixed reference (nothing without one)
    start_step, state.kl.value = saved["step"], saved["kl_coef"]
    if "entropy_coef" in saved:  # the adaptive entropy controller (a fixed coefficient saves nothing: the config)
        state.entropy.value, state.entropy.last_entropy = saved["entropy_coef"], saved["last_world_entropy"]
    state.data_position = saved.get("data_position", start_step * cfg.run.batch_size)
    if engine is not None:
        push_checkpoint(engine, m.policy, saved.get("engine_weights_version"))
        # checked by the first rollout (Contract.check_on_rollout; else by no probe until a push; overlapped: on the
        # probe batch, in connect_engine)
        log(f"refit ppo: resumed from {ck} (step {start_step}, data position {state.data_position}, "
            f"engine weights_version {engine.weights_version})")
    return ck, start_step


def connect_engine(cfg: PPOConfig, run_dir: Path, engine: Engine, policy: torch.nn.Module, probe: RolloutBatch,
                   ck: Path | None, max_len: int, learner_threads: int | None, ref_sync: RefSync | None,
                   kl_coef: float) -> EngineSide:
    """The engine's side of :func:`setup`: the contract the pushes are checked by, the reference engine, the sync
    room; an overlapped resumed run's checkpoint checked on the probe batch and its batch in flight taken back."""
    overlap = cfg.rollout.max_staleness > 0
    # an int8 engine: the probe compares it with the learner quantized as the engine is, on the probe batch, not on
    # the rollout (its fp32 log-probs differ); overlapped: the next rollout comes from older weights than the push
    int8 = Manifest.read(engine_dir(cfg, run_dir)) if cfg.rollout.quantize != "none" else None
    # a bf16 LoRA base: the rollout's log-probs (the engine's fp32 arithmetic) differ from the update's (bf16) by
    # rounding, so a push is checked on the probe batch, computed in fp32 (refit.learner.run.sync.probe_learner_side)
    contract = Contract(temperature=cfg.sampling.temperature, probe_tol=cfg.rollout.probe_tol, int8_manifest=int8,
                        check_on_rollout=cfg.probe_on_rollout and not overlap and int8 is None
                        and not cfg.lora.low_base and not cfg.optim.neftune_noise_alpha)  # NEFTune: noisy old lp
    ref_engine = None
    if needs_reference(cfg, kl_coef):
        ref_engine = reference_engine(cfg, run_dir, rows=engine_rows(cfg),
                                      max_len=max_len, threads=learner_threads, policy_engine=engine)
        if ref_sync is not None:
            ref_sync.attach(ref_engine)
    ahead = RolloutAhead(engine) if overlap else None
    sync = WeightSync(engine, probe, contract, run_dir, ahead=ahead,
                      unchecked=ck is not None and contract.check_on_rollout)
    if overlap:
        if ck is not None:  # the checkpoint's weights checked on the probe batch; its batch in flight taken back
            sync.check_now(policy)
            if (ck / PENDING_FILE).is_file():
                pending = torch.load(ck / PENDING_FILE, weights_only=False)
                ahead.restore(pending["step"], pending["batch"], pending.get("pushed", []))
    return EngineSide(sync, ref_engine, ahead)



__all__ = ["Run", "StepState", "setup"]
