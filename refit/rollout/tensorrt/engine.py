"""``TrtEngine``: generation and scoring on an engine folder's refittable TensorRT plans.

Same structure as :mod:`refit.rollout.ort_backend` (a ``StepState`` with ``prefill``/``extend``; the
decode/score loops, sampling and records are the shared ones in :mod:`refit.rollout.engine`), with
TensorRT execution instead of ONNX Runtime:

- each graph's plan (the manifest's ``tensorrt`` section, written by :func:`refit.rollout.tensorrt.build.build_engines`)
  is deserialized once; one execution context per graph switches optimization profile with
  ``set_optimization_profile_async`` when a call's shapes need another one (``prefill``: empty
  cache; ``decode``: one token per row). A multi-token ``extend`` with a cache (``score`` chunks)
  fits neither manifest profile, so it is fed one token at a time through ``decode``;
- buffers are torch CUDA tensors on one dedicated stream: ``set_input_shape`` +
  ``set_tensor_address`` per input (every address 256-byte aligned, as TensorRT requires; the bool checked),
  outputs allocated from ``get_tensor_shape``, then ``execute_async_v3``. present K/V of one step are the next
  step's past, on the device; only the logits come back to the host (the shared sampler runs on CPU). One graph's
  plan, context, profiles and bindings are :class:`refit.rollout.tensorrt.runner.TrtGraph`;
- ``update_weights`` first makes the engine's stream wait for the stream the learner wrote the tensors on, maps HF
  names through the weight map (tied aliases folded, transpose applied, a stored-dtype target cast as the export
  cast it, on the device; a quantized engine's weights re-quantized there into their int8 twin and scale,
  refit/export/quantize.py) and refits through one ``trt.Refitter`` per graph, kept for the engine's life (prototypes
  read once, weight validation off), ``refit_cuda_engine_async`` on the engine's stream. ``weights_version`` += 1.

The held set (``hold_weights=True``, the default): one device buffer per mapped weight, in the plan's weight dtype,
filled from the ``.onnx.data`` bytes and set into the Refitter once; a push copies into them, so a partial push
refits with the weights TensorRT fused with it, and anything the map does not feed fails loudly before any engine
is touched. ``hold_weights=False``: no copy; whole-model pushes only. ``tensorrt`` is imported on construction only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refit.core.contract import DTYPES
from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.padding import position_ids_from_mask
from refit.export.quantize import kn, quantize_weight
from refit.export.weight_map import apply_transform
from refit.rollout.engine import LoopEngine, ModelSpec, next_version, resolve_names
from refit.rollout.tensorrt import build as trt_build  # require_tensorrt via the module: tests patch in a stand-in
from refit.rollout.tensorrt.build import mapped_trt_names, quantized_twins, refit_targets, trt_weight_name
from refit.rollout.tensorrt.runner import TrtGraph, make_stream, on_stream, producer_streams, trt_to_torch

_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def read_held_weights(engine_dir: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
    """{graph: {trt_name: CPU tensor}} for every mapped weight, from the ``.onnx.data`` bytes (bf16 too)."""
    import numpy as np
    import onnx

    by_onnx = {1: (np.float32, torch.float32), 10: (np.float16, torch.float16), 16: (np.int16, torch.bfloat16),
               3: (np.int8, torch.int8)}  # int8: a quantized engine's weight twins (refit/export/quantize.py)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for graph, spec in manifest.graphs.items():
        wanted = set(mapped_trt_names(manifest, graph))
        out[graph] = {}
        for init in onnx.load(str(engine_dir / spec.file), load_external_data=False).graph.initializer:
            name = trt_weight_name(init.name)
            if name not in wanted or init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            if init.data_type not in by_onnx:
                raise RefitError(f"{spec.file}: weight {init.name} has ONNX dtype {init.data_type}, not "
                                 "fp32/fp16/bf16/int8")
            ext = {e.key: e.value for e in init.external_data}
            np_dt, torch_dt = by_onnx[init.data_type]
            count = int(np.prod(init.dims)) if init.dims else 1
            arr = np.fromfile(engine_dir / ext["location"], dtype=np_dt, count=count, offset=int(ext.get("offset", 0)))
            if arr.size != count:
                raise RefitError(f"{engine_dir / ext['location']} is truncated (weight {init.name})")
            out[graph][name] = torch.from_numpy(arr).view(torch_dt).reshape(tuple(init.dims))
    return out


def _present_to_past(outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n.replace("present", "past", 1): v for n, v in outs.items() if n.startswith("present.")}


class _TrtDecoderState:
    """Past K/V (CUDA tensors) and the running attention mask of one decoder-only batch."""

    def __init__(self, eng: "TrtEngine"):
        self.eng, self.g = eng, eng.graphs["decoder"]
        self.mask = self.past = None

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        outs = self.g.run({"input_ids": ids, "attention_mask": self.mask, "position_ids": pos, "logits_index": keep,
                           **self.past})
        self.past = _present_to_past(outs)
        return outs["logits"].float().cpu()  # (B, K, V); the copy synchronises the stream

    def prefill(self, ids, mask):
        with on_stream(self.g.stream):
            self.mask = mask.to(self.g.device, torch.int64)
            self.past = self.eng.empty_kv(ids.shape[0])
            last = torch.tensor([ids.shape[1] - 1], dtype=torch.int64)  # left padding: the last prompt position
            return self._run(ids, position_ids_from_mask(self.mask), last)[:, -1]

    def extend(self, ids, mask):
        with on_stream(self.g.stream):
            if ids.shape[1] > 1 and not self._fits_chunk(ids.shape):
                return torch.cat([self.extend(ids[:, i:i + 1], mask[:, i:i + 1]) for i in range(ids.shape[1])], 1)
            self.mask = torch.cat([self.mask, mask.to(self.g.device, torch.int64)], 1)
            c = ids.shape[1]
            return self._run(ids, position_ids_from_mask(self.mask)[:, -c:], torch.arange(c))

    def _fits_chunk(self, shape) -> bool:
        b, c = shape
        past = self.mask.shape[1]
        kv = next(iter(self.past.values())).shape
        shapes = {"input_ids": (b, c), "position_ids": (b, c), "attention_mask": (b, past + c), "logits_index": (c,),
                  **{n: (kv[0], kv[1], past, kv[3]) for n in self.past}}
        return self.g.fits(shapes)


class _TrtSeq2SeqState:
    """Cross K/V from one encoder run, and the decoder's self-attention K/V, as CUDA tensors."""

    def __init__(self, eng: "TrtEngine"):
        self.eng = eng
        self.enc, self.dec = eng.graphs["encoder"], eng.graphs["decoder"]
        self.cross = self.past = self.enc_mask = None

    def prefill(self, ids, mask):
        with on_stream(self.dec.stream):
            self.enc_mask = mask.to(self.dec.device, torch.int64)
            outs = self.enc.run({"input_ids": ids, "attention_mask": self.enc_mask})
            self.cross = {n: v for n, v in outs.items() if n.startswith("cross.")}
            self.past = self.eng.empty_kv(ids.shape[0])
            start = torch.full((ids.shape[0], 1), self.eng.spec.decoder_start_id, dtype=torch.int64)
            return self.extend(start, None)[:, -1]

    def extend(self, ids, mask):  # no decoder mask input: finished rows' outputs are ignored
        with on_stream(self.dec.stream):
            if ids.shape[1] > 1 and self.past_len() > 0:  # only the prefill profile takes several tokens
                return torch.cat([self.extend(ids[:, i:i + 1], None) for i in range(ids.shape[1])], 1)
            outs = self.dec.run({"decoder_input_ids": ids, "encoder_attention_mask": self.enc_mask,
                                 **self.cross, **self.past})
            self.past = _present_to_past(outs)
            return outs["logits"].float().cpu()

    def past_len(self) -> int:
        return next(iter(self.past.values())).shape[2]


