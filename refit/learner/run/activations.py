"""The learner's tanh-approximate GELU as one PyTorch op.

GPT-2 (``gelu_new``), GPT-J/CodeGen and several others compute the tanh GELU as transformers'
``NewGELUActivation`` / ``FastGELUActivation``: a chain of Python-level elementwise ops (pow, mul, add, tanh, mul,
add, mul), each a pass over the MLP's widest activation, each output saved for the backward. PyTorch's
``F.gelu(x, approximate="tanh")`` is the same formula, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, in one
fused kernel with one saved input. On small-gpt2's update (128 x 512 MLP, 26 rows x 148 positions) the layer's forward
and backward took 57.9 ms as the chain and 20.9 ms fused (this box, under load); values agree to 4.8e-7 absolute
(fp32 rounding order: the engine's own graph already differs from either by as much).

:func:`fuse_activations` swaps the class of each such module in place (no state: parameters, state dicts and saved
configs are unchanged); a forward being traced or exported takes the module's own chain, so an export of a learner
model is the graph the exporter always wrote. A policy and its PyTorch reference are both swapped (KL(0) exactly 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import FastGELUActivation, NewGELUActivation

from refit.learner.run.matmul import swap_classes, use_cpu_matmul


def _traced() -> bool:
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


class FusedNewGELU(NewGELUActivation):
    """``NewGELUActivation`` through ``F.gelu(approximate="tanh")`` (class swapped in by :func:`fuse_activations`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if _traced() else F.gelu(x, approximate="tanh")


class FusedFastGELU(FastGELUActivation):
    """``FastGELUActivation`` (the same formula, factored) through ``F.gelu(approximate="tanh")``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if _traced() else F.gelu(x, approximate="tanh")


_SWAP = {NewGELUActivation: FusedNewGELU, FastGELUActivation: FusedFastGELU}


def fuse_activations(model: torch.nn.Module) -> int:
    """Every tanh-GELU chain module of ``model`` computed by the fused op, in place; how many were swapped."""
    return swap_classes(model, _SWAP)


def learner_kernels(model: torch.nn.Module, cpu_matmul: str = "auto", device: torch.device | str = "cpu") -> None:
    """A learner model's kernels, in place: its linear layers on ``run.cpu_matmul``'s route
    (refit.learner.run.matmul.use_cpu_matmul) and its tanh GELU fused (:func:`fuse_activations`). Every learner model
    (policy, PyTorch reference, distillation teacher and student) takes both here, so a policy and its reference
    compute alike (KL(0) exactly 0)."""
    use_cpu_matmul(model, cpu_matmul, device)
    fuse_activations(model)


__all__ = ["FusedFastGELU", "FusedNewGELU", "fuse_activations", "learner_kernels"]
