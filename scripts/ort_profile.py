"""Where one ONNX Runtime decode step of the fused graph goes: ORT's own profiler, aggregated.

Runs ``engine.generate`` (``--rows`` rows x ``--new_tokens``, temperature 1) on an engine folder with
``SessionOptions.enable_profiling`` on the decoder session, keeps the decode runs (every run but the
first of a generate call, whose input is the prompt) of the last call, and aggregates ORT's JSON per
op type and per node: total and per-step time, share of the summed node time, and how much of each
step is outside any node (executor, IO binding, thread hand-offs). Prints a table and, last, one JSON
line; the raw trace and the table go to ``--out`` (default runs/engine/profile-<label>).

    PYTHONPATH=. python scripts/ort_profile.py --engine runs/engine/small-gpt2-engine --label after

Works on any checkout that has ``refit.rollout.engine.create_engine`` (run it with PYTHONPATH at an older
checkout to profile that code: the script only wraps ``refit.export.graph.session_options``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path


def profile_generate(a, out: Path) -> tuple[list[dict], float, int | None, Path]:
    """Two ``generate`` calls (warm-up, then timed) on an engine whose decoder session profiles itself: (ORT's trace
    events, the timed call's seconds, its response tokens, the trace file)."""
    import numpy as np
    import torch

    import refit.export.graph as graph

    base = graph.session_options

    def profiled(*args, **kw):
        so = base(*args, **kw)
        so.enable_profiling = True
        so.profile_file_prefix = str(out / "ort")
        return so

    graph.session_options = profiled
    # imported after the patch (not at the top), so the engine's module picks up the profiling options
    from refit.rollout.engine import create_engine
    from refit.rollout.types import SamplingParams

    torch.set_num_threads(a.threads)
    eng = create_engine("onnxruntime", a.engine, threads=a.threads)
    graph.session_options = base
    sess = eng.sessions["decoder"]
    prompts = np.random.default_rng(0).integers(4, eng.spec.vocab_size, size=(a.rows, a.prompt_len)).tolist()
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=0)
    eng.generate(prompts, params)  # warm-up (its runs are in the trace, dropped below)
    t0 = time.perf_counter()
    res = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = int(res.response_mask.sum()) if hasattr(res, "response_mask") else None
    trace = Path(sess.end_profiling())
    return json.loads(trace.read_text()), wall, tokens, trace


def node_times(events: list[dict], decode: list[dict]) -> tuple[dict, dict, dict, list[float]]:
    """ORT's node events inside the ``decode`` runs: (us by op type, us by node, each node's op type, the summed
    node time of each run)."""
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    by_type, by_node = defaultdict(float), defaultdict(float)
    node_type = {}
    step_nodes = []
    j = 0
    for r in decode:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        while j < len(nodes) and nodes[j]["ts"] < lo:
            j += 1
        s = 0.0
        k = j
        while k < len(nodes) and nodes[k]["ts"] <= hi:
            e = nodes[k]
            name = e["name"][: -len("_kernel_time")]
            op = e["args"].get("op_name", "?")
            by_type[op] += e["dur"]
            by_node[name] += e["dur"]
            node_type[name] = op
            s += e["dur"]
            k += 1
        step_nodes.append(s)
        j = k
    return by_type, by_node, node_type, step_nodes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="runs/engine/small-gpt2-engine")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default="run")
    p.add_argument("--out", default="")
    p.add_argument("--top", type=int, default=25, help="nodes listed")
    a = p.parse_args()

    out = Path(a.out or f"runs/engine/profile-{a.label}")
    out.mkdir(parents=True, exist_ok=True)
    events, wall, tokens, trace = profile_generate(a, out)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    n_call = len(runs) // 2  # two generate calls of the same length
    runs = runs[-n_call:]
    decode = runs[1:]  # the first run of the call is the prefill
    by_type, by_node, node_type, step_nodes = node_times(events, decode)
    steps = len(decode)
    run_us = [r["dur"] for r in decode]
    node_total = sum(by_type.values())
    lines = [f"# {a.label}: {steps} decode runs of {a.rows} rows; model_run median {statistics.median(run_us) / 1e3:.3f} ms, "
             f"node time median {statistics.median(step_nodes) / 1e3:.3f} ms/step, outside nodes "
             f"{statistics.median([r - s for r, s in zip(run_us, step_nodes)]) / 1e3:.3f} ms/step; "
             f"generate wall {wall:.3f} s, load {os.getloadavg()[0]:.2f}",
             f"{'op type':<28} {'ms/step':>8} {'share':>6} {'nodes':>5}"]
    count = defaultdict(int)
    for n, op in node_type.items():
        count[op] += 1
    for op, us in sorted(by_type.items(), key=lambda kv: -kv[1]):
        lines.append(f"{op:<28} {us / steps / 1e3:8.3f} {us / node_total:6.1%} {count[op]:5d}")
    lines.append(f"{'node':<60} {'op':<22} {'ms/step':>8}")
    for n, us in sorted(by_node.items(), key=lambda kv: -kv[1])[: a.top]:
        lines.append(f"{n[:60]:<60} {node_type[n][:22]:<22} {us / steps / 1e3:8.3f}")
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    summary = {"label": a.label, "engine": a.engine, "rows": a.rows, "decode_runs": steps,
               "model_run_ms_p50": round(statistics.median(run_us) / 1e3, 3),
               "node_ms_p50": round(statistics.median(step_nodes) / 1e3, 3),
               "outside_nodes_ms_p50": round(statistics.median([r - s for r, s in zip(run_us, step_nodes)]) / 1e3, 3),
               "by_op_ms_per_step": {op: round(us / steps / 1e3, 4) for op, us in
                                     sorted(by_type.items(), key=lambda kv: -kv[1])},
               "nodes": len(node_type), "generate_s": round(wall, 3), "tokens": tokens,
               "load_avg": [round(x, 2) for x in os.getloadavg()], "trace": str(trace)}
    (out / "summary.json").write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