class TrtEngine(LoopEngine):
    """Engine over an engine folder's TensorRT plans (``refit export --backend tensorrt``)."""

    def __init__(self, engine_dir, device: str = "cuda", threads: int | None = None, log_level: str = "WARNING",
                 hold_weights: bool = True):
        """``threads`` is accepted for a constructor shared with the other backends and unused (GPU work).

        ``hold_weights`` (default): every mapped weight lives in one device buffer of the plan's weight dtype, set
        into the graph's Refitter once; a push copies into them and refits (partial pushes included: TensorRT's
        fused partners are in the buffers). ``False``: no copy of the weights beside the plans (one model less on
        the GPU); a push must then carry every weight of each graph it touches (a training job's whole-model push),
        its tensors are set for the refit and released after it."""
        trt = trt_build.require_tensorrt()
        self.device = torch.device(device)
        # Host buffers only for a TensorRT stand-in that declares it executes on the host (the CPU tests).
        if self.device.type != "cuda" and not getattr(trt, "HOST_EXECUTION", False):
            raise RefitError(f"the tensorrt backend runs on the GPU only (device {device!r} requested)")
        self.trt = trt
        self.engine_dir = Path(engine_dir)
        self.manifest = Manifest.read(self.engine_dir)
        self._check_plans()
        self.spec = ModelSpec.from_manifest(self.manifest)
        self._dtype = _TORCH_DTYPE[self.manifest.dtype]
        self.logger = trt.Logger(getattr(trt.Logger, log_level))
        self.stream = make_stream(self.device)
        runtime = trt.Runtime(self.logger)
        self.graphs = {g: TrtGraph(trt, runtime, self.engine_dir / rec.plan, self.manifest, g, self.stream,
                                    self.device)
                       for g, rec in self.manifest.tensorrt.items()}
        self._runtime = runtime
        self._shapes = _weight_shapes(self.engine_dir, self.manifest)  # {graph: {trt_name: shape}}, no data read
        self._refit = {g: _GraphRefit(trt, self.graphs[g].engine, self.logger, list(self._shapes[g]),
                                      set(self.manifest.tensorrt[g].not_refittable)) for g in self.graphs}
        self.weights = self._hold() if hold_weights else None  # {graph: {trt_name: device buffer}} or None
        # axis 0 is the batch on every input of rank >= 2 (logits_index (K,) has none); a call with more rows runs in
        # static batches and row ranges of max_batch (LoopEngine)
        self.max_batch = min(p[n].max[0] for g in self.graphs.values() for p in g.profiles for n in p
                             if len(p[n].max) > 1)
        self._version = 0

    def _check_plans(self) -> None:
        recs = self.manifest.tensorrt
        if not recs or set(recs) != set(self.manifest.graphs):
            raise RefitError(f"{self.engine_dir} has no TensorRT engines: run `refit export MODEL -o "
                             f"{self.engine_dir} --backend tensorrt` on this machine")
        for g, rec in recs.items():
            if rec.trt_version != self.trt.__version__:
                raise RefitError(f"{g}.plan was built with TensorRT {rec.trt_version}, this is "
                                 f"{self.trt.__version__}: rebuild with `refit export --backend tensorrt`")
            if not (self.engine_dir / rec.plan).is_file():
                raise RefitError(f"TensorRT plan {self.engine_dir / rec.plan} is missing")

    def empty_kv(self, batch: int) -> dict[str, torch.Tensor]:
        """Zero-length past K/V ``{past.i.key|value: (B, H_kv, 0, D)}`` on the device."""
        d = self.manifest.dims
        return {f"past.{i}.{k}": torch.empty((batch, d.n_kv_heads, 0, d.head_dim), dtype=self._dtype,
                                             device=self.device) for i in range(d.n_layers) for k in ("key", "value")}

    def _new_state(self, capacity: int = 0):  # generate/score come from LoopEngine; capacity unused
        return _TrtSeq2SeqState(self) if self.spec.kind == "seq2seq" else _TrtDecoderState(self)

    # ------------------------------------------------------------------------------ refit

    def _hold(self) -> dict[str, dict[str, torch.Tensor]]:
        """The held buffers, from the ``.onnx.data`` bytes, each set into its graph's Refitter once."""
        host = read_held_weights(self.engine_dir, self.manifest)
        held: dict[str, dict[str, torch.Tensor]] = {}
        for g, r in self._refit.items():
            held[g] = {n: host[g][n].to(device=self.device, dtype=r.protos[n][1]).contiguous() for n in r.protos}
            for n, t in held[g].items():
                r.set(n, t)
        return held

    def _stage(self, named: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """{graph: {trt_name: device tensor}} in engine layout (views where the layout allows); shapes checked.

        Each target is converted as the export converted it (refit/export/weight_map.py ``_engine_tensor``): one stored
        in its own dtype (T5's fp32 ``wo`` in an fp16 engine) is cast straight to it, not rounded through the engine's.
        A quantized engine (refit/export/quantize.py, ``int8-qdq``): each quantized weight is re-quantized from the
        pushed fp32 tensor, on the device, into its int8 twin and scale (both refitted); the fp32 name is staged
        only where the graph still reads it (``keep_float``)."""
        staged: dict[str, dict[str, torch.Tensor]] = {}
        for g in self.graphs:
            folded = set(self.manifest.tensorrt[g].not_refittable)
            twins = quantized_twins(self.manifest, g)
            for hf_name, targets in refit_targets(self.manifest, g).items():
                if hf_name not in named:
                    continue
                for trt_name, target in targets:
                    own = target.stored_dtype is not None and target.transform in ("identity", "transpose")
                    dtype = DTYPES[target.stored_dtype] if own else self._dtype
                    t = apply_transform(named[hf_name].detach().to(device=self.device, dtype=dtype), target)
                    tw = twins.get(target.engine)
                    out = {} if tw is not None and not tw.keep_float else {trt_name: t}
                    if tw is not None:
                        q, scale = quantize_weight(kn(t.contiguous(), tw.layout))
                        out[trt_weight_name(tw.weight)], out[trt_weight_name(tw.scale)] = q, scale
                    for name, v in out.items():
                        if name in folded:
                            raise RefitError(f"update_weights: {hf_name} -> {g}:{name} was constant-folded by "
                                             "TensorRT at build time and cannot be refitted")
                        want = self._shapes[g].get(name)
                        if want is None or want != tuple(v.shape):
                            raise RefitError(f"update_weights: {hf_name} -> {g}:{name} expects {want}, got "
                                             f"{tuple(v.shape)}")
                        staged.setdefault(g, {})[name] = v
        return staged

    def _check_complete(self, g: str, new) -> None:
        missing = sorted(set(self._refit[g].protos) - set(new))
        if missing:
            raise RefitError(f"update_weights: the engine over {self.engine_dir} holds no copy of its weights "
                             f"(hold_weights=False), so a push must carry every weight of each graph it touches; this "
                             f"one leaves out {len(missing)} of {g}'s {len(self._refit[g].protos)}, e.g. {missing[:3]}")

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Push HF-named tensors into the plans with each graph's Refitter; all graphs or none; version += 1.

        The engine's stream first waits for the stream the tensors were written on (the learner's optimizer step,
        queued and perhaps not yet run), so nothing is read half-updated. Held buffers: ``copy_`` into them, then
        ``refit_cuda_engine_async``. Not held: the staged tensors are set, refitted, and unset."""
        named = resolve_names(named_tensors, set(self.manifest.weight_map), self.manifest.tied)
        for producer in producer_streams(named.values()):
            self.stream.wait_stream(producer)
        with on_stream(self.stream):
            staged = self._stage(named)
            keep = {}  # not held: the tensors TensorRT reads during the refit
            for g, new in (staged.items() if self.weights is None else ()):  # every graph checked before any is set
                self._check_complete(g, new)
            for g, new in staged.items():
                if self.weights is None:
                    keep[g] = {n: t.to(self._refit[g].protos[n][1]).contiguous() for n, t in new.items()}
                    for n, t in keep[g].items():
                        self._refit[g].set(n, t)
                missing = self._refit[g].missing()
                if missing:
                    for x, tensors in keep.items():
                        self._refit[x].unset(tensors)
                    raise RefitError(f"update_weights: refit of {g} is incomplete, TensorRT still needs {len(missing)} "
                                     f"weights the map does not feed, e.g. {missing[:5]}; nothing was changed")
            for g, new in staged.items():
                if self.weights is not None:
                    for n, t in new.items():
                        self.weights[g][n].copy_(t)
                if not self._refit[g].refitter.refit_cuda_engine_async(self.stream.cuda_stream):
                    raise RefitError(f"update_weights: TensorRT refit of {g} failed; the engine may hold mixed "
                                     "weights now, push the full set again")
            self.stream.synchronize()
            for g, tensors in keep.items():
                self._refit[g].unset(tensors)
        self._version = next_version(self._version, version)

    def close(self) -> None:
        if getattr(self, "stream", None) is not None:
            self.stream.synchronize()
        self.graphs, self.weights, self._refit = {}, {}, {}


def _weight_shapes(engine_dir: Path, manifest: Manifest) -> dict[str, dict[str, tuple[int, ...]]]:
    """{graph: {trt_name: shape}} of every mapped weight, from the graphs' initializer records (no data read)."""
    import onnx

    out = {}
    for graph, spec in manifest.graphs.items():
        wanted = set(mapped_trt_names(manifest, graph))
        inits = onnx.load(str(engine_dir / spec.file), load_external_data=False).graph.initializer
        out[graph] = {trt_weight_name(i.name): tuple(i.dims) for i in inits if trt_weight_name(i.name) in wanted}
    return out


