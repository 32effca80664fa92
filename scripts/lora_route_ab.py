"""Two ways to get a LoRA adapter into a running ONNX Runtime engine, measured on one LoRA-ready engine folder.

A (Refit's): the adapter's inputs bound as ``OrtValue`` s over the engine's own numpy buffers
  (refit/rollout/ort_adapter.py); a push is ``OrtEngine.update_weights`` of PEFT-named tensors: an in-place copy.
B (ONNX Runtime's): ``onnxruntime.AdapterFormat`` with the same matrices, exported to an ``.onnx_adapter`` file,
  loaded as ``onnxruntime.LoraAdapter`` and activated per run with ``RunOptions.add_active_adapter``.

Both feed the same graph inputs (the overridable initializers refit/export/lora.py makes), so a run costs the same; the
push differs. The script pushes a random rank-``--r`` adapter on every target ``--repeats`` times each way, checks
that both give the same logits, and ends with one JSON line.

    python scripts/lora_route_ab.py ENGINE_DIR [--r 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    from refit.core.manifest_sections import lora_inputs, lora_push_names
    from refit.rollout.engine import create_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine_dir")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    eng = create_engine("onnxruntime", a.engine_dir, threads=a.threads, hold_weights=False)
    targets = eng.manifest.lora.targets
    g = torch.Generator().manual_seed(0)

    def adapter() -> dict[str, torch.Tensor]:
        out = {}
        for m, t in targets.items():
            an, bn = lora_push_names(m)
            out[an] = torch.randn(a.r, t.in_features, generator=g) * 0.02
            out[bn] = torch.randn(t.out_features, a.r, generator=g) * 0.02
        return out

    # A: the engine's push
    times_a = []
    for _ in range(a.repeats):
        tensors = adapter()
        t0 = time.perf_counter()
        eng.update_weights(tensors)
        times_a.append(time.perf_counter() - t0)
    # B: the same last adapter through ONNX Runtime's adapter file
    times_b, folder = [], Path(tempfile.mkdtemp())
    for i in range(a.repeats):
        t0 = time.perf_counter()
        params = {}
        for m in targets:
            (an, bn), (ai, bi) = lora_push_names(m), lora_inputs(m)
            params[ai] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(tensors[an].t().numpy()))
            params[bi] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(tensors[bn].t().numpy()))
        fmt = ort.AdapterFormat()
        fmt.set_adapter_version(i)
        fmt.set_model_version(1)
        fmt.set_parameters(params)
        fmt.export_adapter(str(folder / "a.onnx_adapter"))
        loaded = ort.LoraAdapter()
        loaded.Load(str(folder / "a.onnx_adapter"))
        opts = ort.RunOptions()
        opts.add_active_adapter(loaded)
        times_b.append(time.perf_counter() - t0)
    # the same logits either way: one prefill of a short batch through the raw session
    sess = eng.sessions.raw["decoder"]
    feeds = {"input_ids": np.array([[5, 6, 7, 8]], np.int64), "position_ids": np.arange(4)[None].astype(np.int64),
             "seqlens_k": np.array([3], np.int32), "query_seqlens": np.array([4], np.int32),
             "total_sequence_length": np.array(4, np.int32), "logits_index": np.array([[3]], np.int64)}
    d = eng.manifest.dims
    for n in eng.manifest.graphs["decoder"].inputs:
        if n.startswith("past."):
            feeds[n] = np.zeros((1, d.n_kv_heads, 8, d.head_dim), np.float32)
    logits_b = sess.run(["logits"], feeds, opts)[0]
    logits_a = eng.sessions["decoder"].run(["logits"], feeds)[0]
    mb = sum(t.numel() * 4 for t in tensors.values()) / 2**20
    print(json.dumps({"engine": str(a.engine_dir), "targets": len(targets), "r": a.r, "adapter_mb": round(mb, 2),
                      "bound_inputs_push_s": statistics.median(times_a), "ort_lora_adapter_push_s":
                      statistics.median(times_b), "ort_over_bound": round(statistics.median(times_b)
                                                                          / statistics.median(times_a), 1),
                      "max_abs_logit_diff_a_vs_b": float(np.abs(logits_a - logits_b).max())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
