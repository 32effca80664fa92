"""Before/after of the engine's rollout in ONE process, interleaved call by call, with HF ``generate()`` beside it.

On a shared CPU the load moves between runs started minutes apart; here every round runs, in turn, HF
``generate()``, this checkout's engine ("after") and the same engine with a main checkout's sampler and
per-row random streams put back and the prompt deduplication off ("before"; ``--base`` is that checkout's
root, whose ``refit/rollout/sampling.py`` (``rollout/sampling.py`` in a checkout from before the rooms moved
into refit/) is loaded under another module name). Both engine sides share one ONNX Runtime session. Prints
per-call times and, last, one JSON line with medians and ratios.

    PYTHONPATH=. python scripts/engine_ab.py --base /tmp/engine_base --rounds 4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time


def _load_base_sampling(root: str):
    paths = [os.path.join(root, *parts, "sampling.py") for parts in (("refit", "rollout"), ("rollout",))]
    path = next((p for p in paths if os.path.isfile(p)), paths[0])  # the second: a checkout older than the move
    spec = importlib.util.spec_from_file_location("refit_base_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["refit_base_sampling"] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _before(base):
    """The decode loop on main's sampler (per-row generators) and without prompt deduplication."""
    import refit.rollout.decode as decode
    import refit.rollout.ort_fused as fused

    saved = (decode.RowStreams, decode.sample_step, decode.StepBuffers, getattr(fused, "DEDUP_MIN", None))
    decode.RowStreams, decode.sample_step, decode.StepBuffers = base.RowStreams, base.sample_step, base.StepBuffers
    if saved[3] is not None:
        fused.DEDUP_MIN = 10**9
    try:
        yield
    finally:
        decode.RowStreams, decode.sample_step, decode.StepBuffers = saved[:3]
        if saved[3] is not None:
            fused.DEDUP_MIN = saved[3]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="/tmp/engine_base", help="a main checkout (its refit/rollout/sampling.py is "
                   "'before')")
    p.add_argument("--model", default="runs/engine/small-gpt2")
    p.add_argument("--engine", default="runs/engine/small-gpt2-engine")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no_hf", action="store_true")
    a = p.parse_args()

    import numpy as np
    import torch

    from refit.bench.generate import engine_call, hf_call
    from refit.core.hf_folder import load_model, model_info
    from refit.rollout.engine import create_engine

    torch.set_num_threads(a.threads)
    base = _load_base_sampling(a.base)
    info = model_info(a.model)
    prompts = np.random.default_rng(0).integers(4, info.vocab_size, size=(a.prompts, a.prompt_len)).tolist()
    eng = create_engine("onnxruntime", a.engine, threads=a.threads)
    after = engine_call(eng, prompts, a.new_tokens, a.n)

    def before(r):
        with _before(base):
            return after(r)

    calls = {"engine_before": before, "engine_after": after}
    if not a.no_hf:
        calls = {"hf_generate": hf_call(load_model(a.model, info, attn="sdpa"), prompts, a.new_tokens, info.pad_id,
                                        "left", a.n), **calls}
    load0 = os.getloadavg()
    same = before(0)[3] == after(0)[3]  # warm-up; the same seed gives as many response tokens
    for c in calls.values():
        c(0)
    times = {k: [] for k in calls}
    for r in range(a.rounds):
        for k, c in calls.items():
            t0 = time.perf_counter()
            c(r)
            times[k].append(time.perf_counter() - t0)
            print(f"round {r} {k:<14} {times[k][-1]:.3f} s  load {os.getloadavg()[0]:.2f}", flush=True)
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out = {"engine_ab": True, "rows": a.prompts * a.n, "n": a.n, "new_tokens": a.new_tokens, "threads": a.threads,
           "rounds": a.rounds, "median_s": med, "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
           "after_speedup_over_before": round(med["engine_before"] / med["engine_after"], 3),
           "same_response_token_count": same, "load_avg": {"start": [round(x, 2) for x in load0],
                                                      "end": [round(x, 2) for x in os.getloadavg()]}}
    if "hf_generate" in med:
        out["hf_over_engine_before"] = round(med["hf_generate"] / med["engine_before"], 3)
        out["hf_over_engine_after"] = round(med["hf_generate"] / med["engine_after"], 3)
        # per round, HF's call over the engine's call in the same round (load shared within a round)
        out["hf_over_engine_after_per_round"] = [round(h / e, 3) for h, e in zip(times["hf_generate"],
                                                                                  times["engine_after"])]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
