"""``refit export MODEL_DIR -o OUT_DIR``: HF checkpoint folder -> engine folder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from refit.export.build import build
from refit.export.onnx_export import ExportOptions
from refit.core.parsing import opt, parse


@dataclass(frozen=True)
class ExportConfig:
    """Export an HF checkpoint folder (any AutoModelForCausalLM or AutoModelForSeq2SeqLM whose forward keeps a
    transformers Cache: GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, Phi, OPT, T5, BART, Marian, ...) to an engine
    folder: ONNX graphs with a KV cache, refittable external weights, and manifest.json (I/O names, shape
    profiles, HF->engine weight map, hashes, parity figures, what the probe found). A model without a capability
    the engines need is refused in one line, before anything is written. Re-exporting the same weights with the
    same options reuses the folder."""

    model_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL_DIR")] = opt(
        help_="HF checkpoint folder (config.json + model.safetensors + tokenizer)")
    out: Annotated[str, tyro.conf.arg(aliases=["-o"])] = opt(
        help_="engine folder to write (atomically: temp folder, then rename)")
    backend: Literal["onnx", "tensorrt"] = opt("onnx", "onnx: ONNX graphs for ONNX Runtime; tensorrt: also build "
                                                       "refittable TensorRT engines (needs TensorRT and an NVIDIA GPU)")
    dtype: Literal["bf16", "fp16", "fp32"] = opt("fp32", "engine weight/activation precision")
    max_batch: int = opt(64, "largest batch (rows) the engine accepts")
    max_len: int = opt(512, "largest prompt + response length the engine accepts")
    parity_tol: float | None = opt(None, "max |log-prob| difference engine vs PyTorch (default: 1e-4 fp32, "
                                         "5e-2 fp16, 1e-1 bf16)")
    attention: Literal["auto", "fused", "plain"] = opt(
        "auto", "decoder attention: fused (ONNX Runtime GroupQueryAttention over one preallocated KV buffer per "
                "layer, written in place), plain (standard ops; what TensorRT builds from), auto (fused where it "
                "applies and passes the parity gate, else plain; recorded in the manifest)")
    quantize: Literal["none", "int8"] = opt(
        "none", "int8: linear layers in int8 (ONNX Runtime CPU: MatMulInteger, per-column int8 weights, per-row int8 "
                "activations), weight pushes re-quantized; parity-gated against PyTorch on the same quantized "
                "weights, the gap to fp32 recorded in the manifest (not on TensorRT yet)")


def main(argv: list[str] | None = None) -> int:
    a, _ = parse(ExportConfig, argv, "refit export")
    opts = ExportOptions(backend=a.backend, dtype=a.dtype, max_batch=a.max_batch, max_len=a.max_len,
                         parity_tol=a.parity_tol, attention=a.attention,
                         quantize=a.quantize)
    print(build(a.model_dir, a.out, "tensorrt" if a.backend == "tensorrt" else "onnxruntime", opts))
    return 0
