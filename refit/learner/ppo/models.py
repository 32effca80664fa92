"""The PPO run's models and engines besides the policy: the engine's shards and threads, the frozen reference (an
engine, the policy engine with its adapter off, or a PyTorch model; none when no step scores one) and the optimizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from refit.core.hf_folder import LEARNER_ATTN, ModelInfo, load_model, text_config
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.overlap import split_threads
from refit.learner.ppo.experience import needs_reference
from refit.learner.run.activations import learner_kernels
from refit.learner.run.lora import AdapterOff
from refit.learner.run.precision import mixed_bf16
from refit.learner.run.optim import adamw, schedule
from refit.rollout.build import ensure_engine
from refit.rollout.decode import SHARD_MAX_LAYER_WEIGHTS, auto_decode_threads, auto_shards, layer_weights
from refit.rollout.engine import Engine, create_engine


def overlap_threads(cfg: PPOConfig, log=print) -> tuple[PPOConfig, int]:
    """Overlapped generation (rollout.max_staleness >= 1): the engine's intra-op threads and the learner's torch
    threads share the machine; (the engine's config with its share, the learner's threads). The engine's share
    covers its shards, one thread each (they decode at once beside the learner)."""
    total = torch.get_num_threads()
    engine_threads, learner_threads = split_threads(cfg.rollout.engine_threads, total, shards=cfg.rollout.engine_shards)
    log(f"refit ppo: rollout.max_staleness {cfg.rollout.max_staleness}: generation overlapped with the update; "
        f"engine {engine_threads} intra-op thread(s), learner {learner_threads} torch thread(s) (of {total})")
    return replace(cfg, rollout=replace(cfg.rollout, engine_threads=engine_threads)), learner_threads


def torch_reference(cfg: PPOConfig, policy: torch.nn.Module, info: ModelInfo, device, main: bool, kl_coef: float):
    """The PyTorch reference: for the loss's exact KL, and for scoring when no reference engine does (``main``: the
    process that scores); a LoRA policy's is itself with the adapter off (the base, held once). None when no step
    scores a reference (``kl_coef`` 0, the run's starting coefficient, under reference auto: TRL's GRPO at beta 0
    loads none either) or an engine does."""
    wanted = needs_reference(cfg, kl_coef) and ((cfg.kl_penalty == "loss" and cfg.kl_estimator == "exact")
                                                    or (main and not ref_on_engine(cfg)))
    if not wanted:
        return None
    if cfg.lora.enabled:
        return AdapterOff(policy)
    ref = load_model(cfg.model.model_dir, info, attn=LEARNER_ATTN).to(device).requires_grad_(False)
    learner_kernels(ref, cfg.run.cpu_matmul, device)  # oneDNN linears, the fused GELU
    return ref


def make_optimizer(cfg: PPOConfig, policy: torch.nn.Module, value_head: torch.nn.Module | None):
    """AdamW over the trainable parameters (LoRA: the adapter only, at lora.learning_rate when set) and the value head
    (at optim.learning_rate; None: no critic), and its schedule over the run's optimizer steps."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    groups = [{"params": trainable, "lr": (cfg.lora.learning_rate or cfg.optim.learning_rate) if cfg.lora.enabled
               else cfg.optim.learning_rate}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters()), "lr": cfg.optim.learning_rate})
    optimizer = adamw(groups, cfg.optim)
    return optimizer, schedule(optimizer, cfg.optim, cfg.run.steps * cfg.num_ppo_epochs * cfg.num_mini_batches)


def engine_dir(cfg: PPOConfig, run_dir: Path) -> Path:
    """The policy's engine folder: ``model.engine_dir``, else the run's ``engine/``."""
    return Path(cfg.model.engine_dir or run_dir / "engine")


def engine_rows(cfg: PPOConfig) -> int:
    """The rows of one rollout: prompts a step x completions a prompt."""
    return cfg.run.batch_size * cfg.num_generations


def _rollout_shape(cfg: PPOConfig) -> tuple[int, int, int]:
    """(the rollout's rows, the engine's threads, the model's layer weights a token; a config without a text config
    counts as large): what the engine-side auto rules read."""
    text = text_config(cfg.model.model_dir)
    return (engine_rows(cfg), cfg.rollout.engine_threads or torch.get_num_threads(),
            layer_weights(text) if text is not None else SHARD_MAX_LAYER_WEIGHTS + 1)


