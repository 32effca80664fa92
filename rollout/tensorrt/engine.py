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
  ``set_tensor_address`` per input, outputs allocated from ``get_tensor_shape``, then
  ``execute_async_v3``. present K/V of one step are the next step's past, on the device; only
  the logits come back to the host (the shared sampler runs on CPU with a CPU generator);
- ``update_weights`` maps HF names through the weight map (tied aliases folded, transpose
  applied, on the device; a quantized engine's weights re-quantized there into their int8 twin
  and scale, export/quantize.py) and refits with ``trt.Refitter``: ``set_named_weights(name, Weights,
  TensorLocation.DEVICE)``, then ``get_missing_weights`` (weights TensorRT fused with a pushed
  one) are supplied from the held set, and anything still missing fails loudly before any engine
  is touched; ``refit_cuda_engine_async`` on the engine's stream. ``weights_version`` += 1.

The held set: every mapped weight as the engine currently has it (the ``.onnx.data`` bytes at
start, then what was pushed, kept on the device), so a partial push can still supply the
weights TensorRT asks for. ``tensorrt`` is imported on construction only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest, ShapeRange
from refit.core.padding import position_ids_from_mask
from refit.export.quantize import kn, quantize_weight
from refit.export.weight_map import apply_transform
from refit.rollout.engine import LoopEngine, ModelSpec, next_version, resolve_names
from refit.rollout.tensorrt import build as trt_build  # require_tensorrt via the module: tests patch in a stand-in
from refit.rollout.tensorrt.build import mapped_trt_names, quantized_twins, refit_targets, trt_weight_name

_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _trt_to_torch(trt) -> dict:
    return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
            trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool,
            trt.DataType.INT8: torch.int8, trt.DataType.UINT8: torch.uint8}


