"""How to export: :class:`ExportOptions` (every field is part of the cache key), the checks of its values, the cache
key an engine folder is reused under, and the options as the manifest records them (the exporter that takes them:
:mod:`refit.export.onnx_export`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from refit.core.contract import ENGINE_BACKENDS, weights_hash
from refit.core.errors import RefitError

EXPORTER_VERSION = "5"  # bump when the graph layout changes, so cached engines are rebuilt


@dataclass(frozen=True)
class ExportOptions:
    """How to export. Every field is part of the cache key."""

    backend: str = "onnxruntime"  # "onnxruntime" | "tensorrt" (built from the same ONNX graphs); "onnx": the old name
    dtype: str = "fp32"  # "fp32" | "fp16" | "bf16": weights and activations of the engine
    max_batch: int = 64  # largest batch the engine accepts (TensorRT profile max)
    max_len: int = 512  # largest prompt + response length the engine accepts
    parity_tol: float | None = None  # max |logprob diff| allowed; default by dtype (fp32: 1e-4)
    # decoder attention: "fused" (ORT GroupQueryAttention over a preallocated KV buffer, refit/export/fused.py),
    # "plain" (standard ops, concatenated cache; TensorRT and the fallback), "auto" (fused where it
    # applies and passes the parity gate, else plain; the manifest records which and why)
    attention: str = "auto"
    # "int8": the linear layers run in int8 on ONNX Runtime's CPU provider (refit/export/quantize.py), pushes
    # re-quantized; backend "tensorrt": weight-only int8 through DequantizeLinear; "none": as exported (dtype)
    quantize: str = "none"
    # LoRA-ready (refit/export/lora.py): the linear layers PEFT's target_modules name ("all-linear" or module names) get
    # an adapter branch whose matrices are graph inputs, empty (off) unless a push binds them; (): none
    lora: tuple[str, ...] = ()
    # "bf16": the weights rounded to bf16 values before the export (graphs keep ``dtype``): the engine of a LoRA run
    # whose learner holds the base in bf16 (lora.base_dtype), so both hold one base; "none": the checkpoint's own
    round_weights: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "backend", export_backend(self.backend))
        if self.round_weights not in ("none", "bf16"):
            raise RefitError(f"round_weights {self.round_weights!r}: none or bf16")


def export_backend(name: str) -> str:
    """The engine backend an export is for, spelled as ``rollout.backend`` spells it: "onnxruntime" | "tensorrt".
    "onnx", the name ``refit export --backend`` had before, is taken with a FutureWarning (shown to users)."""
    if name == "onnx":
        warnings.warn("export backend 'onnx' is now spelled 'onnxruntime', as rollout.backend spells it",
                      FutureWarning, stacklevel=3)
        return "onnxruntime"
    if name not in ENGINE_BACKENDS:
        raise RefitError(f"export backend {name!r}: one of {', '.join(ENGINE_BACKENDS)}")
    return name


UNUSED = {"lora": (), "round_weights": "none"}  # ExportOptions fields at values the key and manifest leave out


def cache_key(model_dir: Path, opts: ExportOptions) -> str:
    skip = {"quantize": "none", **UNUSED}  # fields at unused values: the key from before those fields existed
    o = {k: v for k, v in asdict(opts).items() if k not in skip or v != skip[k]}
    if o["backend"] == "onnxruntime":  # the key of an ONNX Runtime export is what it was under its old name
        o["backend"] = "onnx"
    blob = json.dumps({"w": weights_hash(model_dir), "o": o, "v": EXPORTER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def recorded_options(opts: ExportOptions) -> dict:
    """``opts`` as the manifest's ``options`` records them: fields at unused values left out (the old layout)."""
    return {k: v for k, v in asdict(opts).items() if k not in UNUSED or v != UNUSED[k]}


def check_quantize(opts: ExportOptions) -> None:
    """One line for a quantization this export cannot make (refit/export/quantize.py)."""
    q = opts.quantize
    if q == "fp8":  # TensorRT's FP8 GEMMs want Q/DQ on activations too, with calibrated scales (docs/int8.md)
        raise RefitError("quantize fp8 is not built: FP8 matmuls need calibrated activation scales (a calibration "
                         "step refit does not have); use quantize int8 (TensorRT: weight-only Q/DQ)")
    if q not in ("none", "int8"):
        raise RefitError(f"unknown quantize {q!r}; choose none or int8")
    if q != "none" and opts.dtype != "fp32":
        raise RefitError(f"quantize {q} starts from fp32 weights; got dtype {opts.dtype}")
