"""What both jobs do with engines: pick the learner device, make an engine (or a Ray pool of them) for a
model, count teacher passes, and push weights followed by the parity probe.

The probe is the log-prob contract checked after every weight push: a fixed batch, generated once
at setup, is scored by the engine and by the learner's PyTorch model with the same padding,
positions and temperature; the run stops (naming the last checkpoint) when they disagree, since an
engine that did not take the new weights would otherwise sample from a stale policy silently.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from refit.rollout.build import TORCH_BACKENDS, engine_source
from refit.core.errors import RefitError
from refit.core.manifest import MANIFEST, Manifest
from refit.export.onnx_export import DTYPES, PARITY_TOL
from refit.export.weight_map import canonical_params
from refit.learner.run.checkpoint import latest_checkpoint
from refit.learner.run.lora import adapter_tensors, is_lora
from refit.learner.run.policy import learner_view
from refit.rollout.engine import Engine, create_engine
from refit.rollout.types import RolloutBatch


def pick_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``; asking for CUDA without one is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RefitError("device=cuda asked for, but no CUDA device is visible")
    return torch.device(name)


def make_engine(cfg, path, run_dir: Path, gpu_share: float = 1.0, **kw) -> Engine:
    """One engine, or with ``scale.workers > 1`` a RayEnginePool of that many (same Engine protocol).

    ``cfg.scale`` carries the scale-out fields (``workers``, ``ray_address``, ``worker_cpus``,
    ``worker_gpus``), ``cfg.rollout`` the ``backend``. Each Ray actor reserves ``worker_cpus`` CPUs and
    ``worker_gpus`` GPUs; the GPU default (-1) is ``gpu_share`` of a GPU for the tensorrt backend
    (its engine needs one), none otherwise (Ray hides the GPUs from an actor that reserved none).
    """
    if cfg.scale.workers > 1:  # [scale-out]
        from refit.rollout.ray_pool import RayEnginePool

        gpus = cfg.scale.worker_gpus
        if gpus < 0:
            gpus = gpu_share if cfg.rollout.backend == "tensorrt" else 0.0
        scale = cfg.scale
        return RayEnginePool(cfg.rollout.backend, path, workers=scale.workers, ray_address=scale.ray_address,
                             cpus_per_worker=scale.worker_cpus, gpus_per_worker=gpus,
                             last_checkpoint=lambda: latest_checkpoint(run_dir), **kw)
    return create_engine(cfg.rollout.backend, path, **kw)


def engine_for_model(cfg, model_dir: str | Path, engine_dir: str | Path, rows: int, max_len: int, log=print,
                     gpu_share: float = 1.0, lora=None) -> Engine:
    """The engine of one model for ``cfg.rollout.backend``: exported (or reused) into ``engine_dir`` when the
    backend runs an engine folder, straight from ``model_dir`` for the PyTorch backends. ``lora`` (a
    LoraSection with r > 0): the engine is LoRA-ready for its target modules (export/lora.py)."""
    src = engine_source(cfg.rollout.backend, model_dir, engine_dir, rows, max_len, log,
                        getattr(cfg.rollout, "quantize", "none"),
                        lora=tuple(lora.target_modules) if lora is not None and lora.enabled else ())
    if cfg.rollout.backend in TORCH_BACKENDS:
        return make_engine(cfg, src, Path(cfg.run.output_dir), gpu_share, max_len=max_len)
    # a job pushes the whole model (canonical_params) or nothing: its engine needs no copy of the weights of its own
    lean = {"hold_weights": False} if cfg.rollout.backend == "onnxruntime" else {}
    if lean and getattr(cfg.rollout, "quantize", "none") == "none":
        lean["push_via"] = cfg.rollout.push_via
    if lean and cfg.rollout.engine_shards > 1:
        lean["shards"] = cfg.rollout.engine_shards
    return make_engine(cfg, src, Path(cfg.run.output_dir), gpu_share, threads=cfg.rollout.engine_threads or None,
                       **lean)


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


def probe_length(rollout, response_length: int) -> int:
    """Response tokens of the probe batch: ``rollout.probe_tokens`` (0: all), at most ``response_length``."""
    return min(response_length, rollout.probe_tokens) if rollout.probe_tokens > 0 else response_length


def engine_dtype(engine) -> str:
    """The dtype of ``engine``'s weights and activations: its manifest's (ONNX Runtime, TensorRT, a pool or a
    counting wrapper over one), "fp32" for the PyTorch backends."""
    m = getattr(engine, "manifest", None)
    if m is None and getattr(engine, "path", None) is not None and (Path(engine.path) / MANIFEST).exists():
        m = Manifest.read(engine.path)
    return getattr(m, "dtype", None) or "fp32"


def probe_reference(model: torch.nn.Module, dtype: str) -> tuple[torch.nn.Module, float]:
    """(the model the probe compares a ``dtype`` engine with, the least tolerance that comparison needs).

    fp32: ``model`` itself, no floor. fp16/bf16: a copy of ``model`` whose weights are rounded to ``dtype``
    and computed in fp32, so the probe sees the engine's own weights (a push that did not take still shows)
    and only the engine's activation rounding remains, which the export's gate bounds at
    ``PARITY_TOL[dtype]`` (engine vs PyTorch in ``dtype``). The fp32 weights themselves would add the
    weights' rounding to every log-prob, which grows with width and depth. Costs one fp32 copy of the model.
    """
    if dtype == "fp32":
        return model, 0.0
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in [*rounded.parameters(), *rounded.buffers()]:
            if p.is_floating_point():
                p.copy_(p.to(DTYPES[dtype]).float())
    return rounded, PARITY_TOL[dtype]


def probe_learner_side(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float,
                       int8_manifest=None) -> tuple[torch.Tensor, float, torch.nn.Module]:
    """The learner's half of :func:`probe_check`: (its log-probs on ``probe``, the tolerance floor, the model
    compared). It needs only the weights about to be pushed, so an overlapped PPO run computes it while the engine
    still generates (refit.learner.ppo.overlap), before the push."""
    if int8_manifest is not None:
        model = int8_reference(model, int8_manifest)
    ref, floor = probe_reference(model, engine_dtype(engine))
    return learner_view(ref, None, probe, temperature)[0], floor, model


def probe_check(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float, tol: float,
                run_dir: Path, label: str = "engine", int8_manifest=None, learner_side=None) -> float:
    """Score ``probe`` on ``engine`` and on ``model``; the max |log-prob diff|, or one line when above ``tol``
    (for an fp16/bf16 engine: against ``model``'s weights in that dtype, ``tol`` at least the dtype's gate
    tolerance, :func:`probe_reference`).

    ``int8_manifest``: the engine is int8 (export/quantize.py): the learner side is ``model`` quantized as the engine
    quantizes it (``reference_model``); above ``tol``, the int8 rounding floor on this batch is measured and the
    engine must be within twice it (export/quantize.py, Exactness).

    ``learner_side``: :func:`probe_learner_side`'s result, computed already (for the weights pushed)."""
    p = probe
    eng = engine.score(p.prompt_ids, p.prompt_mask, p.response_ids, p.response_mask, temperature=temperature).logprobs
    mine, floor, model = learner_side or probe_learner_side(engine, model, p, temperature, int8_manifest)
    dist = lambda other: float(((eng - other).abs() * p.response_mask).max())  # noqa: E731
    diff = dist(mine)
    tol = max(tol, floor)
    if int8_manifest is not None and diff > tol:
        from refit.export.quantize import rounding_floor

        floor = rounding_floor(model, lambda m: learner_view(m, None, p, temperature)[0],
                               lambda j: float(((j - mine).abs() * p.response_mask).max()))
        tol = max(tol, 2 * floor)
    return check_parity(diff, tol, engine.weights_version, run_dir, label, "the probe batch")


