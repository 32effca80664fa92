"""The built plans' parity gate: TensorRT's engine against PyTorch, before the folder serves a rollout.

The export's gate (:mod:`refit.rollout.parity`) runs the ONNX graphs on ONNX Runtime's CPU provider; the plans
TensorRT builds from them are other kernels (and, on a GPU, other precisions if a flag slipped: TF32). This gate
decodes the same padded prompts greedily through the :class:`~refit.rollout.tensorrt.engine.TrtEngine` of the
folder (the engine's own loop, :func:`refit.rollout.parity.engine_greedy_logits`) and compares its log-probs with
one uncached PyTorch forward of the source checkpoint in the engine's dtype, as the export's gate does. A quantized
(int8 Q/DQ) folder has its own gate at export and is not gated here; a folder whose source checkpoint is not on
this machine is not gated either (both said in the log).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from refit.core.contract import DTYPES
from refit.core.errors import RefitError
from refit.core.hf_folder import load_model
from refit.core.manifest import Manifest
from refit.rollout.engine import pad_prompts
from refit.rollout.parity import PARITY_PROMPTS, engine_greedy_logits, log_softmax, torch_reference_logits
from refit.rollout.tensorrt import build as trt_build  # through the module: a test patches in a stand-in
from refit.rollout.tensorrt.engine import TrtEngine
from refit.rollout.types import ModelSpec

# max |log-prob diff| against PyTorch (tests/conftest.py ATOL["tensorrt"]): GPU kernels, TF32 off for fp32
PLAN_GATE_TOL = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1e-1}


def plan_parity_gate(engine_dir: str | Path, device: str = "cuda", n_decode: int = 4, log=print) -> float | None:
    """Max |log-prob diff| of the folder's TensorRT plans against PyTorch, or None where not gated; RefitError above
    :data:`PLAN_GATE_TOL` for the folder's dtype."""
    from transformers import AutoTokenizer

    engine_dir = Path(engine_dir)
    manifest = Manifest.read(engine_dir)
    src = Path(manifest.source_model) if manifest.source_model else None
    if manifest.quantization is not None or src is None or not src.is_dir():
        why = "int8 Q/DQ (gated at export)" if manifest.quantization is not None else f"no source checkpoint {src}"
        log(f"refit export: TensorRT plans of {engine_dir} not gated against PyTorch: {why}")
        return None
    tok = AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"))
    seqs = [tok(p, add_special_tokens=False).input_ids or [manifest.special_ids.eos] for p in PARITY_PROMPTS]
    ids, mask, _ = pad_prompts(seqs, 1, ModelSpec.from_manifest(manifest))
    ids, mask = ids.numpy(), mask.numpy()
    eng = TrtEngine(engine_dir, device=device, hold_weights=False)
    try:
        got, fed = engine_greedy_logits(engine_dir, ids, mask, n_decode, engine=eng)
    finally:
        eng.close()
    ref = torch_reference_logits(load_model(src, dtype=DTYPES[manifest.dtype]), manifest, ids, mask, fed)
    dlogp = float(np.abs(log_softmax(got) - log_softmax(ref)).max())
    tol = PLAN_GATE_TOL[manifest.dtype]
    if not np.isfinite(dlogp) or dlogp > tol:
        raise RefitError(f"TensorRT plan gate failed: max |logprob diff| {dlogp:.3e} > {tol:g} ({manifest.dtype} plans "
                         "vs PyTorch); the plans do not compute what PyTorch computes and were removed")
    log(f"refit export: TensorRT plans gated against PyTorch: max |logprob diff| {dlogp:.3e} (tol {tol:g})")
    return dlogp


def build_gated(engine_dir: str | Path, log=print, gate: bool | None = None, **kw) -> dict:
    """:func:`refit.rollout.tensorrt.build.build_engines` (``kw``), then, for new plans, :func:`plan_parity_gate`;
    a plan that fails it is removed with the manifest's ``tensorrt`` record. ``gate`` None: gate where the plans run
    on a GPU (not on a host stand-in of TensorRT). Plans reused as up to date were gated when they were built."""
    engine_dir = Path(engine_dir)
    before = Manifest.read(engine_dir).tensorrt
    records = trt_build.build_engines(engine_dir, log=log, **kw)
    host = bool(getattr(trt_build.require_tensorrt(), "HOST_EXECUTION", False))
    built = kw.get("force", False) or records != before  # forced plans are new even when their record reads the same
    if not built or not (gate if gate is not None else not host):
        return records
    try:
        plan_parity_gate(engine_dir, device="cpu" if host else "cuda", log=log)
    except Exception:
        replace(Manifest.read(engine_dir), tensorrt=None).write(engine_dir)
        for rec in records.values():
            (engine_dir / rec.plan).unlink(missing_ok=True)
        raise
    return records
