"""Generation latency and weight-push benchmarks (``refit bench generate`` / ``refit bench refit``).

``bench_generate`` runs, in one process, the same model and prompts through HF ``generate()``
(KV cache, sampling, the baseline users run today) and through Refit's engines, for each batch
size: warm-up, then ``repeats`` timed runs; it reports the median of time to first token
(prefill + first sample), per-token decode latency p50/p95 (the steps after the first),
tokens/s over the whole call, and the peak resident memory growth during the runs. Phase times
come from the engines' public ``generate(..., on_step=)`` hook (:class:`refit.rollout.engine.StepEvent`);
for HF ``generate()`` from the same events, emitted by :class:`refit.rollout.hf_backend.HFStepClock`
(its time to first token also counts ``generate()``'s own set-up, part of what users pay).
HF runs with ``min_new_tokens = new_tokens``; Refit's engines stop a row only at EOS, which a
random-weight 50257-way model samples with probability ~2e-5 per token, and tokens/s counts the
decode steps actually run, so the work compared is the same.
Engines: ``onnxruntime`` is the engine folder (the fused-attention graph by default),
``onnxruntime-plain`` the standard-op graph of the same model, exported beside it. Each row carries
``matmul_fraction``: the decode step's FLOPs (:func:`decode_step_gflop`) over its median time, divided
by the GFLOP/s that plain ``torch.matmul`` of the same shapes reaches here in the same run
(:func:`matmul_gflops`): how far the step is from the cores' matmul limit. And the step's roofline floor
(:func:`step_floor`): the KV cache bytes a decode step must read (:func:`decode_step_kv_bytes`) at this machine's
measured streaming read rate (:func:`read_gbps`), plus its FLOPs at the matmul rate: no engine's decode step can
be shorter here, so ``hf_decode_over_floor`` is the most any engine could gain over HF ``generate()`` per decode
step on this machine (``shared_prefix``: the same when the ``n`` samples of a prompt read its cache once).
The backends run interleaved (one timed call of each in turn, ``repeats`` rounds), so a load burst on
the shared CPU hits all of them; each row also has every call's time (``call_s_all``) and the response
tokens actually produced (``response_tokens``: an engine stops a row at EOS, which a small-vocabulary
model samples often; the batch still runs until its longest row ends, so ``hf_call_s_over_engine_call_s``
compares the same number of decode steps). ``n`` samples per prompt make each batch ``batch / n`` prompts
(``num_return_sequences`` for HF), the PPO/GRPO shape. The small-model, large-batch workload:

    refit bench generate --geometry small-gpt2 --backends onnxruntime --batch_sizes 128 --n 8 \
        --prompt_len 32 --new_tokens 128 --threads 1

The last stdout line is one JSON document; it carries the load averages at the start and end
(``load_avg``), since the CPU is shared.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from refit.core.hf_folder import load_model, model_info
from refit.core.integrity import clean_stale_temps
from refit.core.manifest import Manifest
from refit.core.padding import native_padding_side, pad_batch
from refit.export.options import ExportOptions
from refit.export.weight_map import canonical_params
from refit.rollout.build import build, plain_twin
from refit.rollout.engine import create_engine
from refit.rollout.hf_backend import HFStepClock
from refit.rollout.types import SamplingParams


class PeakRSS:
    """Peak resident set size of this process (MB, ``mb``) while the context is open, sampled at 200 Hz.

    Absolute, not a delta: every backend's model/engine is loaded before the first run, so later
    rows read the process peak so far; compare rows of one backend across batch sizes."""

    def __enter__(self):
        self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())
        self.mb = self.peak / 2**20


def _load(before: tuple[float, float, float]) -> dict:
    """1/5/15-minute load averages at the start and end: the CPU is shared, so numbers need them."""
    return {"start": [round(x, 2) for x in before], "end": [round(x, 2) for x in os.getloadavg()]}


def _summarise(t_calls: list[float], runs: list[list], rows: int, new_tokens: int, mem: float) -> dict:
    """Medians over ``runs`` (one list of :class:`refit.rollout.engine.StepEvent` per timed call)."""
    assert all(r and r[0].phase == "prefill" for r in runs), "every call reports its prefill first"
    ttft = [r[0].seconds for r in runs]
    gaps = [e.seconds for r in runs for e in r[1:]]
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "decode_ms_p50": 1e3 * float(np.percentile(gaps, 50)) if gaps else float("nan"),
        "decode_ms_p95": 1e3 * float(np.percentile(gaps, 95)) if gaps else float("nan"),
        "tokens_per_s": rows * new_tokens / statistics.median(t_calls),
        "call_s": statistics.median(t_calls),
        "peak_rss_mb": round(mem, 1),
    }


def engine_call(engine, prompts: list[list[int]], new_tokens: int, n: int = 1):
    """One timed ``engine.generate`` of ``prompts`` x ``n`` samples, seeded by the repeat: r -> (seconds, step
    events, response positions run, response tokens)."""
    def call(r: int):
        events: list = []
        t0 = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=r, n=n),
                              on_step=events.append)
        return time.perf_counter() - t0, events, out.response_ids.shape[1], int(out.response_mask.sum())

    return call


def hf_call(model, prompts: list[list[int]], new_tokens: int, pad_id: int, side: str = "left", n: int = 1):
    """The same for HF ``generate()`` (``num_return_sequences=n``, every row runs ``new_tokens``)."""
    from transformers import LogitsProcessorList

    ids, mask = pad_batch(prompts, pad_id, side)  # the padding rule (refit.core.padding): the engines' too
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    s2s = bool(getattr(model.config, "is_encoder_decoder", False))
    start = 1 if s2s else ids.shape[1]  # where the response begins in generate()'s input_ids
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=pad_id, num_return_sequences=n)
    no_stops = torch.zeros(0, dtype=torch.int64)  # min_new_tokens: every row runs to the end

    def call(r: int):
        torch.manual_seed(r)
        events: list = []
        with torch.no_grad():
            t0 = time.perf_counter()
            clock = LogitsProcessorList([HFStepClock(events.append, start, no_stops)])
            model.generate(ids, logits_processor=clock, **kw)
            seconds = time.perf_counter() - t0
        return seconds, events, new_tokens, ids.shape[0] * n * new_tokens

    return call


def run_interleaved(calls: dict, rows: int, repeats: int) -> dict[str, dict]:
    """Every call once as warm-up, then ``repeats`` rounds of one timed run of each, in turn: on a shared CPU
    the backends see the same load (a load burst spreads over all of them rather than landing on one)."""
    for call in calls.values():
        call(0)  # warm-up
    got = {name: ([], [], [], [], []) for name in calls}
    for r in range(repeats):
        for name, call in calls.items():
            with PeakRSS() as mem:
                seconds, events, ran, tokens = call(r)
            for lst, x in zip(got[name], (seconds, events, ran, tokens, mem.mb)):
                lst.append(x)
    out = {}
    for name, (secs, runs, ran, tokens, mems) in got.items():
        out[name] = _summarise(secs, runs, rows, min(ran), max(mems))
        out[name]["response_tokens"] = int(statistics.median(tokens))  # engines stop a row at EOS
        out[name]["call_s_all"] = [round(x, 3) for x in secs]
    return out


def run_engine(engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    return run_interleaved({"e": engine_call(engine, prompts, new_tokens)}, len(prompts), repeats)["e"]


def run_hf_generate(model, prompts: list[list[int]], new_tokens: int, repeats: int, pad_id: int,
                    side: str = "left") -> dict:
    return run_interleaved({"hf": hf_call(model, prompts, new_tokens, pad_id, side)}, len(prompts), repeats)["hf"]


def decode_step_gflop(model, batch: int, context: int) -> tuple[float, list[tuple[int, int]]]:
    """GFLOP of one decode step of ``batch`` rows at ``context`` cached tokens, and the (in, out) weight shapes.

    2 * rows * in * out per projection (every Linear/Conv1D, the lm_head included) plus the attention's
    2 * 2 * rows * context * hidden per layer (scores and weighted sum).
    """
    shapes = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if w is None or w.dim() != 2 or isinstance(m, torch.nn.Embedding):
            continue
        shapes.append(tuple(w.shape) if type(m).__name__ == "Conv1D" else (w.shape[1], w.shape[0]))
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    flop = sum(2 * batch * i * o for i, o in shapes) + 4 * batch * context * hidden * layers
    return flop / 1e9, shapes


def matmul_gflops(shapes: list[tuple[int, int]], batch: int, threads: int, repeats: int = 5) -> dict[int, float]:
    """GFLOP/s of plain ``torch.matmul`` (B, in) @ (in, out) over the decode step's weight shapes, on this
    machine, now: {intra-op threads: best of ``repeats`` passes}, for 1 and ``threads`` threads. The best
    pass and the better thread count are the closest to what the cores can do: on 2 shared cores a
    second OpenMP thread is often descheduled under load."""
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(batch, i, generator=gen), torch.randn(i, o, generator=gen)) for i, o in set(shapes)]
    count = {s: shapes.count(s) for s in set(shapes)}
    flop = sum(2 * batch * i * o * count[(i, o)] for i, o in set(shapes))

    def one_pass():
        for x, w in pairs:
            for _ in range(count[tuple(w.shape)]):
                torch.matmul(x, w)

    return {t: float(f"{flop / s / 1e9:.4g}") for t, s in _best_pass(one_pass, threads, repeats).items()}


def _best_pass(one_pass, threads: int, repeats: int) -> dict[int, float]:
    """Seconds of the best of ``repeats`` calls of ``one_pass`` (after one warm-up), for 1 and ``threads``
    intra-op threads."""
    before, out = torch.get_num_threads(), {}
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - t0)
            out[t] = min(times[1:])
    finally:
        torch.set_num_threads(before)
    return out


def decode_step_kv_bytes(dims, batch: int, context: int, shared_prefix: int = 0, n: int = 1,
                         itemsize: int = 4) -> int:
    """Bytes of KV cache one decode step reads: K and V of every layer, ``dims.n_kv_heads x dims.head_dim``
    values per cached position, ``context`` positions per row, ``batch`` rows. With ``shared_prefix`` > 0 the
    ``n`` rows of a prompt read its first ``shared_prefix`` positions once (an attention that shares a prompt
    prefix across its samples; ONNX Runtime's CPU GroupQueryAttention reads every row's own copy)."""
    per_pos = 2 * dims.n_layers * dims.n_kv_heads * dims.head_dim * itemsize
    own = batch * (context - shared_prefix)
    return per_pos * (own + (batch // n) * shared_prefix)


def read_gbps(threads: int, mb: int = 512, repeats: int = 5) -> dict[int, float]:
    """GB/s of a streaming read (``torch.sum`` of ``mb`` MB of fp32, far more than any cache), for 1 and ``threads``
    intra-op threads, best of ``repeats``: the rate a decode step reads its KV cache at, at best."""
    x = torch.ones(mb * 2**20 // 4)
    return {t: float(f"{x.numel() * 4 / s / 1e9:.4g}") for t, s in _best_pass(x.sum, threads, repeats).items()}


def step_floor(gflop: float, matmul_gflops: float, kv_bytes: int, gbps: float) -> float:
    """A decode step's roofline floor in ms: its matmuls at ``matmul_gflops`` plus its KV cache read at ``gbps``,
    one after the other (a step's layers alternate between the two, so they barely overlap)."""
    return 1e3 * (gflop / matmul_gflops + kv_bytes / (gbps * 1e9))


def _fraction(gflop: float, step_ms: float, limit_gflops: float) -> float | None:
    """The share of the matmul limit a decode step reached: (GFLOP / step seconds) / limit GFLOP/s."""
    if not (step_ms > 0 and limit_gflops > 0):
        return None
    return float(f"{gflop / (step_ms / 1e3) / limit_gflops:.4g}")


def _open_engines(model_dir: Path, engine_dir: Path, backends: list[str], threads: int, shards: int, log) -> dict:
    """{name: engine} for each backend asked (``onnxruntime-plain``: the standard-op twin of ``engine_dir``), and
    with ``shards`` > 1 an ``<backend>-shards<S>`` twin of each ``onnxruntime*`` one."""
    engines = {}
    for b in backends:
        if b == "onnxruntime-plain":
            engines[b] = create_engine("onnxruntime", plain_twin(model_dir, engine_dir, log=log), threads=threads)
        else:
            engines[b] = create_engine(b, engine_dir if b != "torch" else model_dir, threads=threads)
    if shards > 1:
        for b in [b for b in engines if b.startswith("onnxruntime")]:
            folder = engines[b].engine_dir
            engines[f"{b}-shards{shards}"] = create_engine("onnxruntime", folder, threads=threads, shards=shards)
    return engines


def _step_limits(hf, manifest, bs: int, prompt_len: int, new_tokens: int, n: int, threads: int,
                 gbps_by_threads: dict, log) -> tuple[dict, float]:
    """What a decode step at batch ``bs`` costs at the least here: its GFLOP at the measured matmul rate plus its KV
    bytes at the measured read rate (the roofline floor), with and without a shared prompt prefix; and its GFLOP,
    unrounded."""
    gbps = max(gbps_by_threads.values())
    context = prompt_len + new_tokens // 2  # a decode step's mean cached positions
    gflop, shapes = decode_step_gflop(hf, bs, context)
    by_threads = matmul_gflops(shapes, bs, threads)
    kv = decode_step_kv_bytes(manifest.dims, bs, context)
    kv_shared = decode_step_kv_bytes(manifest.dims, bs, context, shared_prefix=prompt_len if n > 1 else 0, n=n)
    mm = max(by_threads.values())
    limits = {"decode_step_gflop": round(gflop, 3), "matmul_gflops": mm,
              "matmul_gflops_by_threads": by_threads, "kv_mb_per_step": round(kv / 1e6, 2),
              "kv_mb_per_step_shared_prefix": round(kv_shared / 1e6, 2), "read_gbps": gbps,
              "read_gbps_by_threads": gbps_by_threads,
              "floor_ms": round(step_floor(gflop, mm, kv, gbps), 3),
              "floor_ms_shared_prefix": round(step_floor(gflop, mm, kv_shared, gbps), 3)}
    log(f"batch {bs:>3} a decode step is {gflop:.2f} GFLOP and reads {kv / 1e6:.1f} MB of KV cache; "
        f"torch.matmul of its shapes runs at {mm:.1f} GFLOP/s here (threads: {by_threads}); "
        f"roofline floor {limits['floor_ms']:.2f} ms a step "
        f"({limits['floor_ms_shared_prefix']:.2f} ms with a shared prompt prefix)")
    return limits, gflop


def bench_generate(model_dir: Path, engine_dir: Path, backends: list[str], batch_sizes: list[int], prompt_len: int,
                   new_tokens: int, repeats: int, threads: int, log=print, n: int = 1, shards: int = 1) -> dict:
    """``onnxruntime`` runs ``engine_dir`` (the fused-attention graph by default); ``onnxruntime-plain`` the
    standard-op graph of the same model. Each row also carries the decode step's GFLOP and the fraction
    of this machine's measured ``torch.matmul`` GFLOP/s that the step reached.

    ``shards`` > 1: each ``onnxruntime*`` backend runs a second time as ``<backend>-shards<S>``, the same engine
    folder with ``shards=S`` (rows cut at prompt boundaries, one decode loop per shard on its own thread, the
    ``threads`` budget shared out), in the same interleaved rounds; its phase times are shard 0's (its rows)."""
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    info = model_info(model_dir)
    rng = np.random.default_rng(0)
    lo = 4  # skip the special ids (pad, eos, bos, unk)
    all_prompts = rng.integers(lo, info.vocab_size, size=(max(batch_sizes), prompt_len)).tolist()
    results = []
    hf = load_model(model_dir, info, attn="sdpa")
    side = native_padding_side(bool(getattr(hf.config, "is_encoder_decoder", False)), model_dir)
    engines = _open_engines(model_dir, engine_dir, backends, threads, shards, log)
    backends = list(engines)
    limits = {}
    manifest = Manifest.read(engine_dir)
    gbps_by_threads = read_gbps(threads)
    log(f"streaming read: {max(gbps_by_threads.values()):.1f} GB/s here (threads: {gbps_by_threads})")
    for bs in batch_sizes:
        if bs % n:
            raise ValueError(f"batch size {bs} is not a multiple of --n {n}")
        prompts = all_prompts[:bs // n]  # bs rows: bs / n prompts, n samples each (a PPO/GRPO group)
        limits[bs], gflop = _step_limits(hf, manifest, bs, prompt_len, new_tokens, n, threads, gbps_by_threads, log)
        calls = {"hf_generate": hf_call(hf, prompts, new_tokens, info.pad_id, side, n)}
        calls.update({name: engine_call(eng, prompts, new_tokens, n) for name, eng in engines.items()})
        for name, r in run_interleaved(calls, bs, repeats).items():
            r["matmul_fraction"] = _fraction(gflop, r["decode_ms_p50"], limits[bs]["matmul_gflops"])
            # the floor over the step: 1.0 = at the roofline
            r["floor_fraction"] = round(limits[bs]["floor_ms"] / r["decode_ms_p50"], 4) if r["decode_ms_p50"] else None
            if name == "hf_generate":
                limits[bs]["hf_decode_over_floor"] = round(r["decode_ms_p50"] / limits[bs]["floor_ms"], 3)
                limits[bs]["hf_decode_over_floor_shared_prefix"] = round(
                    r["decode_ms_p50"] / limits[bs]["floor_ms_shared_prefix"], 3)
            results.append({"backend": name, "batch": bs, **r})
            log(f"batch {bs:>3} {name:<20} {r['tokens_per_s']:8.1f} tok/s  call {r['call_s']:7.3f} s  "
                f"ttft {r['ttft_ms']:7.1f} ms  decode p50 {r['decode_ms_p50']:6.1f} ms  "
                f"({r['response_tokens']} response tokens)")
    for e in engines.values():
        e.close()
    base = {r["batch"]: r["tokens_per_s"] for r in results if r["backend"] == "hf_generate"}
    calls_hf = {r["batch"]: r["call_s"] for r in results if r["backend"] == "hf_generate"}
    speedup = {b: {str(r["batch"]): round(r["tokens_per_s"] / base[r["batch"]], 3)
                   for r in results if r["backend"] == b} for b in backends}
    call_ratio = {b: {str(r["batch"]): round(calls_hf[r["batch"]] / r["call_s"], 3)
                      for r in results if r["backend"] == b} for b in backends}
    return {"bench": "generate", "model": str(model_dir), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "n": n, "threads": threads, "shards": shards, "repeats": repeats, "interleaved": True,
            "hf_call_s_over_engine_call_s": call_ratio, "results": results, "speedup_vs_hf_generate": speedup,
            "onnxruntime_attention": manifest.attention or "plain", "matmul_limit": limits,
            "load_avg": _load(load_before)}



def bench_refit(model_dir: Path, engine_dir: Path, repeats: int, threads: int, work_dir: Path, log=print) -> dict:
    """Median ``update_weights`` time (all weights, perturbed) against one full re-export of the same model."""
    import shutil

    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    model = load_model(model_dir)
    params, _ = canonical_params(model)
    eng = create_engine("onnxruntime", engine_dir, threads=threads)
    times = []
    for r in range(repeats):
        new = {n: p.detach() + (1e-3 * (r + 1)) for n, p in params.items()}
        t0 = time.perf_counter()
        eng.update_weights(new)
        times.append(time.perf_counter() - t0)
        log(f"update_weights #{r + 1}: {times[-1]:.3f} s")
    eng.close()
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / f".reexport.tmp-{os.getpid()}"  # the bench's own scratch (a killed run's: removed next start)
    clean_stale_temps(work_dir, log, prefix="reexport.")
    t0 = time.perf_counter()
    try:
        build(model_dir, out, opts=ExportOptions(), log=log)
        reexport = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    upd = statistics.median(times)
    return {"bench": "refit", "model": str(model_dir), "update_weights_s": round(upd, 4),
            "update_weights_all_s": [round(t, 4) for t in times], "reexport_s": round(reexport, 3),
            "ratio_reexport_over_update": round(reexport / upd, 1), "load_avg": _load(load_before)}
