"""``refit bench inflight``: a variable-length workload, static batches vs in-flight batching.

Workload: ``rows`` prompts, responses up to ``max_new_tokens`` that stop at spread lengths. A
random-weight model samples nearly uniformly over its vocabulary, so a *length-sampled stop* is
used: a fixed set of ``V * stop_frac`` token ids ends a row, i.e. each step stops a row with
probability ~``stop_frac`` (geometric lengths, mean ~1/stop_frac, capped at ``max_new_tokens``).

- static: the rows in consecutive batches of ``slots`` (an engine batch), each batch decoded until
  its longest row ends (finished rows ride along as padding), as ``generate()`` did before
  (``OrtEngine(slots=..., inflight=False)``).
- in-flight: one ``generate()`` over all rows with ``slots`` slots; a freed slot takes the next row.

Both runs use the same engine and seed, are interleaved (static, in-flight, static, ...), and must
give identical rows (checked: tokens equal, log-probs equal). Reported: tokens/s (generated tokens
over wall time, median of ``repeats``), decode steps run, and the peak RSS. Last stdout line: JSON.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from refit.bench.generate import PeakRSS
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams


def _rows(out) -> list[tuple[list[int], list[float]]]:
    """Each row's (tokens, plain log-probs) without padding."""
    rows = []
    for ids, m, lp in zip(out.response_ids, out.response_mask, out.rollout_plain_logprobs):
        n = int(m.sum())
        rows.append((ids[:n].tolist(), lp[:n].tolist()))
    return rows


def bench_inflight(engine_dir: Path, rows: int, slots: int, prompt_len: int, max_new_tokens: int, stop_frac: float,
                   repeats: int, threads: int, log=print) -> dict:
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    static_eng = create_engine("onnxruntime", engine_dir, threads=threads, slots=slots, inflight=False)
    inflight_eng = create_engine("onnxruntime", engine_dir, threads=threads, slots=slots)
    v = static_eng.spec.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, v, size=(rows, prompt_len)).tolist()
    stops = tuple(int(x) for x in rng.choice(np.arange(4, v), size=max(1, int(v * stop_frac)), replace=False))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=0, stop_ids=stops)
    runs = {"static": lambda: static_eng.generate(prompts, sampling),
            "inflight": lambda: inflight_eng.generate(prompts, sampling)}
    for fn in runs.values():  # warm-up (also sizes each engine's KV buffer)
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    peak, got = {}, {}
    for _ in range(repeats):
        for name, fn in runs.items():
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                got[name] = fn()
                times[name].append(time.perf_counter() - t0)
            peak[name] = max(peak.get(name, 0.0), mem.mb)
    static_rows, inflight_rows = _rows(got["static"]), _rows(got["inflight"])
    identical = [a[0] for a in static_rows] == [b[0] for b in inflight_rows] and all(
        np.allclose(a[1], b[1], atol=1e-5, rtol=0) for a, b in zip(static_rows, inflight_rows))
    tokens = sum(len(r[0]) for r in static_rows)
    lengths = [len(r[0]) for r in static_rows]
    steps_static = sum(max(lengths[i:i + slots]) for i in range(0, rows, slots))
    res = {}
    for name in runs:
        t = statistics.median(times[name])
        res[name] = {"tokens_per_s": round(tokens / t, 1), "wall_s": round(t, 3), "peak_rss_mb": round(peak[name], 1)}
        log(f"{name:<9} {res[name]['tokens_per_s']:8.1f} tok/s  {t:6.2f} s  peak RSS {peak[name]:.0f} MB")
    log(f"rows identical: {identical}; lengths mean {np.mean(lengths):.1f}, min {min(lengths)}, max {max(lengths)}")
    for e in (static_eng, inflight_eng):
        e.close()
    return {"bench": "inflight", "engine": str(engine_dir), "rows": rows, "slots": slots, "prompt_len": prompt_len,
            "max_new_tokens": max_new_tokens, "stop_frac": stop_frac, "threads": threads, "repeats": repeats,
            "generated_tokens": tokens, "length_mean": round(float(np.mean(lengths)), 1),
            "length_min": min(lengths), "length_max": max(lengths), "static_decode_steps": steps_static,
            "results": res, "speedup": round(res["static"]["wall_s"] / res["inflight"]["wall_s"], 3),
            "rows_identical": identical, "load_avg": {"start": [round(x, 2) for x in load_before],
                                                      "end": [round(x, 2) for x in os.getloadavg()]}}
