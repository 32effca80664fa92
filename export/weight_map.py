"""The HF state_dict name -> engine weight name map, built from real data and checked 1:1.

``torch.onnx.export`` (dynamo, with its default optimisations) renames some weights to
``val_NNN``, stores some pre-transposed (constant folding through ``Transpose``), and merges
initializers whose bytes are identical (fresh LayerNorm weights, zero biases). A merged pair
cannot be refitted independently later, so the exporter never sees the real weights: it traces
a copy whose every parameter holds distinct random values (:func:`fingerprint_`). Each ONNX
initializer is then matched by content to the HF tensor it came from, as is or transposed, and
the real weights are written through the map (:func:`engine_weights`).

The map is ``{hf_name: (WeightTarget(engine, graph, transform), ...)}``, the manifest's
``weight_map`` (:class:`export.manifest.WeightTarget`; on disk a list of
``{"engine", "graph", "transform"}`` objects per HF name).

Tied parameters (one tensor under several HF names, e.g. GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``) are listed once, under the canonical name, and the aliases are
recorded in ``tied``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from export.errors import RefitError
from export.manifest import TRANSFORMS, WeightTarget

WeightMap = dict[str, tuple[WeightTarget, ...]]  # {canonical HF name: its engine weights}


def canonical_params(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Unique weight tensors by canonical HF name, and ``{alias: canonical}`` for tied ones.

    Weights are the parameters (trainable or frozen, e.g. Marian's sinusoidal table) plus the
    floating-point buffers saved in the checkpoint (BART/Marian ``final_logits_bias``): the graph
    holds them like weights, so the map must carry them or a push would leave them stale.
    Non-persistent buffers (rotary frequencies) are recomputed from the config and stay out.
    """
    canon: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[int, str] = {}
    saved = set(model.state_dict(keep_vars=True))
    buffers = [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in saved and b.is_floating_point()]
    for name, p in [*model.named_parameters(remove_duplicate=False), *buffers]:
        key = id(p)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            canon[name] = p
    return canon, tied


@torch.no_grad()
def fingerprint_(model: torch.nn.Module, seed: int = 1234) -> None:
    """Overwrite every parameter in place with distinct random values (so no two match)."""
    g = torch.Generator().manual_seed(seed)
    canon, _ = canonical_params(model)
    for p in canon.values():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02 + 0.5)


def _digest(raw: bytes, shape) -> str:
    return hashlib.sha1(raw + str(tuple(shape)).encode()).hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (any dtype, bf16 included) in row-major order."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def apply_transform(t: torch.Tensor, transform: str) -> torch.Tensor:
    """HF tensor -> the tensor the engine stores."""
    if transform == "identity":
        return t
    if transform == "transpose":
        return t.t()
    raise ValueError(f"unknown transform {transform!r}")


def build_weight_map(
    params: dict[str, torch.Tensor], initializers: dict[str, dict[str, np.ndarray]], dtype: torch.dtype
) -> WeightMap:
    """Match fingerprinted ``params`` to ONNX ``initializers`` ({graph: {name: array}}) by content.

    Raises :class:`RefitError` if a trainable tensor is in no graph, or if the exporter
    derived a large initializer from the weights that is neither a copy nor a transpose.
    """
    by_digest: dict[str, tuple[str, str]] = {}
    for hf_name, p in params.items():
        a = p.detach().to(dtype).cpu()
        for transform in TRANSFORMS:
            if transform == "transpose" and a.dim() != 2:
                continue
            t = apply_transform(a, transform)
            by_digest.setdefault(_digest(tensor_bytes(t), t.shape), (hf_name, transform))
    wmap: dict[str, list[WeightTarget]] = {name: [] for name in params}
    unmatched = []
    for graph, inits in initializers.items():
        for name, arr in inits.items():
            hit = by_digest.get(_digest(np.ascontiguousarray(arr).tobytes(), arr.shape))
            if hit is not None:
                wmap[hit[0]].append(WeightTarget(engine=name, graph=graph, transform=hit[1]))
            elif arr.dtype.kind == "f" and arr.size >= 16:
                unmatched.append(f"{graph}:{name}{list(arr.shape)}")
    missing = [n for n, v in wmap.items() if not v]
    if missing:
        raise RefitError(f"weight map incomplete: {len(missing)} HF tensors are in no engine graph, e.g. {missing[:3]}")
    if unmatched:
        raise RefitError(
            f"exporter derived {len(unmatched)} weights the map cannot express (not a copy or transpose), "
            f"e.g. {unmatched[:3]}; refit would leave them stale"
        )
    return {name: tuple(targets) for name, targets in wmap.items()}


def check_one_to_one(wmap: WeightMap) -> None:
    """Every engine weight is fed by exactly one HF tensor (no merged duplicates)."""
    owners: dict[tuple[str, str], str] = {}
    for hf_name, targets in wmap.items():
        for t in targets:
            key = (t.graph, t.engine)
            if key in owners:
                raise RefitError(f"engine weight {key[0]}:{key[1]} is shared by {owners[key]} and {hf_name}")
            owners[key] = hf_name


def engine_weights(
    params: dict[str, torch.Tensor], wmap: WeightMap, dtype: torch.dtype
) -> dict[str, dict[str, torch.Tensor]]:
    """{graph: {engine_name: tensor}} for the given HF tensors (any subset of the map's keys)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for hf_name, t in params.items():
        targets = wmap.get(hf_name)
        if targets is None:
            raise RefitError(f"{hf_name!r} is not in the engine's weight map")
        src = t.detach().to(device="cpu", dtype=dtype)
        for tgt in targets:
            out.setdefault(tgt.graph, {})[tgt.engine] = apply_transform(src, tgt.transform).contiguous()
    return out
