"""The learner's fp32 CPU matmuls through oneDNN (``run.cpu_matmul``).

PyTorch's CPU build runs ``nn.Linear`` through its BLAS (MKL), whose fp32 GEMM reached 126-196 GFLOPS at a
Qwen2.5-1.5B micro-batch's shapes on this box's 2 AMD EPYC (Zen 4, AVX-512) cores, where oneDNN, which the same
build carries, reached 176-218 (``python scripts/learner_forward_ab.py``: a model's shapes and its forward and
backward, both routes, one JSON line). The forward and the input gradient of every fp32 linear layer (Linear; GPT-2's
Conv1D) can take oneDNN's route (``torch.ops.mkldnn._linear_pointwise``, the op TorchInductor's CPU backend lowers
linear layers to) with no other change: fp32 in, fp32 out, fp32 accumulation, only the order of the sums differs
(|d log-prob| ~1e-5 at Qwen2.5-1.5B, the engine-vs-learner gap the probe already allows). The weight gradient of a
trainable layer stays on BLAS (``g.T @ x``: as fast there as oneDNN in an ad hoc check at these shapes).

:func:`use_cpu_matmul` swaps the class of each ``nn.Linear``/``Conv1D`` of a learner model in place (parameters,
names, state dicts and PEFT's wrapping are unchanged; ``isinstance`` still holds), so a run is switched with one
call where its models are loaded, and :func:`restore` undoes it. A forward that is not fp32 on CPU (a bf16 base, bf16
autocast, a CUDA learner) or that is being traced or exported takes the layer's own forward.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from refit.core.errors import RefitError

MODES = ("auto", "onednn", "blas")


def onednn_available() -> bool:
    """Whether this torch carries oneDNN's linear op (CPU builds for x86-64 and aarch64 do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _dnn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN; ``weight`` (N, K) may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class _DnnLinearFn(torch.autograd.Function):
    """y = x W^T + b; forward and dL/dx by oneDNN, dL/dW = g^T x by BLAS (only where W is trained)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return _dnn(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _dnn(g, weight.t(), None)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = g2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() >= 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")  # bf16 autocast (run.precision): the layer's own, cast, forward
            and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()
            and not torch.compiler.is_compiling())


class DnnLinear(torch.nn.Linear):
    """``nn.Linear`` whose fp32 CPU forward/backward go through oneDNN (class swapped in by :func:`use_cpu_matmul`)."""

    def forward(self, x):
        if _fits(x, self.weight):
            return _DnnLinearFn.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class DnnConv1D(Conv1D):
    """GPT-2's ``Conv1D`` (weight (K, N)) through oneDNN, as :class:`DnnLinear`."""

    def forward(self, x):
        if _fits(x, self.weight):
            return _DnnLinearFn.apply(x, self.weight.t(), self.bias)
        return super().forward(x)


_SWAP = {torch.nn.Linear: DnnLinear, Conv1D: DnnConv1D}
_BACK = {v: k for k, v in _SWAP.items()}


def resolve(mode: str, device: torch.device | str) -> str:
    """``auto``: oneDNN for a CPU learner where torch carries it on x86-64 (measured faster here: module docstring);
    BLAS elsewhere (a CUDA learner has neither: this switch is CPU only)."""
    if mode not in MODES:
        raise RefitError(f"run.cpu_matmul {mode!r}: expected one of {', '.join(MODES)}")
    if torch.device(device).type != "cpu":
        return "blas"
    if mode == "onednn" and not onednn_available():
        raise RefitError("run.cpu_matmul onednn: this torch has no oneDNN linear op "
                         "(torch.ops.mkldnn._linear_pointwise); use auto or blas")
    if mode == "auto":
        return "onednn" if onednn_available() and platform.machine().lower() in ("x86_64", "amd64") else "blas"
    return mode


def swap_classes(model: torch.nn.Module, classes: dict) -> int:
    """Every module whose class is a key of ``classes`` gets the value as its class, in place; how many."""
    n = 0
    for m in model.modules():
        new = classes.get(type(m))
        if new is not None:
            m.__class__ = new
            n += 1
    return n


def use_cpu_matmul(model: torch.nn.Module, mode: str = "auto", device: torch.device | str = "cpu") -> int:
    """Route ``model``'s fp32 CPU linear layers through oneDNN (``mode`` resolved by :func:`resolve`); in place.
    Returns how many layers were switched (0 for ``blas``)."""
    return swap_classes(model, _SWAP) if resolve(mode, device) == "onednn" else 0


def restore(model: torch.nn.Module) -> int:
    """Undo :func:`use_cpu_matmul`: every switched layer back to its own class. Returns how many."""
    return swap_classes(model, _BACK)
