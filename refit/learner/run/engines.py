"""What both jobs do with engines: pick the learner device, check that the batch fits in memory, make an engine
(or a Ray pool of them) for a model, and count teacher passes. Pushing weights into them and checking the push:
refit.learner.run.sync.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.manifest import MANIFEST, Manifest
from refit.core.memory import (SCORE_ROWS, auto_learner_rows, available, batch_terms, engine_terms,
                               engine_weight_bytes, geometry, learner_terms, refuse_if_over)
from refit.learner.run.checkpoint import latest_checkpoint
from refit.rollout import ray_pool  # RayEnginePool looked up when a pool is made (a test patches it), Ray only then
from refit.rollout.build import TORCH_BACKENDS, engine_source
from refit.rollout.engine import Engine, create_engine


def pick_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``; asking for CUDA without one is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RefitError("device=cuda asked for, but no CUDA device is visible")
    return torch.device(name)


def _engine_rows(cfg, rows: int) -> int:
    """Rows of the policy engine's largest call: ``rows``, at most the max_batch of an engine folder already there
    (a larger batch runs within it: refit.rollout.engine.LoopEngine)."""
    folder = Path(cfg.model.engine_dir or Path(cfg.run.output_dir) / "engine") if hasattr(cfg, "model") else None
    if folder is None or not (folder / MANIFEST).is_file():
        return rows
    try:
        return min(rows, Manifest.read(folder).dims.max_batch)
    except RefitError:
        return rows


def check_batch_memory(cfg, max_len: int | None = None) -> None:
    """Refuse, before any work, a batch that cannot fit: the estimate of refit.core.memory for the trained model
    (PPO's policy, the distillation's student) at the job's largest calls, in one line. ``max_len`` None: before
    the prompts are read, a lower bound (a one-token prompt and the whole response).

    The engine's call (KV cache, logits) is checked with the learner's micro-batch (its logits and activations)
    and the weights against host memory, or, with a CUDA learner, the learner's part against the GPU's free
    memory (an ONNX Runtime engine stays in host memory)."""
    sec = getattr(cfg, "model", None) or getattr(cfg, "student", None)
    g = geometry(sec.model_dir) if sec is not None and sec.model_dir and Path(sec.model_dir).is_dir() else None
    if g is None:
        return  # no model yet (the embedded default) or no readable config: the job's own line says so
    response = getattr(cfg, "response_length", None) or getattr(cfg, "max_new_tokens", 1)
    gens, minis = getattr(cfg, "num_generations", 1), getattr(cfg, "num_mini_batches", 1)
    rows = cfg.run.batch_size * gens
    length = max_len or response + 1
    micro = learner_micro_rows(g, rows // minis // cfg.optim.gradient_accumulation_steps, length, response,
                               cfg.optim.micro_batch_rows)
    lora = getattr(getattr(cfg, "lora", None), "enabled", False)
    # a reference engine scores a micro-batch at a time (one-pass step) or SCORE_ROWS rows (two-pass)
    engine = {**engine_terms(g, _engine_rows(cfg, rows), length, score_rows=max(micro, SCORE_ROWS)),
              "engine weights": engine_weight_bytes(g, engine_quantize(cfg))}
    # the learner's weights: a LoRA base (frozen, 4 bytes a parameter), or the policy with its gradient and Adam's
    # two moments (16); a reference engine reads its weights mapped from its files (page cache), not counted
    learner = {**learner_terms(g, micro, length, response, weight_copies=1 if lora else 4),
               **batch_terms(rows, length)}
    per = f" x num_generations {gens}" if gens > 1 else ""
    what = (f"a batch of {rows} rows (run.batch_size {cfg.run.batch_size}{per}) of up to {length} tokens of "
            f"{sec.model_dir}, {micro} rows a micro-batch in the update,")
    fix = ("lower run.batch_size, or the response length; lower optim.micro_batch_rows for a smaller update "
           "micro-batch")
    have, cuda = available(), pick_device(cfg.run.device).type == "cuda"
    if not lora and not cuda and have is not None and learner["weights"] + engine["engine weights"] > have:
        fix = ("the weights alone do not fit: full fine-tuning holds each parameter with its gradient and Adam's two "
               "moments (16 bytes), so train a LoRA adapter over the frozen base instead (--lora.r 16: the base at 4 "
               "bytes a parameter, docs/lora.md)")
    if cuda:
        refuse_if_over(engine, have, what, "of host memory", fix)
        gpu = int(os.environ.get("LOCAL_RANK", "0"))  # [dist] this rank's GPU, not every rank's context on GPU 0
        refuse_if_over(learner, torch.cuda.mem_get_info(gpu)[0], what, "of free GPU memory", fix)
    else:
        refuse_if_over({**engine, **learner}, have, what, "of memory", fix)


def learner_micro_rows(g, rows: int, max_len: int, response: int, explicit: int = 0,
                       free: int | None = None) -> int:
    """Rows per learner forward with autograd: at most ``rows`` (a minibatch's micro-batch, num_mini_batches and
    gradient_accumulation_steps given), and at most ``explicit`` (optim.micro_batch_rows) or, when 0, what fits
    the memory (refit.core.memory.auto_learner_rows), then evened out so that the micro-batches are of one size
    but for the last (128 rows at a cap of 25: five of 22 and one of 18, not five of 25 and one of 3)."""
    cap = max(1, min(rows, explicit if explicit > 0 else auto_learner_rows(g, max_len, response, free)))
    if explicit > 0 or rows <= 0:
        return cap
    forwards = -(-rows // cap)  # ceil: as many forwards as the cap needs ...
    return -(-rows // forwards)  # ... with the rows shared out evenly


def make_engine(cfg, path, run_dir: Path, gpu_share: float = 1.0, **kw) -> Engine:
    """One engine, or with ``scale.workers > 1`` a RayEnginePool of that many (same Engine protocol).

    ``cfg.scale`` carries the scale-out fields (``workers``, ``ray_address``, ``worker_cpus``,
    ``worker_gpus``), ``cfg.rollout`` the ``backend``. Each Ray actor reserves ``worker_cpus`` CPUs and
    ``worker_gpus`` GPUs; the GPU default (-1) is ``gpu_share`` of a GPU for the tensorrt backend
    (its engine needs one), none otherwise (Ray hides the GPUs from an actor that reserved none).
    """
    if cfg.scale.workers > 1:  # [scale-out]
        gpus = cfg.scale.worker_gpus
        if gpus < 0:
            gpus = gpu_share if cfg.rollout.backend == "tensorrt" else 0.0
        scale = cfg.scale
        return ray_pool.RayEnginePool(cfg.rollout.backend, path, workers=scale.workers, ray_address=scale.ray_address,
                                      cpus_per_worker=scale.worker_cpus, gpus_per_worker=gpus,
                                      last_checkpoint=lambda: latest_checkpoint(run_dir), **kw)
    return create_engine(cfg.rollout.backend, path, **kw)


def engine_for_model(cfg, model_dir: str | Path, engine_dir: str | Path, rows: int, max_len: int, log=print,
                     gpu_share: float = 1.0, lora=None, src: Path | None = None) -> Engine:
    """The engine of one model for ``cfg.rollout.backend``: exported (or reused) into ``engine_dir`` when the
    backend runs an engine folder, straight from ``model_dir`` for the PyTorch backends. ``lora`` (a
    LoraSection with r > 0): the engine is LoRA-ready for its target modules (refit/export/lora.py), exported from the
    base the learner holds (lora.base_dtype bf16: the checkpoint's weights rounded to bf16 values). ``src``: the
    folder :func:`engine_folder` already gave for these arguments (not checked again: its reuse check hashes the
    checkpoint)."""
    src = src or engine_folder(cfg, model_dir, engine_dir, rows, max_len, log, lora)
    if cfg.rollout.backend in TORCH_BACKENDS:
        return make_engine(cfg, src, Path(cfg.run.output_dir), gpu_share, max_len=max_len)
    # a job pushes the whole model (canonical_params) or nothing: its engine needs no copy of the weights of its own
    # (TensorRT: none on the GPU either, issue 45 #8), but for a LoRA run's TensorRT pushes of the merged targeted
    # layers, whose refit needs the held partners
    ort = cfg.rollout.backend == "onnxruntime"
    lean = {"hold_weights": False} if ort or (cfg.rollout.backend == "tensorrt" and not lora_of(lora)) else {}
    if ort and engine_quantize(cfg) == "none":
        lean["push_via"] = cfg.rollout.push_via
    if ort and cfg.rollout.engine_shards > 1:
        lean["shards"] = cfg.rollout.engine_shards
    return make_engine(cfg, src, Path(cfg.run.output_dir), gpu_share, threads=cfg.rollout.engine_threads or None,
                       **lean)


def engine_folder(cfg, model_dir: str | Path, engine_dir: str | Path, rows: int, max_len: int, log=print, lora=None):
    """:func:`engine_for_model`'s folder, exported or reused, no session opened (a run whose learner reads the
    engine's manifest first: ``lora.base_dtype int8``); the model folder itself for the PyTorch backends."""
    # TensorRT takes a LoRA run's pushes as a refit of the merged targeted layers: its engine has no adapter inputs
    lora_ready = lora_of(lora) and cfg.rollout.backend != "tensorrt"
    check_batch_memory(cfg, max_len)  # with the prompts' real length, before the export and the first rollout
    return engine_source(cfg.rollout.backend, model_dir, engine_dir, rows, max_len, log,
                         engine_quantize(cfg), lora=tuple(lora.target_modules) if lora_ready else (),
                         round_weights="bf16" if lora is not None and lora.bf16_base else "none")


def engine_quantize(cfg) -> str:
    """``cfg.rollout.quantize`` as the engine takes it: "int8" or "none" (an unresolved ``auto``, before a job's setup
    settles it, reads as none: refit.learner.run.precision)."""
    return "int8" if getattr(getattr(cfg, "rollout", None), "quantize", "none") == "int8" else "none"


def lora_of(lora) -> bool:
    """True for a LoraSection that trains an adapter (r > 0)."""
    return lora is not None and lora.enabled


class CountingEngine:
    """An Engine (composition) that counts ``generate`` and ``score`` calls: the teacher-pass counter."""

    def __init__(self, inner: Engine):
        self.inner, self.generate_calls, self.score_calls = inner, 0, 0

    def generate(self, prompts, sampling, on_step=None):
        self.generate_calls += 1
        return self.inner.generate(prompts, sampling, on_step=on_step)

    def score(self, *args, **kw):
        self.score_calls += 1
        return self.inner.score(*args, **kw)

    def __getattr__(self, name):  # update_weights, weights_version, close: the inner engine's own
        return getattr(self.inner, name)
