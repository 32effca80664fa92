"""The PPO-KL export/train cycle.

    export (or reuse) the policy engine
    -> every step: 1. generate on the engine   2. reward + learner log-probs (policy, reference)
                   3. PPO update                4. every ``sync_every`` steps push weights into the
                   engine and score a fixed probe batch on both sides (stop on disagreement)
                   5. checkpoint every ``save_steps`` steps (atomic)   6. metrics.jsonl / TensorBoard

Every random choice of step ``s`` (prompt order, sampling seed, minibatch order) is derived
from ``(seed, s)``, so ``--resume`` from a checkpoint reproduces the uninterrupted run's metrics.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from export.checkpoint import load_model, load_tokenizer, model_info
from export.errors import RefitError
from export.weight_map import canonical_params
from learner import losses as L
from learner.checkpoint import latest_checkpoint, resume_latest, save_checkpoint
from learner.config import PPOConfig, save_config
from learner.distributed import DistContext, init_from_env
from learner.metrics import MetricsLog, plot_metrics
from learner.mismatch import describe, explain_negative_kl, mismatch_stats, name_mismatch
from learner.policy import ValueHead, hidden_size
from learner.ppo import Experience, UpdateSettings, learner_view, make_advantages, per_token_rewards, score_batch
from learner.rewards import load_reward
from rollout.engine import check_version, create_engine
from rollout.types import SamplingParams

PLOT_PANELS = {"reward": ["reward/mean"], "KL to reference": ["kl/k1", "kl/k3", "kl/exact"],
               "PPO": ["ppo/clipfrac", "ppo/approx_kl"], "engine vs learner": ["mismatch/max_abs_diff"]}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RefitError("device=cuda asked for, but no CUDA device is visible")
    return torch.device(name)


def load_prompts(cfg) -> list[str]:
    if cfg.prompts_file:
        p = Path(cfg.prompts_file)
        if not p.exists():
            raise RefitError(f"prompts file {p} does not exist")
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        if not lines:
            raise RefitError(f"prompts file {p} holds no prompts")
        return lines
    from learner.tasks import TASKS

    kw = {"max_operand": cfg.max_operand} if cfg.task == "addition" else {}
    return [e.prompt for e in TASKS[cfg.task](cfg.num_prompts, seed=cfg.seed, **kw)]


def step_prompt_indices(n_prompts: int, batch: int, step: int, seed: int) -> list[int]:
    """Prompt indices of step ``step`` (1-based): epochs of a seeded permutation, no state."""
    out = []
    for pos in range((step - 1) * batch, step * batch):
        epoch, i = divmod(pos, n_prompts)
        perm = list(range(n_prompts))
        random.Random(seed * 7919 + epoch).shuffle(perm)
        out.append(perm[i])
    return out


def decode_responses(tok, batch) -> list[str]:
    """Response text without the stop token and padding."""
    stops = batch.stop_set()
    out = []
    for ids, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
        kept = [t for t, k in zip(ids, m) if k and t not in stops]
        out.append(tok.decode(kept, skip_special_tokens=True))
    return out


@dataclass
class Run:
    """Everything the cycle holds (built by :func:`setup`)."""

    cfg: PPOConfig
    run_dir: Path
    tok: object
    engine: object
    policy: torch.nn.Module
    ref: torch.nn.Module
    value_head: ValueHead
    optimizer: torch.optim.Optimizer
    scheduler: object
    prompts: list[str]
    prompt_ids: list[list[int]]
    reward_fn: object
    kl_coef: float
    start_step: int = 0
    expected_version: int = 0
    probe: object = None
    dist: DistContext = field(default_factory=DistContext)  # [dist] this process's rank (torchrun); 1 = plain


def ensure_engine(model_dir: Path, engine_dir: Path, rows: int, max_len: int, log=print,
                  backend: str = "onnxruntime") -> Path:
    """Reuse ``engine_dir`` if it was exported from these exact weights and is large enough, else export.

    For ``backend="tensorrt"`` the refittable TensorRT plans are built (or reused) on top of the ONNX
    graphs; where TensorRT is absent this fails at once, in one line, before any export.
    """
    from export.graph import MANIFEST, read_manifest
    from export.onnx_export import ExportOptions, export_onnx, weights_hash

    if backend == "tensorrt":
        from export.tensorrt_build import require_tensorrt

        require_tensorrt()
    reuse = False
    if (engine_dir / MANIFEST).exists():
        m = read_manifest(engine_dir)
        same = m["hashes"]["hf_weights_sha256"] == weights_hash(model_dir)
        reuse = same and m["dims"]["max_batch"] >= rows and m["dims"]["max_len"] >= max_len
    if reuse:
        log(f"refit: reusing engine {engine_dir} (exported from the same weights)")
    else:
        export_onnx(model_dir, engine_dir, ExportOptions(max_batch=max(rows, 64), max_len=max(max_len, 128)), log=log)
    if backend == "tensorrt":
        from export.tensorrt_build import build_engines

        build_engines(engine_dir, log=log)  # reuses plans built for the same graphs, TensorRT and GPU
    return engine_dir


def make_engine(cfg, path, run_dir: Path, gpu_share: float = 1.0, **kw):
    """One engine, or with ``rollout_workers > 1`` a RayEnginePool of that many (same Engine protocol).

    ``cfg`` is a PPOConfig or DistillConfig. Each Ray actor reserves ``rollout_worker_cpus`` CPUs and
    ``rollout_worker_gpus`` GPUs; the GPU default (-1) is ``gpu_share`` of a GPU for the tensorrt backend
    (its engine needs one), none otherwise (Ray hides the GPUs from an actor that reserved none).
    """
    if cfg.rollout_workers > 1:  # [scale-out]
        from rollout.ray_pool import RayEnginePool

        gpus = cfg.rollout_worker_gpus
        if gpus < 0:
            gpus = gpu_share if cfg.backend == "tensorrt" else 0.0
        return RayEnginePool(cfg.backend, path, workers=cfg.rollout_workers, ray_address=cfg.ray_address,
                             cpus_per_worker=cfg.rollout_worker_cpus, gpus_per_worker=gpus,
                             last_checkpoint=lambda: latest_checkpoint(run_dir), **kw)
    return create_engine(cfg.backend, path, **kw)


def setup(cfg: PPOConfig, resume: bool, log=print, dist: DistContext | None = None) -> Run:
    from transformers import get_scheduler

    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model_dir)
    tok = load_tokenizer(cfg.model_dir, info)
    dist = dist or DistContext()  # [dist] ranks > 0 hold no engine: rank 0 drives the rollouts
    device = dist.device or pick_device(cfg.device)
    prompts = load_prompts(cfg)
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    if any(len(p) == 0 for p in prompt_ids):
        raise RefitError("a prompt tokenizes to nothing (empty prompt)")
    max_len = max(len(p) for p in prompt_ids) + cfg.response_length + 8
    engine = None  # [dist] ranks > 0 hold no engine
    if dist.is_main and cfg.backend in ("torch", "hf"):  # PyTorch engines run from the HF folder, nothing to export
        engine = make_engine(cfg, cfg.model_dir, run_dir, max_len=max_len)
    elif dist.is_main:
        engine_dir = Path(cfg.engine_dir) if cfg.engine_dir else run_dir / "engine"
        ensure_engine(Path(cfg.model_dir), engine_dir, cfg.batch_size * cfg.num_generations, max_len, log,
                      backend=cfg.backend)
        engine = make_engine(cfg, engine_dir, run_dir, threads=cfg.engine_threads or None)
    policy = load_model(cfg.model_dir, info).to(device)
    ref = load_model(cfg.model_dir, info).to(device).requires_grad_(False)
    value_head = ValueHead(hidden_size(policy)).to(device)
    optimizer = torch.optim.AdamW(list(policy.parameters()) + list(value_head.parameters()),
                                  lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.num_ppo_epochs * cfg.num_mini_batches
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=total)
    run = Run(cfg, run_dir, tok, engine, policy, ref, value_head, optimizer, scheduler, prompts, prompt_ids,
              load_reward(cfg.reward), cfg.kl_coef, dist=dist)
    if resume:
        ck, state = resume_latest(run_dir, policy, value_head, optimizer, scheduler)
        run.start_step, run.kl_coef = state["step"], state["kl_coef"]
        if engine is not None:
            engine.update_weights(canonical_params(policy)[0])
            log(f"refit ppo: resumed from {ck} (step {run.start_step}, engine weights pushed)")
    dist.wrap(policy, value_head)  # [dist] DDP (a no-op for one process)
    if engine is None:
        return run
    run.expected_version = engine.weights_version
    probe_rows = list(range(min(cfg.probe_size, len(prompt_ids))))
    run.probe = engine.generate([prompt_ids[i] for i in probe_rows],
                                SamplingParams(max_new_tokens=cfg.response_length, greedy=True))
    return run


def probe_check(run: Run) -> float:
    """Score the fixed probe batch on the engine and the learner; stop the run on disagreement."""
    p, t = run.probe, run.cfg.temperature
    eng = run.engine.score(p.prompt_ids, p.prompt_mask, p.response_ids, p.response_mask, temperature=t).logprobs
    mine = learner_view(run.policy, None, p, t)[0]
    diff = float(((eng - mine).abs() * p.response_mask).max())
    if not diff <= run.cfg.probe_tol:
        raise RefitError(f"parity probe failed after weight push (engine weights_version {run.engine.weights_version}): "
                         f"max |logprob diff| {diff:.3e} > {run.cfg.probe_tol:g}; the engine did not take the new "
                         f"weights. Last checkpoint: {latest_checkpoint(run.run_dir)}")
    return diff


def experience(run: Run, rollout, scores: torch.Tensor) -> tuple[Experience, dict[str, float]]:
    """Learner log-probs, KL by every estimator, mismatch figures, rewards and advantages."""
    cfg, t = run.cfg, run.cfg.temperature
    sc = score_batch(run.policy, run.value_head, run.ref, rollout, t)  # one policy + one reference forward
    old_lp, values, entropy, ref_lp, kl_exact = sc.logprobs, sc.values, sc.entropy, sc.ref_logprobs, sc.exact_kl
    mask = rollout.response_mask.clone()
    stats = mismatch_stats(rollout, old_lp)
    is_weights = None
    if cfg.mismatch_correction == "tis":
        is_weights = L.truncated_importance_weights(old_lp, rollout.rollout_logprobs, cfg.tis_cap) * mask
    elif cfg.mismatch_correction == "seq_mask":
        drop = L.sequence_mismatch_mask(old_lp, rollout.rollout_plain_logprobs, mask, cfg.seq_mask_threshold)
        mask = mask * (~drop).float()[:, None]
        stats["mismatch/seq_masked_frac"] = float(drop.float().mean())
    kls = {k: L.kl_estimate(old_lp, ref_lp, k) for k in ("k1", "k2", "k3")}
    kls["exact"] = kl_exact
    for k, v in kls.items():
        stats[f"kl/{k}"] = float(L.masked_mean(v, rollout.response_mask))
    stats["kl/k1_seq"] = float((kls["k1"] * rollout.response_mask).sum(-1).mean())
    penalty = kls[cfg.kl_estimator] if cfg.kl_penalty == "reward" else torch.zeros_like(old_lp)
    rewards = per_token_rewards(scores, penalty, mask, run.kl_coef)
    adv, returns = make_advantages(rewards, values, mask, cfg.gamma, cfg.lam, cfg.whiten_rewards)
    stats["policy/entropy"] = float(L.masked_mean(entropy, rollout.response_mask))
    stats["value/explained_variance"] = float(L.explained_variance(values, returns, mask))
    exp = Experience(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, mask, old_lp, ref_lp, values,
                     adv, returns, is_weights)
    return exp, stats


def update_settings(run: Run) -> UpdateSettings:
    cfg = run.cfg
    return UpdateSettings(cfg.num_ppo_epochs, cfg.num_mini_batches, cfg.gradient_accumulation_steps,
                          cfg.cliprange, cfg.cliprange_value, cfg.vf_coef, cfg.entropy_coef, cfg.max_grad_norm,
                          cfg.temperature, kl_coef=run.kl_coef, kl_in_loss=cfg.kl_penalty == "loss",
                          autocast_bf16=cfg.bf16 and next(run.policy.parameters()).is_cuda)


def train_step(run: Run, step: int, log=print) -> dict[str, float]:
    cfg = run.cfg
    update_gen = torch.Generator().manual_seed(cfg.seed * 1_000_033 + step)  # minibatch order, same on every rank
    if not run.dist.is_main:  # [dist] ranks > 0: rank 0's experience, this rank's slice of the update, no metrics
        exp, run.kl_coef = run.dist.share_experience(None, run.kl_coef)
        run.dist.ppo_update(run.policy, run.value_head, run.optimizer, run.scheduler, exp, update_settings(run),
                            update_gen)
        return {}
    timings = {}
    t0 = time.perf_counter()
    idx = step_prompt_indices(len(run.prompts), cfg.batch_size, step, cfg.seed)
    sampling = SamplingParams(max_new_tokens=cfg.response_length, temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p, n=cfg.num_generations, seed=cfg.seed * 1_000_003 + step)
    rollout = run.engine.generate([run.prompt_ids[i] for i in idx], sampling)
    check_version(rollout, run.expected_version)
    timings["time/rollout"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    row_prompts = [run.prompts[idx[i]] for i in rollout.prompt_index.tolist()]
    responses = decode_responses(run.tok, rollout)
    scores = torch.tensor(run.reward_fn(row_prompts, responses), dtype=torch.float32)
    exp, stats = experience(run, rollout, scores)
    timings["time/score"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    exp, _ = run.dist.share_experience(exp, run.kl_coef)  # [dist] to ranks > 0 (no-op for one process)
    upd = run.dist.ppo_update(run.policy, run.value_head, run.optimizer, run.scheduler, exp, update_settings(run),
                              update_gen)  # [dist] plain ppo_update for one process
    bad = [k for k, v in upd.items() if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise RefitError(f"non-finite loss at step {step} ({', '.join(bad)}); nothing from this step was saved, "
                         f"last checkpoint: {latest_checkpoint(run.run_dir)}")
    timings["time/update"] = time.perf_counter() - t2
    if cfg.adap_kl_ctrl:
        run.kl_coef = L.adaptive_kl_update(run.kl_coef, stats["kl/k1_seq"], cfg.target, cfg.horizon, rollout.num_rows)
    t3 = time.perf_counter()
    if step % cfg.sync_every == 0 or step == cfg.steps:
        run.engine.update_weights(canonical_params(run.policy)[0])
        run.expected_version = run.engine.weights_version
        stats["probe/max_abs_logprob_diff"] = probe_check(run)
    timings["time/weight_push"] = time.perf_counter() - t3
    tokens = float(rollout.response_mask.sum())
    cause = name_mismatch(stats)
    if cause is not None:
        log(f"step {step}: engine/learner mismatch ({cause}): {describe(cause)}")
    if stats["kl/k1"] < -1e-6:
        log(f"step {step}: " + explain_negative_kl(stats["kl/k1"], stats["kl/exact"], stats, sampling.truncates))
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            **stats, **{f"ppo/{k}": v for k, v in upd.items()}, "kl/coef": run.kl_coef,
            "response/length": tokens / rollout.num_rows, "engine/weights_version": run.engine.weights_version,
            "tokens_per_s": tokens / max(timings["time/rollout"], 1e-9), **timings,
            "time/step": time.perf_counter() - t0}


def run_ppo(cfg: PPOConfig, resume: bool = False, log=print) -> Path:
    """Run the cycle; return the run folder (metrics.jsonl, tb/, curves.png, checkpoints/, engine/)."""
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dist = init_from_env(cfg.device)  # [dist] torchrun's RANK/WORLD_SIZE; one process: nothing changes
    main = dist.is_main  # [dist] rank 0 alone writes config, metrics, checkpoints and plots
    if main:
        log("refit ppo: resolved config\n" + save_config(cfg, run_dir / "config.yaml").rstrip())
    run = setup(cfg, resume, log, dist=dist)
    metrics = MetricsLog(run_dir, cfg.tensorboard, resume_step=run.start_step if resume else None) if main else None
    last = cfg.steps if not cfg.max_steps_this_run else min(cfg.steps, run.start_step + cfg.max_steps_this_run)
    steps = range(run.start_step + 1, last + 1)
    bar = None
    if cfg.progress and main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=run.start_step, desc="ppo", dynamic_ncols=True)
    try:
        for step in steps:
            m = train_step(run, step, log)
            if not main:  # [dist]
                continue
            metrics.log(step, m)
            if step % cfg.save_steps == 0 or step == cfg.steps:
                save_checkpoint(run_dir, step, run.policy, run.tok, run.value_head, run.optimizer, run.scheduler,
                                {"kl_coef": run.kl_coef, "data_position": step * cfg.batch_size,
                                 "engine_weights_version": run.engine.weights_version}, cfg.keep_checkpoints)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", kl=f"{m['kl/exact']:.4f}")
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if run.engine is not None:
            run.engine.close()
        dist.close()  # [dist] waits for every rank, leaves the process group
    if cfg.plots and main:
        plot_metrics(run_dir, PLOT_PANELS)
    return run_dir