def read_held_weights(engine_dir: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
    """{graph: {trt_name: CPU tensor}} for every mapped weight, from the ``.onnx.data`` bytes (bf16 too)."""
    import numpy as np
    import onnx

    by_onnx = {1: (np.float32, torch.float32), 10: (np.float16, torch.float16), 16: (np.int16, torch.bfloat16),
               3: (np.int8, torch.int8)}  # int8: a quantized engine's weight twins (export/quantize.py)
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


def _fits(shapes: dict[str, tuple[int, ...]], profile: Mapping[str, ShapeRange]) -> bool:
    """True when every input shape lies inside the profile's [min, max] box."""
    for name, shape in shapes.items():
        s = profile.get(name)
        if s is None or len(s.min) != len(shape):
            return False
        if any(not lo <= d <= hi for d, lo, hi in zip(shape, s.min, s.max)):
            return False
    return True


class _HostStream:
    """Stand-in for ``torch.cuda.Stream`` when a TensorRT stand-in executes on the host (CPU tests)."""

    cuda_stream = 0

    def synchronize(self) -> None:
        pass


def _make_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else _HostStream()


def _on(stream):
    """``with _on(stream):`` makes ``stream`` current for torch's allocations and copies."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


class _TrtGraph:
    """One deserialized plan: its execution context, I/O dtypes, and the manifest's profile boxes."""

    def __init__(self, trt, runtime, plan_path: Path, manifest: Manifest, graph: str, stream, device: torch.device):
        self.trt, self.name, self.stream, self.device = trt, graph, stream, device
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise RefitError(f"TensorRT could not load {plan_path} (built by another TensorRT version or GPU? "
                             "rebuild with `refit export --backend tensorrt`)")
        self.profile_names = manifest.tensorrt[graph].profiles
        self.profiles = [manifest.profiles[graph][p] for p in self.profile_names]
        to_torch = _trt_to_torch(trt)
        io = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in io if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in io if n not in self.inputs]
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in io}
        self.context = self.engine.create_execution_context()
        self.current = 0  # a fresh context runs profile 0
        self._dummy = torch.empty(64, dtype=torch.uint8, device=device)  # address for zero-size tensors

    def _use_profile(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Switch to the first profile whose box holds ``shapes``; False when none does."""
        for i, prof in enumerate(self.profiles):
            if _fits(shapes, prof):
                if i != self.current:
                    self.context.set_optimization_profile_async(i, self.stream.cuda_stream)
                    self.current = i
                return True
        return False

    def fits(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return any(_fits(shapes, p) for p in self.profiles)

    def _addr(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._dummy.data_ptr()

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs (any device/dtype) -> outputs on the device; call under ``_on(self.stream)``."""
        feeds = {n: feeds[n].to(device=self.device, dtype=self.dtypes[n]).contiguous() for n in self.inputs}
        shapes = {n: tuple(t.shape) for n, t in feeds.items()}
        if not self._use_profile(shapes):
            raise RefitError(f"TensorRT {self.name}: no optimization profile of {self.profile_names} holds the shapes "
                             f"{ {n: list(s) for n, s in list(shapes.items())[:3]} }... (re-export with larger "
                             "--max-batch/--max-len)")
        ctx = self.context
        for n, t in feeds.items():
            if not ctx.set_input_shape(n, shapes[n]):
                raise RefitError(f"TensorRT {self.name}: input {n} shape {list(shapes[n])} rejected by profile "
                                 f"{self.profile_names[self.current]}")
            ctx.set_tensor_address(n, self._addr(t))
        outs = {}
        for n in self.outputs:
            shape = tuple(ctx.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise RefitError(f"TensorRT {self.name}: output {n} has unresolved shape {shape}")
            outs[n] = torch.empty(shape, dtype=self.dtypes[n], device=self.device)
            ctx.set_tensor_address(n, self._addr(outs[n]))
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RefitError(f"TensorRT {self.name}: execute_async_v3 failed (see the TensorRT log)")
        return outs


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
        with _on(self.g.stream):
            self.mask = mask.to(self.g.device, torch.int64)
            self.past = self.eng.empty_kv(ids.shape[0])
            last = torch.tensor([ids.shape[1] - 1], dtype=torch.int64)  # left padding: the last prompt position
            return self._run(ids, position_ids_from_mask(self.mask), last)[:, -1]

    def extend(self, ids, mask):
        with _on(self.g.stream):
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
        with _on(self.dec.stream):
            self.enc_mask = mask.to(self.dec.device, torch.int64)
            outs = self.enc.run({"input_ids": ids, "attention_mask": self.enc_mask})
            self.cross = {n: v for n, v in outs.items() if n.startswith("cross.")}
            self.past = self.eng.empty_kv(ids.shape[0])
            start = torch.full((ids.shape[0], 1), self.eng.spec.decoder_start_id, dtype=torch.int64)
            return self.extend(start, None)[:, -1]

    def extend(self, ids, mask):  # no decoder mask input: finished rows' outputs are ignored
        with _on(self.dec.stream):
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

    def __init__(self, engine_dir, device: str = "cuda", threads: int | None = None, log_level: str = "WARNING"):
        """``threads`` is accepted for a constructor shared with the other backends and unused (GPU work)."""
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
        self.stream = _make_stream(self.device)
        runtime = trt.Runtime(self.logger)
        self.graphs = {g: _TrtGraph(trt, runtime, self.engine_dir / rec.plan, self.manifest, g, self.stream,
                                    self.device)
                       for g, rec in self.manifest.tensorrt.items()}
        self._runtime = runtime
        self.weights = read_held_weights(self.engine_dir, self.manifest)  # {graph: {trt_name: tensor}}
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

    def _stage(self, named: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """{graph: {trt_name: device tensor}} in engine layout; shapes checked against the held set.

        A quantized engine (export/quantize.py, ``int8-qdq``): each quantized weight is re-quantized from the
        pushed fp32 tensor, on the device, into its int8 twin and scale (both refitted); the fp32 name is staged
        only where the graph still reads it (``keep_float``)."""
        staged: dict[str, dict[str, torch.Tensor]] = {}
        for g in self.graphs:
            folded = set(self.manifest.tensorrt[g].not_refittable)
            twins = quantized_twins(self.manifest, g)
            for hf_name, targets in refit_targets(self.manifest, g).items():
                if hf_name not in named:
                    continue
                src = named[hf_name].detach().to(device=self.device, dtype=self._dtype)
                for trt_name, target in targets:
                    t = apply_transform(src, target).contiguous()
                    tw = twins.get(target.engine)
                    out = {} if tw is not None and not tw.keep_float else {trt_name: t}
                    if tw is not None:
                        q, scale = quantize_weight(kn(t, tw.layout))
                        out[trt_weight_name(tw.weight)], out[trt_weight_name(tw.scale)] = q, scale
                    for name, v in out.items():
                        if name in folded:
                            raise RefitError(f"update_weights: {hf_name} -> {g}:{name} was constant-folded by "
                                             "TensorRT at build time and cannot be refitted")
                        held = self.weights[g].get(name)
                        if held is None or tuple(held.shape) != tuple(v.shape):
                            raise RefitError(f"update_weights: {hf_name} -> {g}:{name} expects "
                                             f"{None if held is None else tuple(held.shape)}, got {tuple(v.shape)}")
                        # own the bytes: TensorRT reads them during the refit, the learner may change its copy
                        staged.setdefault(g, {})[name] = v.clone() if v.data_ptr() == named[hf_name].data_ptr() else v
        return staged

    def _weights(self, refitter, name: str, t: torch.Tensor, keep: list):
        """A ``trt.Weights`` view of ``t`` in the prototype's dtype; ``keep`` holds the buffer alive."""
        trt = self.trt
        proto = refitter.get_weights_prototype(name)
        want = _trt_to_torch(trt).get(proto.dtype, t.dtype)
        t = t.to(want).contiguous()
        if t.numel() != proto.size:
            raise RefitError(f"update_weights: {name} has {t.numel()} values, the engine holds {proto.size}")
        keep.append(t)
        return trt.Weights(proto.dtype, t.data_ptr(), t.numel()), (
            trt.TensorLocation.DEVICE if t.device.type == "cuda" else trt.TensorLocation.HOST)

    def _prepare_refit(self, g: str, new: dict[str, torch.Tensor], keep: list):
        """A Refitter for graph ``g`` with ``new`` set and every missing weight supplied from the held set."""
        refitter = self.trt.Refitter(self.graphs[g].engine, self.logger)
        for name, t in new.items():
            w, loc = self._weights(refitter, name, t, keep)
            if not refitter.set_named_weights(name, w, loc):
                raise RefitError(f"update_weights: TensorRT rejected weights {g}:{name} (see the TensorRT log)")
        for name in refitter.get_missing_weights():  # weights TensorRT fused with a pushed one
            held = self.weights[g].get(name)
            if held is None:
                continue
            w, loc = self._weights(refitter, name, held, keep)
            if not refitter.set_named_weights(name, w, loc):
                raise RefitError(f"update_weights: TensorRT rejected held weights {g}:{name}")
        missing = list(refitter.get_missing_weights())
        if missing:
            raise RefitError(f"update_weights: refit of {g} is incomplete, TensorRT still needs {len(missing)} "
                             f"weights the map does not feed, e.g. {missing[:5]}; nothing was changed")
        return refitter

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Push HF-named tensors into the plans with ``trt.Refitter``; all graphs or none; version += 1."""
        named = resolve_names(named_tensors, set(self.manifest.weight_map), self.manifest.tied)
        keep: list[torch.Tensor] = []
        with _on(self.stream):
            staged = self._stage(named)
            refitters = {g: self._prepare_refit(g, new, keep) for g, new in staged.items()}  # validate all first
            for g, refitter in refitters.items():
                if not refitter.refit_cuda_engine_async(self.stream.cuda_stream):
                    raise RefitError(f"update_weights: TensorRT refit of {g} failed; the engine may hold mixed "
                                     "weights now, push the full set again")
            self.stream.synchronize()
        for g, new in staged.items():
            self.weights[g].update(new)
        self._version = next_version(self._version, version)

    def close(self) -> None:
        if getattr(self, "stream", None) is not None:
            self.stream.synchronize()
        self.graphs, self.weights = {}, {}
