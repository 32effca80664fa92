"""``refit export MODEL_DIR -o OUT_DIR``: HF checkpoint folder -> engine folder."""

from __future__ import annotations

import argparse

from export.build import build
from export.onnx_export import DTYPES, ExportOptions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="refit export",
        description="Export an HF checkpoint folder (GPT-2, Llama/Qwen2/Mistral, T5) to an engine folder: ONNX "
                    "graphs with a KV cache, refittable external weights, and manifest.json (I/O names, shape "
                    "profiles, HF->engine weight map, hashes, parity figures). Re-exporting the same weights with "
                    "the same options reuses the folder.")
    p.add_argument("model_dir", help="HF checkpoint folder (config.json + model.safetensors + tokenizer)")
    p.add_argument("-o", "--out", required=True, help="engine folder to write (atomically: temp folder, then rename)")
    p.add_argument("--backend", choices=["onnx", "tensorrt"], default="onnx",
                   help="onnx: ONNX graphs for ONNX Runtime; tensorrt: also build refittable TensorRT engines "
                        "(needs TensorRT and an NVIDIA GPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="engine weight/activation precision")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch (rows) the engine accepts")
    p.add_argument("--max-len", type=int, default=512, help="largest prompt + response length the engine accepts")
    p.add_argument("--parity-tol", type=float, default=None,
                   help="max |log-prob| difference engine vs PyTorch (default: 1e-4 fp32, 5e-2 fp16, 1e-1 bf16)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    opts = ExportOptions(backend=a.backend, dtype=a.dtype, max_batch=a.max_batch, max_len=a.max_len,
                         parity_tol=a.parity_tol)
    print(build(a.model_dir, a.out, "tensorrt" if a.backend == "tensorrt" else "onnxruntime", opts))
    return 0
