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
from refit.core.manifest import Manifest, Parity
from refit.core.padding import position_ids_from_mask
from refit.rollout.decode import decode_loop
from refit.rollout.engine import pad_prompts
from refit.rollout.types import SamplingParams

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
    from refit.rollout.engine import create_engine

    eng = engine if engine is not None else create_engine("onnxruntime", engine_dir, graph_files=files)
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
    from refit.rollout.types import ModelSpec

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
