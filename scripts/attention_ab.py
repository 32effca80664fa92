"""Decode-step attention in ONNX Runtime on the CPU: the fused graph's ``com.microsoft.GroupQueryAttention``
against standard ops (MatMul, Softmax, MatMul) reading the same KV cache, same run, same data.

One session per variant holds ``--layers`` attention layers, each over its own K/V cache (so a step reads as
much cache as a model of that depth: past the last-level cache at the default sizes), all queried at once:

- ``gqa``: GroupQueryAttention over a ``--buffer``-long in-place cache (past = present, as the engine binds it),
  ``seqlens_k`` = context - 1, the new token's K/V written at position context - 1 by the op;
- ``matmul_exact``: standard ops over exactly ``context`` cached positions (what a cache grown to length
  would read); the ``kv_heads`` groups of queries are one (group, head_dim) x (head_dim, context) MatMul each;
- ``matmul_chunk``: the same over the context rounded up to ``--chunk`` positions, the rest masked;
- ``matmul_buffer``: the same over the whole ``--buffer``, masked;
- ``torch_sdpa``: PyTorch's ``scaled_dot_product_attention`` (HF's default attention on the CPU) over views of
  the first ``context`` positions of the same buffers, with their slack (``torch.set_num_threads(--threads)``);
- ``read_only``: no attention, ``torch.sum`` of those same views: the time this CPU takes to read the bytes a
  step's attention must read, laid out as the buffers hold them (the floor for any kernel over this cache).
  Blocks with gaps read at well under the streaming rate (figures: docs/engine-step.md, docs/performance.md).

The matmul variants read the cache GroupQueryAttention wrote, and their outputs are checked against its
output (``max_abs_diff``): the same attention, computed two ways. Timings: per variant the best of 3 rounds'
mean of ``--repeats`` runs, the variants interleaved round by round. The last stdout line is one JSON document.

    python scripts/attention_ab.py                                # small-gpt2's geometry: 128 rows, 4 x 32
    python scripts/attention_ab.py --rows 32 --heads 32 --kv_heads 8 --head_dim 64 --layers 2 --contexts 256
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _sess(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def gqa_model(a, rows: int):
    from onnx import TensorProto as TP, helper as h

    hq, hk, d = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.head_dim
    inputs = [h.make_tensor_value_info("q", TP.FLOAT, [rows, 1, hq]), h.make_tensor_value_info("k", TP.FLOAT, [rows, 1, hk]),
              h.make_tensor_value_info("v", TP.FLOAT, [rows, 1, hk]), h.make_tensor_value_info("seqlens_k", TP.INT32, [rows]),
              h.make_tensor_value_info("total", TP.INT32, [])]
    nodes, outputs = [], []
    for i in range(a.layers):
        inputs += [h.make_tensor_value_info(f"past.{i}.{n}", TP.FLOAT, [rows, a.kv_heads, a.buffer, d]) for n in "kv"]
        nodes.append(h.make_node("GroupQueryAttention", ["q", "k", "v", f"past.{i}.k", f"past.{i}.v", "seqlens_k", "total"],
                                 [f"o{i}", f"present.{i}.k", f"present.{i}.v"], domain="com.microsoft",
                                 num_heads=a.heads, kv_num_heads=a.kv_heads, scale=d ** -0.5))
        outputs += [f"o{i}", f"present.{i}.k", f"present.{i}.v"]
    g = h.make_graph(nodes, "gqa", inputs, [h.make_tensor_value_info(n, TP.FLOAT, None) for n in outputs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])


def matmul_model(a, rows: int, length: int):
    """Standard-op attention over ``length`` cached positions: q (B, H_kv, g, D) @ K^T -> + mask -> Softmax -> @ V."""
    from onnx import TensorProto as TP, helper as h, numpy_helper as nh
    import numpy as np

    g_, d = a.heads // a.kv_heads, a.head_dim
    inputs = [h.make_tensor_value_info("q", TP.FLOAT, [rows, a.kv_heads, g_, d]),
              h.make_tensor_value_info("mask", TP.FLOAT, [rows, 1, 1, length])]
    inits = [nh.from_array(np.array(d ** -0.5, np.float32), "scale"),
             nh.from_array(np.array([rows, 1, a.heads * d], np.int64), "out_shape")]
    nodes = [h.make_node("Mul", ["q", "scale"], ["qs"])]
    outputs = []
    for i in range(a.layers):
        inputs += [h.make_tensor_value_info(f"K{i}", TP.FLOAT, [rows, a.kv_heads, length, d]),
                   h.make_tensor_value_info(f"V{i}", TP.FLOAT, [rows, a.kv_heads, length, d])]
        nodes += [h.make_node("Transpose", [f"K{i}"], [f"Kt{i}"], perm=[0, 1, 3, 2]),
                  h.make_node("MatMul", ["qs", f"Kt{i}"], [f"s{i}"]),
                  h.make_node("Add", [f"s{i}", "mask"], [f"sm{i}"]),
                  h.make_node("Softmax", [f"sm{i}"], [f"p{i}"], axis=-1),
                  h.make_node("MatMul", [f"p{i}", f"V{i}"], [f"a{i}"]),
                  h.make_node("Reshape", [f"a{i}", "out_shape"], [f"o{i}"])]
        outputs.append(f"o{i}")
    g = h.make_graph(nodes, "mm", inputs, [h.make_tensor_value_info(n, TP.FLOAT, None) for n in outputs], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _interleaved(fns: dict, repeats: int, rounds: int = 3) -> dict[str, float]:
    """Per variant, the best over ``rounds`` of the mean of ``repeats`` runs (ms), after a warm-up run; the
    variants take turns round by round, so a load burst on a shared CPU falls on all of them."""
    for fn in fns.values():
        fn()
    means = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            means[n].append((time.perf_counter() - t0) / repeats * 1e3)
    return {n: min(v) for n, v in means.items()}


def run(a) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    if a.heads % a.kv_heads:
        raise SystemExit(f"--heads {a.heads} is not a multiple of --kv_heads {a.kv_heads}")
    rng = np.random.default_rng(0)
    B, d, g_ = a.rows, a.head_dim, a.heads // a.kv_heads
    out = {"attention_ab": True, "rows": B, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": d,
           "layers": a.layers, "buffer": a.buffer, "chunk": a.chunk, "threads": a.threads,
           "onnxruntime": ort.__version__, "contexts": {}}
    gqa = _sess(gqa_model(a, B), a.threads)
    for T in a.contexts:
        if not 1 <= T <= a.buffer:
            raise SystemExit(f"context {T} is outside [1, --buffer {a.buffer}]")
        # GroupQueryAttention: past T-1 positions + the new token, written in place at T-1
        caches = [rng.standard_normal((B, a.kv_heads, a.buffer, d), dtype=np.float32) for _ in range(2 * a.layers)]
        q = rng.standard_normal((B, 1, a.heads * d), dtype=np.float32)
        k, v = (rng.standard_normal((B, 1, a.kv_heads * d), dtype=np.float32) for _ in range(2))
        io = gqa.io_binding()
        for name, arr in (("q", q), ("k", k), ("v", v), ("seqlens_k", np.full(B, T - 1, np.int32)),
                          ("total", np.array(T, np.int32))):
            io.bind_cpu_input(name, arr)
        for i in range(a.layers):  # bound first: get_outputs() lists outputs in binding order
            io.bind_output(f"o{i}")
        for i in range(a.layers):
            for j, n in enumerate("kv"):
                val = ort.OrtValue.ortvalue_from_numpy(caches[2 * i + j])  # shares the numpy array's memory
                io.bind_ortvalue_input(f"past.{i}.{n}", val)
                io.bind_ortvalue_output(f"present.{i}.{n}", val)
        gqa.run_with_iobinding(io)
        ref = [o.numpy() for o in io.get_outputs()[: a.layers]]
        variants = {"gqa": lambda io=io: gqa.run_with_iobinding(io)}
        diffs = {}
        lengths = {"matmul_exact": T, "matmul_chunk": min(a.buffer, -(-T // a.chunk) * a.chunk), "matmul_buffer": a.buffer}
        qg = q.reshape(B, a.kv_heads, g_, d)  # query heads h = kv_head * g + j, as GroupQueryAttention groups them
        for name, L in lengths.items():
            s = _sess(matmul_model(a, B, L), a.threads)
            mio = s.io_binding()
            mask = np.zeros((B, 1, 1, L), np.float32)
            mask[..., T:] = -np.inf
            mio.bind_cpu_input("q", np.ascontiguousarray(qg))
            mio.bind_cpu_input("mask", mask)
            for i in range(a.layers):  # the cache GroupQueryAttention wrote (the new token at T - 1), L positions
                mio.bind_cpu_input(f"K{i}", np.ascontiguousarray(caches[2 * i][:, :, :L]))
                mio.bind_cpu_input(f"V{i}", np.ascontiguousarray(caches[2 * i + 1][:, :, :L]))
            for i in range(a.layers):
                mio.bind_output(f"o{i}")
            s.run_with_iobinding(mio)
            diffs[name] = float(max(np.abs(o.numpy() - r).max() for o, r in zip(mio.get_outputs(), ref)))
            variants[name] = lambda s=s, mio=mio: s.run_with_iobinding(mio)
        views = [torch.from_numpy(c)[:, :, :T] for c in caches]  # the same memory, the slack as GQA sees it
        qt = torch.from_numpy(q).view(B, 1, a.heads, d).transpose(1, 2)
        sdpa = [F.scaled_dot_product_attention(qt, views[2 * i], views[2 * i + 1], enable_gqa=g_ > 1)
                for i in range(a.layers)]
        diffs["torch_sdpa"] = float(max(np.abs(o.transpose(1, 2).reshape(B, 1, -1).numpy() - r).max()
                                        for o, r in zip(sdpa, ref)))
        variants["torch_sdpa"] = lambda: [F.scaled_dot_product_attention(qt, views[2 * i], views[2 * i + 1],
                                                                         enable_gqa=g_ > 1) for i in range(a.layers)]
        variants["read_only"] = lambda: [v.sum() for v in views]
        with torch.inference_mode():
            ms = _interleaved(variants, a.repeats)
        kv_mb = 2 * a.layers * B * a.kv_heads * T * d * 4 / 1e6
        row = {"ms": {n: round(x, 3) for n, x in ms.items()}, "lengths": lengths, "kv_mb_read": round(kv_mb, 2),
               "gqa_over": {n: round(ms["gqa"] / ms[n], 3) for n in [*lengths, "torch_sdpa", "read_only"]},
               "gbps": {n: round(kv_mb / 1e3 / (ms[n] / 1e3), 2) for n in ms},  # cache MB a step must read / time
               "max_abs_diff_vs_gqa": diffs}
        out["contexts"][str(T)] = row
        print(f"context {T:>4}: " + "  ".join(f"{n} {ms[n]:.3f} ms" for n in ms)
              + f"  | gqa / matmul_exact {row['gqa_over']['matmul_exact']:.2f}x, / matmul_chunk "
              f"{row['gqa_over']['matmul_chunk']:.2f}x, / read_only {row['gqa_over']['read_only']:.2f}x"
              f"  | max |diff| {max(diffs.values()):.2e}", flush=True)
    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[40, 96, 150])
    p.add_argument("--buffer", type=int, default=160, help="GroupQueryAttention's in-place cache length")
    p.add_argument("--chunk", type=int, default=16, help="matmul_chunk rounds the context up to this")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    print(json.dumps(run(p.parse_args())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