class _GraphRefit:
    """One graph's ``trt.Refitter``, kept for the engine's life: "There is no need to set the same weights repeatedly
    for multiple refit calls as the weights memory can be updated directly instead" (NvInferRuntime.h,
    ``IRefitter::refitCudaEngine``). Each weight's prototype (TensorRT dtype, count) is read once, and TensorRT's
    weight validation is off ("Set the flag to false for faster refitting performance", ``setWeightsValidation``):
    names, shapes and counts are checked here, before anything is set."""

    def __init__(self, trt, engine, logger, names: list[str], folded: set[str]):
        self.trt = trt
        self.refitter = trt.Refitter(engine, logger)
        if hasattr(self.refitter, "weights_validation"):
            self.refitter.weights_validation = False
        to_torch = trt_to_torch(trt)
        self.protos: dict[str, tuple] = {}  # {name: (trt dtype, torch dtype, count)}
        for n in names:
            if n in folded:
                continue
            p = self.refitter.get_weights_prototype(n)
            if p.dtype not in to_torch:
                raise RefitError(f"TensorRT weight {n} has type {p.dtype}, which refit cannot feed")
            self.protos[n] = (p.dtype, to_torch[p.dtype], p.size)

    def set(self, name: str, t: torch.Tensor) -> None:
        dt, want, size = self.protos[name]
        if t.dtype != want or t.numel() != size or not t.is_contiguous():
            raise RefitError(f"update_weights: {name} is {t.dtype} x {t.numel()}, the engine holds {want} x {size}")
        loc = self.trt.TensorLocation.DEVICE if t.device.type == "cuda" else self.trt.TensorLocation.HOST
        if not self.refitter.set_named_weights(name, self.trt.Weights(dt, t.data_ptr(), t.numel()), loc):
            raise RefitError(f"update_weights: TensorRT rejected weights {name} (see the TensorRT log)")

    def unset(self, names) -> None:
        for n in names:
            self.refitter.unset_named_weights(n)

    def missing(self) -> list[str]:
        return list(self.refitter.get_missing_weights())