def check_parity(diff: float, tol: float, version: int, run_dir: Path, label: str = "engine",
                 where: str = "the probe batch") -> float:
    """``diff`` (max |engine - learner log-prob| after a push) if within ``tol``, else one RefitError line."""
    if not diff <= tol:
        raise RefitError(f"parity probe failed after weight push ({label} weights_version {version}, on {where}): "
                         f"max |logprob diff| {diff:.3e} > {tol:g}; the engine did not take the new weights. "
                         f"Last checkpoint: {latest_checkpoint(run_dir)}")
    return diff


def push_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a push of ``model`` carries: a LoRA policy's adapter (refit.learner.run.lora.adapter_tensors: the
    engine holds the base), else every weight by canonical HF name."""
    return adapter_tensors(model) if is_lora(model) else canonical_params(model)[0]


def int8_reference(model: torch.nn.Module, manifest: Manifest) -> torch.nn.Module:
    """``model`` as an int8 engine computes it (export/quantize.py ``reference_model``). For a LoRA policy the
    reference is made once and kept on the model: it shares every parameter of the policy (the adapter as it
    trains, the frozen base) and holds only the int8 twins of the base's linear layers, so it follows each step
    without being made again and costs no fp32 copy of the base."""
    from refit.export.quantize import reference_model

    if not is_lora(model):
        return reference_model(model, manifest)
    peft_model = getattr(model, "module", model)
    ref = getattr(peft_model, "_refit_int8_reference", None)
    if ref is None:
        ref = reference_model(peft_model.get_base_model(), manifest, share_parameters=True)
        object.__setattr__(peft_model, "_refit_int8_reference", ref)
    return ref


def push_weights(engine: Engine, model: torch.nn.Module, probe: RolloutBatch, temperature: float, tol: float,
                 run_dir: Path, label: str = "engine", int8_manifest=None, learner_side=None) -> tuple[int, float]:
    """Push ``model``'s weights into ``engine``, then :func:`probe_check`; (the new weights_version, probe diff).
    ``learner_side``: the probe's learner half for these weights, computed already (:func:`probe_learner_side`)."""
    engine.update_weights(push_tensors(model))
    return engine.weights_version, probe_check(engine, model, probe, temperature, tol, run_dir, label, int8_manifest,
                                               learner_side)
