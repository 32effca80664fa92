"""Parity gate: the exported graphs must compute what PyTorch computes, run through the engine's own loop.

A batch of prompts of different lengths, padded by the model's rule, is decoded greedily by the ONNX
Runtime engine over the folder being written: :func:`refit.rollout.decode.decode_loop`, the loop every
``generate`` runs (prefill, then ``n_decode`` cached single-token steps feeding back the greedy token; EOS
does not stop the gate), on the engine's own step state (plain or fused graph). The PyTorch model runs one
full uncached forward over the same padded sequence. Logits and log-probs at every generated position are
compared on real (unpadded) rows.

The exporter (refit.export.onnx_export) takes the gate as an argument: it writes graphs and a manifest and
runs nothing; :func:`refit.rollout.build.build` hands it :func:`parity_gate`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.core.int8 import QDQ, reference_model, rounding_floor
from refit.core.manifest import Manifest
from refit.core.manifest_sections import Parity
from refit.core.padding import pad_batch, position_ids_from_mask
from refit.export.quantize import GATE_TOL_MIN, QDQ_GATE_TOL
from refit.rollout.decode import decode_loop
from refit.rollout.engine import create_engine, pad_prompts
from refit.rollout.types import ModelSpec, SamplingParams

PARITY_PROMPTS = ["12+34=", "sort 9172 = ", "Refit trains language models", "7"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (the gate's comparison is not limited by its own rounding)."""
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


class _Recorded:
    """A step state that keeps the logits its inner state returns: (B, V) per generated position."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def prefill(self, ids, mask):
        logits = self.inner.prefill(ids, mask)
        self.steps.append(logits.float().numpy().copy())
        return logits

    def extend(self, ids, mask):
        logits = self.inner.extend(ids, mask)
        self.steps.append(logits[:, -1].float().numpy().copy())
        return logits


def engine_greedy_logits(engine_dir: Path, ids: np.ndarray, mask: np.ndarray, n_decode: int,
                         engine=None, files: dict[str, str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Engine logits (B, 1 + n_decode, V) at the last prompt position and each decode step, and the tokens fed
    (B, 1 + n_decode), from the ONNX Runtime engine over ``engine_dir`` (or ``engine``, already open).

    ``ids``/``mask`` are prompts padded by the model's rule; the decode loop is the engines' own. ``files``:
    {graph: file} run instead of the manifest's (a bf16 graph's CPU twin, refit.export.precision.cpu_twin).
    """
    # the gate pushes nothing and decodes a few steps: the sessions read the weights mapped from the files, with no
    # copy held in Python and none pre-packed (a second copy of the model beside the reference: 12 GB at 3B)
    eng = engine if engine is not None else create_engine("onnxruntime", engine_dir, graph_files=files,
                                                          hold_weights=False, keep_heap=False, prepack=False)
    try:
        state = _Recorded(eng._new_state(ids.shape[1] + n_decode + 1))
        spec = replace(eng.spec, eos_id=-1)  # no stop: every row decodes 1 + n_decode positions
        with torch.no_grad():
            out = decode_loop(state, torch.from_numpy(ids), torch.from_numpy(mask),
                              SamplingParams(max_new_tokens=n_decode + 1, greedy=True), spec)
    finally:
        if engine is None:
            eng.close()
    return np.stack(state.steps, 1), out["response_ids"].numpy()


@torch.no_grad()
def torch_reference_logits(model, manifest: Manifest, ids: np.ndarray, mask: np.ndarray, fed: np.ndarray) -> np.ndarray:
    """PyTorch logits (B, 1 + n_decode, V) at the same positions, from one uncached forward."""
    n = fed.shape[1]
    if manifest.kind == "decoder":
        full = torch.from_numpy(np.concatenate([ids, fed[:, :-1]], 1))
        fmask = torch.from_numpy(np.concatenate([mask, np.ones_like(fed[:, :-1])], 1))
        logits = model(input_ids=full, attention_mask=fmask, position_ids=position_ids_from_mask(fmask)).logits
        return logits[:, -n:].float().numpy()
    start = np.full((ids.shape[0], 1), manifest.special_ids.decoder_start, dtype=np.int64)
    dec_ids = torch.from_numpy(np.concatenate([start, fed[:, :-1]], 1))
    out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), decoder_input_ids=dec_ids)
    return out.logits.float().numpy()