def resolve_shards(cfg: PPOConfig, log=print) -> PPOConfig:
    """``rollout.engine_shards`` 0 (auto) made a number by :func:`refit.rollout.decode.auto_shards` from the
    rollout's rows, the model's layer weights and the engine's threads; an explicit value is kept."""
    if cfg.rollout.engine_shards:
        return cfg
    rows, threads, weights = _rollout_shape(cfg)
    shards = auto_shards(rows, weights, threads) if cfg.rollout.backend == "onnxruntime" else 1
    if shards > 1:
        log(f"refit ppo: rollout.engine_shards auto: {shards} ({rows} rows, {weights / 1e6:.2f}M layer weights a "
            f"token, {threads} engine threads)")
    return replace(cfg, rollout=replace(cfg.rollout, engine_shards=shards))


def decode_threads(cfg: PPOConfig, log=print) -> PPOConfig:
    """The policy engine's config under ``rollout.engine_shards`` auto with one shard: its intra-op threads by
    :func:`refit.rollout.decode.auto_decode_threads` (one for a small model's few rows); the reference engine and
    the learner keep theirs."""
    if cfg.rollout.backend != "onnxruntime" or cfg.rollout.engine_shards != 1:
        return cfg
    rows, threads, weights = _rollout_shape(cfg)
    n = auto_decode_threads(rows, weights, threads)
    if n == threads:
        return cfg
    log(f"refit ppo: rollout.engine_shards auto: 1 shard decoding on {n} of {threads} threads ({rows} rows, "
        f"{weights / 1e6:.2f}M layer weights a token)")
    return replace(cfg, rollout=replace(cfg.rollout, engine_threads=n))


def ref_on_engine(cfg: PPOConfig) -> bool:
    """Whether the frozen reference scores on ONNX Runtime (:func:`reference_engine`) rather than in PyTorch."""
    engine_backend = cfg.rollout.backend in ("onnxruntime", "tensorrt")
    quantized = cfg.rollout.quantize == "int8"
    # a bf16 learner (a bf16 LoRA base, or bf16 autocast): the reference computes as the policy does (the policy with
    # its adapter off, or a PyTorch copy under the same autocast), else KL(0) > 0
    low = cfg.lora.low_base or mixed_bf16(cfg)
    return not (cfg.ref_backend == "torch" or (cfg.ref_backend == "auto" and (quantized or low or not engine_backend)))


def reference_engine(cfg: PPOConfig, run_dir: Path, rows: int = 64, max_len: int = 128,
                     threads: int | None = None, policy_engine: Engine | None = None) -> Engine | None:
    """The frozen reference on ONNX Runtime over the policy's engine folder, whose weights are the step-0
    policy (pushes go into live sessions, never into the folder); None for ``ref_backend: torch``.
    ``threads``: its intra-op threads (default ``rollout.engine_threads``, shared by ``rollout.engine_shards``
    row ranges scored at once; an overlapped run: the learner's threads, one range).

    A quantized policy engine (rollout.quantize) keeps the reference at full precision: PyTorch under ``auto``,
    an fp32 engine exported beside the policy's (``<engine>-fp32``) under ``onnxruntime``."""
    if not ref_on_engine(cfg):
        return None
    on_adapter = policy_engine is not None and policy_engine.adapter is not None  # a LoRA-ready policy engine
    if cfg.lora.enabled and cfg.rollout.quantize != "int8" and on_adapter:
        return policy_engine.adapter_off()  # the policy engine's own sessions with the adapter off: the base, once
    folder = engine_dir(cfg, run_dir)
    if cfg.rollout.quantize == "int8":
        folder = ensure_engine(cfg.model.model_dir, folder.with_name(folder.name + "-fp32"), rows, max_len)
    # never pushed and only scores: the sessions map the folder's files, no copy held, none packed (OrtEngine);
    # it scores in rollout.engine_shards row ranges at once, except beside an overlapped generation (its threads
    # are then the learner's)
    return create_engine("onnxruntime", folder, threads=threads or cfg.rollout.engine_threads or None,
                         hold_weights=False, prepack=False, shards=cfg.rollout.engine_shards if threads is None else 1)
