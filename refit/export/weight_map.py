"""The HF state_dict name -> engine weight name map, built from real data and checked 1:1.

``torch.onnx.export`` (dynamo, with its default optimisations) renames some weights to
``val_NNN``, stores some pre-transposed (constant folding through ``Transpose``), and merges
initializers whose bytes are identical (fresh LayerNorm weights, zero biases). A merged pair
cannot be refitted independently later, so the exporter never sees the real weights: it traces
a copy whose every parameter holds distinct random values (:func:`fingerprint_`). Each ONNX
initializer is then matched by content to the HF tensor it came from, as is or transposed, and
the real weights are written through the map (:func:`engine_weights`).

What an initializer that is not such a copy is, is decided by provenance, not size:
:func:`weight_derived_values` walks the *unoptimised* exported graph (before constant folding)
and marks every value that a weight reaches; the optimiser names a folded initializer after the
value it replaces, so after folding each float initializer is one of

- a copy or transpose of one HF tensor: mapped (``identity`` / ``transpose``);
- an elementwise affine transform of one HF tensor, ``scale * w + shift`` (Gemma's RMSNorm folds
  ``1 + w``): mapped with ``affine``, so a push writes the transformed value and stays exact;
- a value no weight reaches (a rotary ``inv_freq`` buffer, a causal mask, an epsilon, a folded
  scale): a constant of the graph, recorded in the manifest's ``constants``, never pushed;
- anything else derived from a weight: refused in one line (a push would leave it stale).

The map is ``{hf_name: (WeightTarget(engine, graph, transform), ...)}``, the manifest's
``weight_map`` (:class:`refit.core.manifest_sections.WeightTarget`; on disk a list of
``{"engine", "graph", "transform"}`` objects per HF name).

Tied parameters (one tensor under several HF names, e.g. GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``) are listed once, under the canonical name, and the aliases are
recorded in ``tied``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from refit.core.contract import DTYPES, canonical_params  # noqa: F401 - canonical_params: this module's name too
from refit.core.errors import RefitError
from refit.core.manifest_sections import WeightTarget

WeightMap = dict[str, tuple[WeightTarget, ...]]  # {canonical HF name: its engine weights}


def graph_buffers(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's buffers that are not weights (rotary ``inv_freq``, position ids, masks): graph constants."""
    held = {id(p) for p in params.values()}
    return {n: b for n, b in model.named_buffers(remove_duplicate=False) if id(b) not in held}


@torch.no_grad()
def fingerprint_(model: torch.nn.Module, seed: int = 1234) -> None:
    """Overwrite every parameter in place with distinct random values (so no two match)."""
    g = torch.Generator().manual_seed(seed)
    canon, _ = canonical_params(model)
    for p in canon.values():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02 + 0.5)


def _digest(raw, shape) -> str:
    """sha1 of the bytes (any buffer: bytes, a numpy array; read in place) and the shape."""
    h = hashlib.sha1(raw)
    h.update(str(tuple(shape)).encode())
    return h.hexdigest()


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (any dtype, bf16 included) in row-major order as a flat uint8 array: a view of its memory
    when it is a contiguous CPU tensor (no copy), else of one contiguous copy."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (any dtype, bf16 included) in row-major order."""
    return byte_view(t).tobytes()


_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def apply_transform(t: torch.Tensor, target: WeightTarget) -> torch.Tensor:
    """HF tensor (already in the engine's dtype) -> the tensor ``target`` stores."""
    if target.stored_dtype is not None:
        t = t.to(DTYPES[target.stored_dtype])
    if target.transform == "identity":
        return t
    if target.transform == "transpose":
        return t.t()
    if target.transform == "affine":  # two rounded ops, as the exporter's constant folding computed them
        return t * target.scale + target.shift
    raise ValueError(f"unknown transform {target.transform!r}")


def _np_digest(arr: np.ndarray) -> str:
    flat = np.ascontiguousarray(arr).reshape(-1)  # a view when contiguous
    return _digest(flat.view(np.uint8) if flat.size else b"", arr.shape)


# ops whose output reads only the shape or dtype of some inputs: {op: the inputs whose values it reads}
_VALUE_INPUTS = {"Shape": slice(0), "Size": slice(0), "CastLike": slice(1)}


