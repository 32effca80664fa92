"""Parity gate: the exported graphs must compute what PyTorch computes.

A batch of prompts of different lengths, padded by the model's rule, runs through the engine
(prefill, then ``n_decode`` cached single-token steps feeding back the greedy token) and
through the PyTorch model (one full forward over the same padded sequence, no cache). The
logits and log-probs at every generated position are compared on real (unpadded) rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export.errors import RefitError
from export.graph import open_session
from export.manifest import Manifest, Parity
from export.padding import pad_batch, position_ids_from_mask

PARITY_PROMPTS = ["12+34=", "sort 9172 = ", "Refit trains language models", "7"]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _empty_past(manifest: Manifest, b: int, dtype) -> dict[str, np.ndarray]:
    d = manifest.dims
    shape = (b, d.n_kv_heads, 0, d.head_dim)  # (B, H_kv, 0, D)
    return {f"past.{i}.{k}": np.zeros(shape, dtype) for i in range(d.n_layers) for k in ("key", "value")}


def _np_dtype(manifest: Manifest):
    return {"fp32": np.float32, "fp16": np.float16}.get(manifest.dtype, np.float32)


def engine_greedy_logits(engine_dir: Path, manifest: Manifest, ids: np.ndarray, mask: np.ndarray, n_decode: int,
                         files: dict[str, str] | None = None, weights: dict[str, dict] | None = None):
    """Engine logits (B, 1 + n_decode, V) at the last prompt position and each decode step, and the tokens fed.

    A fused-attention graph (manifest ``attention``) runs through :func:`export.fused.fused_greedy_logits`
    on the same left-padded prompts. ``files``: {graph: file in ``engine_dir``} run instead of the manifest's
    (a bf16 graph's CPU twin, :func:`export.precision.cpu_twin`: fp32 inputs and outputs); ``weights``:
    {graph: {initializer: tensor}} in place of the stored ones (a weight push, as
    :func:`export.weight_map.engine_weights` maps it)."""
    files = files or {g: spec.file for g, spec in manifest.graphs.items()}
    sessions = {g: open_session(engine_dir / files[g], (weights or {}).get(g))[0] for g in manifest.graphs}
    if manifest.attention == "fused" and manifest.kind == "decoder":
        from export.fused import fused_greedy_logits

        return fused_greedy_logits(sessions["decoder"], manifest, ids, mask, n_decode)
    if manifest.attention == "fused":
        from export.fused_seq2seq import fused_seq2seq_greedy_logits

        return fused_seq2seq_greedy_logits(sessions, manifest, ids, mask, n_decode)
    dt, b = _np_dtype(manifest), ids.shape[0]
    past = _empty_past(manifest, b, dt)
    steps, fed = [], []
    if manifest.kind == "decoder":  # logits of the last prompt position only, as the engines ask for
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                 "logits_index": np.array([ids.shape[1] - 1], np.int64)}
    else:
        enc = sessions["encoder"].run(None, {"input_ids": ids, "attention_mask": mask})
        cross = dict(zip(manifest.graphs["encoder"].outputs[1:], enc[1:]))
        start = np.full((b, 1), manifest.special_ids.decoder_start, dtype=np.int64)
        feeds = {"decoder_input_ids": start, "encoder_attention_mask": mask, **cross}
    dec = sessions["decoder"]
    out_names = manifest.graphs["decoder"].outputs
    for step in range(n_decode + 1):
        outs = dict(zip(out_names, dec.run(None, {**feeds, **past})))
        last = outs["logits"][:, -1].astype(np.float32)
        steps.append(last)
        nxt = last.argmax(-1)[:, None].astype(np.int64)
        fed.append(nxt)
        past = {n.replace("present", "past"): v for n, v in outs.items() if n.startswith("present")}
        if manifest.kind == "decoder":
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], 1)
            feeds = {"input_ids": nxt, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)[:, -1:],
                     "logits_index": np.zeros(1, np.int64)}
        else:
            feeds["decoder_input_ids"] = nxt
    return np.stack(steps, 1), np.concatenate(fed, 1)


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
    ids, mask = pad_batch(seqs, manifest.special_ids.pad, manifest.padding.prompt_side)
    eng, fed = engine_greedy_logits(Path(engine_dir), manifest, ids, mask, n_decode, files)
    ref = torch_reference_logits(model, manifest, ids, mask, fed)
    ref_dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[model.dtype]
    dlogit = float(np.abs(eng.astype(np.float64) - ref).max())
    dlogp = float(np.abs(_log_softmax(eng) - _log_softmax(ref)).max())
    record = Parity(max_abs_logit_diff=dlogit, max_abs_logprob_diff=dlogp, tolerance_logprob=tol,
                    prompts=len(seqs), prompt_lengths=tuple(len(s) for s in seqs), decode_steps=n_decode,
                    padding_side=manifest.padding.prompt_side,
                    reference=f"PyTorch uncached forward in {ref_dtype} on the CPU; engine attention "
                              f"{manifest.attention or 'plain'}, {manifest.dtype} graph",
                    reference_dtype=ref_dtype, engine_run=engine_run)
    if not np.isfinite(dlogp) or dlogp > tol:
        raise RefitError(f"parity gate failed: max |logprob diff| {dlogp:.3e} > {tol:g} ({manifest.dtype} engine "
                         f"vs PyTorch in {ref_dtype}; max |logit diff| {dlogit:.3e}); the engine does not compute "
                         "what PyTorch computes")
    return record