def parity_gate(model, engine_dir: Path, manifest: Manifest, tokenizer, tol: float, n_decode: int = 4,
                files: dict[str, str] | None = None, engine_run: str = "CPUExecutionProvider") -> Parity:
    """Run the gate; return the manifest's ``parity`` record or raise RefitError above ``tol``.

    The reference is ``model`` as loaded (the engine's dtype: the same rounded weights); ``files`` and
    ``engine_run``: the graphs run and how (see :func:`engine_greedy_logits`), recorded."""
    seqs = [tokenizer(p, add_special_tokens=False).input_ids or [manifest.special_ids.eos] for p in PARITY_PROMPTS]
    ids, mask, _ = pad_prompts(seqs, 1, ModelSpec.from_manifest(manifest))
    ids, mask = ids.numpy(), mask.numpy()
    eng, fed = engine_greedy_logits(Path(engine_dir), ids, mask, n_decode, files=files)
    ref = torch_reference_logits(model, manifest, ids, mask, fed)
    ref_dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[model.dtype]
    dlogit = float(np.abs(eng.astype(np.float64) - ref).max())
    dlogp = float(np.abs(log_softmax(eng) - log_softmax(ref)).max())
    record = Parity(max_abs_logit_diff=dlogit, max_abs_logprob_diff=dlogp, tolerance_logprob=tol,
                    prompts=len(seqs), prompt_lengths=tuple(len(s) for s in seqs), decode_steps=n_decode,
                    padding_side=manifest.padding.prompt_side,
                    reference=f"PyTorch uncached forward in {ref_dtype} on the CPU; the engine's decode loop, attention "
                              f"{manifest.attention or 'plain'}, {manifest.dtype} graph",
                    reference_dtype=ref_dtype, engine_run=engine_run)
    if not np.isfinite(dlogp) or dlogp > tol:
        raise RefitError(f"parity gate failed: max |logprob diff| {dlogp:.3e} > {tol:g} ({manifest.dtype} engine "
                         f"vs PyTorch in {ref_dtype}; max |logit diff| {dlogit:.3e}); the engine does not compute "
                         "what PyTorch computes")
    return record


def int8_parity_gate(folder: Path, manifest: Manifest, model, tokenizer, log=print) -> Manifest:
    """The int8 engine in ``folder`` (refit/export/quantize.py) through the engine's own decode loop, against the
    quantize-dequantize PyTorch forward (:func:`refit.core.int8.reference_model`), within twice the
    int8 rounding floor; the gap to fp32 recorded. Returns the manifest with its quantization record filled."""
    quant = manifest.quantization
    qdq = quant.scheme == QDQ  # weight-only: no activation rounding, so no floor; fp32 parity's tolerance
    n_q, n_left = quant.quantized_matmuls, quant.float_matmuls
    seqs = [tokenizer(p, add_special_tokens=False).input_ids or [manifest.special_ids.eos] for p in PARITY_PROMPTS]
    ids, mask = pad_batch(seqs, manifest.special_ids.pad, manifest.padding.prompt_side)
    eng, fed = engine_greedy_logits(folder, ids, mask, 4)
    qmodel = reference_model(model, manifest, share_parameters=True)  # no fp32 copy of the model: 12 GB at 3B
    ref = torch_reference_logits(qmodel, manifest, ids, mask, fed)
    fp32 = torch_reference_logits(model, manifest, ids, mask, fed)
    le, lr, lf = log_softmax(eng), log_softmax(ref), log_softmax(fp32)
    dlogp, dmean = float(np.abs(le - lr).max()), float(np.abs(le - lr).mean())
    fwd = lambda m: log_softmax(torch_reference_logits(m, manifest, ids, mask, fed))  # noqa: E731
    if qdq:
        floor, tol, tol_mean = {}, QDQ_GATE_TOL, QDQ_GATE_TOL / 10
    else:
        floor = {"max_abs_logprob": rounding_floor(qmodel, fwd, lambda j: np.abs(j - lr).max()),
                 "mean_abs_logprob": rounding_floor(qmodel, fwd, lambda j: np.abs(j - lr).mean())}
        tol = max(GATE_TOL_MIN, 2 * floor["max_abs_logprob"])
        tol_mean = max(GATE_TOL_MIN / 10, 2 * floor["mean_abs_logprob"])
    gap = {"max_abs_logprob": float(np.abs(le - lf).max()), "mean_abs_logprob": float(np.abs(le - lf).mean()),
           "max_abs_logit": float(np.abs(eng.astype(np.float64) - fp32).max()),
           # the engine's own greedy token's log-prob, int8 minus fp32, averaged: the bias a rollout sees
           "mean_token_logprob_gap": float(np.take_along_axis(le - lf, fed[..., None], -1).mean()),
           "greedy_agreement": float((eng.argmax(-1) == fp32.argmax(-1)).mean())}
    if not (np.isfinite(dlogp) and dlogp <= tol and dmean <= tol_mean):
        why = "weight-only Q/DQ" if qdq else f"rounding floor max {floor['max_abs_logprob']:.3g}"
        raise RefitError(f"int8 parity gate failed: |logprob diff| max {dlogp:.3e} (tol {tol:.3g}), mean {dmean:.3e} "
                         f"(tol {tol_mean:.3g}) against the quantize-dequantize PyTorch forward ({why}); the int8 "
                         "engine does not compute what it should")
    how = ("int8 weights through DequantizeLinear (TensorRT's graph, run by ONNX Runtime CPU)" if qdq
           else f"rounding floor {floor['max_abs_logprob']:.2e}")
    log(f"refit export: int8 engine ({quant.scheme}), {n_q} matmuls with int8 weights ({n_left} left fp32); gate "
        f"max|dlogprob| {dlogp:.2e} mean {dmean:.2e} (tol {tol:.3g}; {how}); gap to fp32: max|dlogprob| "
        f"{gap['max_abs_logprob']:.3f}, greedy agreement {gap['greedy_agreement']:.2f}")
    return replace(manifest, quantization=replace(quant, max_abs_logprob_diff=dlogp, mean_abs_logprob_diff=dmean,
                                                  tolerance_logprob=tol, tolerance_mean=tol_mean,
                                                  rounding_floor=floor, gap_vs_fp32=gap))