def weight_derived_values(graph, weight_digests: set[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(values a weight reaches, every value) of an unoptimised exported ``onnx_ir`` graph.

    Before optimisation the graph's initializers are the traced module's parameters and buffers as
    they are; those whose content digest is in ``weight_digests`` are the weights. A node's outputs
    are weight-derived when any input is, or when a node of its subgraphs (If/Loop bodies) reads one;
    ``Shape``, ``Size`` and ``CastLike``'s second input read only a shape or a dtype (a weight's row count
    is a constant).
    """
    import onnx_ir as ir

    tainted = set()
    for name, v in graph.initializers.items():
        t = v.const_value
        if t is not None and _np_digest(t.numpy()) in weight_digests:
            tainted.add(name)
    names = set(graph.initializers) | {v.name for v in graph.inputs}

    def reads_weight(node) -> bool:
        read = _VALUE_INPUTS.get(node.op_type, slice(None)) if node.domain in ("", "ai.onnx") else slice(None)
        if any(v is not None and v.name in tainted for v in node.inputs[read]):
            return True
        for attr in node.attributes.values():
            subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            if any(reads_weight(n) for g in subs for n in g):
                return True
        return False

    for node in graph:
        outs = {v.name for v in node.outputs}
        names |= outs
        if reads_weight(node):
            tainted |= outs
    return frozenset(tainted), frozenset(names)


def _affine_of(arr: np.ndarray, candidates: list[tuple[str, torch.Tensor]]) -> tuple[str, WeightTarget] | None:
    """(hf_name, target) when ``arr`` is exactly ``scale * w + shift`` of one candidate ``w`` (same shape)."""
    a = arr.astype(np.float64).reshape(-1)
    for hf_name, w in candidates:
        w64 = w.detach().double().reshape(-1).numpy()
        if w64.size < 2 or w64.max() == w64.min():
            continue
        scale, shift = np.polyfit(w64, a, 1)  # least squares over every element: the rounding averages out
        if not np.allclose(a, scale * w64 + shift, rtol=1e-3, atol=1e-3 * max(1.0, abs(shift))):
            continue
        want = np.ascontiguousarray(arr).tobytes()
        stored = {np.dtype("float32"): "fp32", np.dtype("float16"): "fp16"}.get(arr.dtype, "bf16")
        stored_dtype = None if DTYPES[stored] == w.dtype else stored  # None: the engine's dtype
        for s in _nearby(scale):  # the fit is approximate; the folded bytes are exact
            for b in _nearby(shift):
                tgt = WeightTarget(engine="", graph="", transform="affine", scale=s, shift=b, stored_dtype=stored_dtype)
                if tensor_bytes(apply_transform(w.reshape(arr.shape), tgt)) == want:
                    return hf_name, tgt
    return None


def _nearby(x: float) -> list[float]:
    """Round values near a fitted coefficient: a short decimal (1.0, 48.0), its float32, and 1-ulp neighbours."""
    f = np.float32(x)
    out = [float(np.float32(round(x, 4))), float(np.float32(round(x, 6))), float(f), float(np.nextafter(f, np.float32(np.inf))),
           float(np.nextafter(f, np.float32(-np.inf)))]
    return list(dict.fromkeys(out))


class MappedGraphs(NamedTuple):
    weight_map: WeightMap  # {canonical HF name: its engine weights}
    constants: dict[str, dict[str, str]]  # {graph: {initializer: what it is}}: no weight reaches them


def weight_digests(params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, tuple[str, str]]:
    """{content digest: (hf_name, transform)} of each (fingerprinted) tensor as is and transposed."""
    by_digest: dict[str, tuple[str, str]] = {}
    for hf_name, p in params.items():
        # a tensor the model keeps in another float dtype (T5's ``wo`` stays fp32 in an fp16 model,
        # ``_keep_in_fp32_modules``) is in the graph in that dtype
        a = p.detach().cpu() if p.is_floating_point() and p.dtype != dtype and p.dtype in _DTYPE_NAMES \
            else p.detach().to(dtype).cpu()
        for transform in ("identity", "transpose"):
            if transform == "transpose" and a.dim() != 2:
                continue
            t = a.t() if transform == "transpose" else a
            by_digest.setdefault(_digest(byte_view(t), t.shape), (hf_name, transform))
    return by_digest


def build_weight_map(
    params: dict[str, torch.Tensor], initializers: dict[str, dict[str, np.ndarray]], dtype: torch.dtype,
    provenance: dict[str, tuple[frozenset[str], frozenset[str]]], buffers: dict[str, torch.Tensor] | None = None,
    by_digest: dict[str, tuple[str, str]] | None = None,
) -> MappedGraphs:
    """Match fingerprinted ``params`` to ONNX ``initializers`` ({graph: {name: array}}) by content.

    ``provenance``: {graph: :func:`weight_derived_values` of its unoptimised graph}; ``buffers``: the
    model's tensors that are not weights (rotary frequencies...), to name the constants that copy one.
    ``by_digest``: :func:`weight_digests` of ``params`` when the caller has it already (the exporter: its trace).
    Raises :class:`RefitError` if a weight is in no graph, or if the exporter derived an initializer
    from the weights that is neither a copy, a transpose nor an elementwise affine transform of one.
    """
    by_digest = by_digest if by_digest is not None else weight_digests(params, dtype)
    buffer_names: dict[str, str] = {}
    for n, b in (buffers or {}).items():
        if b.is_floating_point():
            buffer_names.setdefault(_digest(byte_view(b), b.shape), n)
    by_numel: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for hf_name, p in params.items():
        by_numel.setdefault(p.numel(), []).append((hf_name, p.detach().to(dtype).cpu()))
    wmap: dict[str, list[WeightTarget]] = {name: [] for name in params}
    constants: dict[str, dict[str, str]] = {}
    unmapped = []
    for graph, inits in initializers.items():
        derived, known = provenance[graph]
        for name, arr in inits.items():
            hit = by_digest.get(_np_digest(arr))
            if hit is not None:
                own = params[hit[0]].dtype
                stored = _DTYPE_NAMES[own] if own != dtype and own in _DTYPE_NAMES else None
                wmap[hit[0]].append(WeightTarget(engine=name, graph=graph, transform=hit[1], stored_dtype=stored))
                continue
            if arr.dtype.kind != "f":
                continue  # shapes, indices, masks: no weight is an integer or boolean tensor
            buffer = buffer_names.get(_np_digest(arr))
            if name in known and name not in derived or buffer is not None:
                constants.setdefault(graph, {})[name] = f"buffer {buffer}" if buffer else "constant"
                continue
            affine = _affine_of(arr, by_numel.get(arr.size, []))
            if affine is not None:
                wmap[affine[0]].append(replace(affine[1], engine=name, graph=graph))
            else:
                unmapped.append(f"{graph}:{name}{list(arr.shape)}" + ("" if name in known else " (unknown provenance)"))
    missing = [n for n, v in wmap.items() if not v]
    if unmapped:
        raise RefitError(
            f"exporter derived {len(unmapped)} engine weights from the model's weights that the map cannot express "
            f"(not a copy, transpose or elementwise scale/shift of one tensor), e.g. {unmapped[:3]}; "
            "a weight push would leave them stale")
    if missing:
        raise RefitError(f"weight map incomplete: {len(missing)} HF tensors are in no engine graph, e.g. {missing[:3]}")
    return MappedGraphs({name: tuple(targets) for name, targets in wmap.items()}, constants)


def check_one_to_one(wmap: WeightMap) -> None:
    """Every engine weight is fed by exactly one HF tensor (no merged duplicates)."""
    owners: dict[tuple[str, str], str] = {}
    for hf_name, targets in wmap.items():
        for t in targets:
            key = (t.graph, t.engine)
            if key in owners:
                raise RefitError(f"engine weight {key[0]}:{key[1]} is shared by {owners[key]} and {hf_name}")
            owners[key] = hf_name


def _engine_tensor(t: torch.Tensor, tgt: WeightTarget, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``tgt`` stores, from the HF tensor ``t``: a view of ``t`` where dtype and layout allow."""
    # a copy kept in its own dtype (stored_dtype, T5's fp32 ``wo``) is not rounded through the engine's
    own = tgt.stored_dtype is not None and tgt.transform in ("identity", "transpose")
    x = t.detach().to(device="cpu") if own else t.detach().to(device="cpu", dtype=dtype)
    return apply_transform(x, tgt).contiguous()


def _check_known(params, wmap: WeightMap) -> None:
    for hf_name in params:
        if hf_name not in wmap:
            raise RefitError(f"{hf_name!r} is not in the engine's weight map")


def engine_weights(
    params: dict[str, torch.Tensor], wmap: WeightMap, dtype: torch.dtype
) -> dict[str, dict[str, torch.Tensor]]:
    """{graph: {engine_name: tensor}} for the given HF tensors (any subset of the map's keys)."""
    _check_known(params, wmap)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for hf_name, t in params.items():
        for tgt in wmap[hf_name]:
            out.setdefault(tgt.graph, {})[tgt.engine] = _engine_tensor(t, tgt, dtype)
    return out


class EngineWeightsView(Mapping):
    """One graph's engine weights ``{engine_name: tensor}`` computed from the HF tensors when read, one at a time.

    What :func:`engine_weights` returns for that graph, without holding it: a transposed or converted weight
    is made when it is looked up and freed when its reader drops it (the exporter writes the graphs and the
    int8 rewrite reads them through this; a whole dict of them would be a second copy of the model)."""

    def __init__(self, params: dict[str, torch.Tensor], targets: dict[str, tuple[str, WeightTarget]],
                 dtype: torch.dtype):
        self._params, self._targets, self._dtype = params, targets, dtype

    def __getitem__(self, engine: str) -> torch.Tensor:
        hf_name, tgt = self._targets[engine]
        return _engine_tensor(self._params[hf_name], tgt, self._dtype)

    def __contains__(self, engine) -> bool:  # without making the tensor (Mapping's default would)
        return engine in self._targets

    def __iter__(self):
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)


def engine_weight_views(
    params: dict[str, torch.Tensor], wmap: WeightMap, dtype: torch.dtype
) -> dict[str, EngineWeightsView]:
    """{graph: :class:`EngineWeightsView`}: :func:`engine_weights` read lazily, the same tensors, none held."""
    _check_known(params, wmap)
    by_graph: dict[str, dict[str, tuple[str, WeightTarget]]] = {}
    for hf_name in params:
        for tgt in wmap[hf_name]:
            by_graph.setdefault(tgt.graph, {})[tgt.engine] = (hf_name, tgt)
    return {g: EngineWeightsView(params, targets, dtype) for g, targets in by_graph.items()}


@torch.no_grad()
def rounded(model, to: str = "none"):
    """``model`` with its floating parameters rounded to ``to``'s values in place (kept in their own dtype; an export's
    ``round_weights``); buffers (rotary frequencies) as they are. "none": unchanged."""
    if to != "none":
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(DTYPES[to]))
    return model
