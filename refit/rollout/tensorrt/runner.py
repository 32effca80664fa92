"""TensorRT execution for one graph: a deserialized plan, its execution context and the buffers bound to it.

The runner side of :class:`refit.rollout.tensorrt.engine.TrtEngine` (Polygraphy's ``backend/trt/runner``):
:class:`TrtGraph` switches optimization profile when a call's shapes need another one, binds every input and
output at a ``ALIGN``-aligned address (:func:`aligned`, :func:`aligned_empty`; TensorRT refuses others) and runs
``execute_async_v3`` on the engine's stream. The stream helpers (:func:`make_stream`, :func:`on_stream`,
:func:`producer_streams`) stand in a host stream when a TensorRT stand-in executes on the CPU (the tests).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.manifest_sections import ShapeRange


def trt_to_torch(trt) -> dict:
    """{TensorRT DataType: torch dtype} of every type a binding or a refitted weight may have."""
    return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
            trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool,
            trt.DataType.INT8: torch.int8, trt.DataType.UINT8: torch.uint8}


# IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment." (NvInferRuntime.h, TensorRT
# 10.x and 11.x). A fresh CUDA tensor of torch's caching allocator is 512-byte aligned; a view (the last c columns of
# a batch-1 position_ids row) or a host tensor (64-byte aligned) need not be.
ALIGN = 256


def aligned_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor whose first byte is ``ALIGN``-aligned (over-allocated only where torch's is not)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.data_ptr() % ALIGN == 0:
        return t
    size = torch.Size(shape)
    n = math.prod(size) * t.element_size()
    raw = torch.empty(n + ALIGN, dtype=torch.uint8, device=device)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + n].view(dtype).view(size)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous and ``ALIGN``-aligned, else an aligned contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    return aligned_empty(t.shape, t.dtype, t.device).copy_(t)


def fits_profile(shapes: dict[str, tuple[int, ...]], profile: Mapping[str, ShapeRange]) -> bool:
    """True when every input shape lies inside the profile's [min, max] box."""
    for name, shape in shapes.items():
        s = profile.get(name)
        if s is None or len(s.min) != len(shape):
            return False
        if any(not lo <= d <= hi for d, lo, hi in zip(shape, s.min, s.max)):
            return False
    return True


class HostStream:
    """Stand-in for ``torch.cuda.Stream`` when a TensorRT stand-in executes on the host (CPU tests)."""

    cuda_stream = 0

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:  # host buffers: every write already happened
        pass


def make_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else HostStream()


def producer_streams(tensors) -> list:
    """The current stream of every CUDA device ``tensors`` live on: the learner's, where its optimizer step was queued."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return [torch.cuda.current_stream(d) for d in sorted(devices, key=str)]


def on_stream(stream):
    """``with on_stream(stream):`` makes ``stream`` current for torch's allocations and copies."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


class TrtGraph:
    """One deserialized plan: its execution context, I/O dtypes, and the manifest's profile boxes."""

    def __init__(self, trt, runtime, plan_path: Path, manifest: Manifest, graph: str, stream, device: torch.device):
        self.trt, self.name, self.stream, self.device = trt, graph, stream, device
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise RefitError(f"TensorRT could not load {plan_path} (built by another TensorRT version or GPU? "
                             "rebuild with `refit export --backend tensorrt`)")
        self.profile_names = manifest.tensorrt[graph].profiles
        self.profiles = [manifest.profiles[graph][p] for p in self.profile_names]
        to_torch = trt_to_torch(trt)
        io = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in io if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in io if n not in self.inputs]
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in io}
        self.context = self.engine.create_execution_context()
        self.current = 0  # a fresh context runs profile 0
        self._dummy = aligned_empty((ALIGN,), torch.uint8, device)  # address for zero-size tensors

    def _use_profile(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Switch to the first profile whose box holds ``shapes``; False when none does."""
        for i, prof in enumerate(self.profiles):
            if fits_profile(shapes, prof):
                if i != self.current:
                    self.context.set_optimization_profile_async(i, self.stream.cuda_stream)
                    self.current = i
                return True
        return False

    def fits(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return any(fits_profile(shapes, p) for p in self.profiles)

    def _addr(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._dummy.data_ptr()

    def _bind(self, name: str, t: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, self._addr(t)):
            raise RefitError(f"TensorRT {self.name}: set_tensor_address({name}) refused address {self._addr(t):#x} "
                             f"(TensorRT wants {ALIGN}-byte alignment; see the TensorRT log)")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs (any device/dtype) -> outputs on the device; call under ``on_stream(self.stream)``. Every address bound
        is ``ALIGN``-aligned (a view that is not, such as a batch-1 slice of position ids, is copied)."""
        feeds = {n: aligned(feeds[n].to(device=self.device, dtype=self.dtypes[n])) for n in self.inputs}
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
            self._bind(n, t)
        outs = {}
        for n in self.outputs:
            shape = tuple(ctx.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise RefitError(f"TensorRT {self.name}: output {n} has unresolved shape {shape}")
            outs[n] = aligned_empty(shape, self.dtypes[n], self.device)
            self._bind(n, outs[n])
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RefitError(f"TensorRT {self.name}: execute_async_v3 failed (see the TensorRT log)")
        return outs
