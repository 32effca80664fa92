"""``refit bench generate --quantize int8``: the int8 rollout engine against the fp32 engine of the same model and
HF ``generate()``, in one process, at each batch size (the same prompts, sampling, warm-up and medians as
:func:`refit.bench.generate.bench_generate`); then what int8 costs in log-probs and in a weight push.

    1. tokens/s, time to first token and decode step per backend and batch size; int8 / fp32 ratio
    2. log-prob gap: the fp32 engine samples a batch; both engines score it; |int8 - fp32| on the sampled tokens
       (mean, p99, max) beside the gap the export recorded (manifest ``quantization.gap_vs_fp32``)
    3. push time: ``update_weights`` of the full fp32 state (perturbed) into each engine, median, and its phases
       (``OrtEngine.last_push_s``: map, the int8 re-quantization, the sessions' re-open, the held-set copy); then
       whether the int8 push took: a perturbed push moves the int8 engine's log-probs and matches the
       quantize-dequantize reference holding the same tensors (``reference_model``, as the learner's push probe)
       within the export gate's tolerance
    4. optionally CTranslate2 int8 on the same model (``--ct2_python``: a Python with ``ctranslate2`` installed,
       kept out of Refit's environment): converted once, the same prompts and sampling, tokens/s per batch

The last stdout line is one JSON document.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from refit.bench.generate import _load, run_engine, run_hf_generate
from refit.core.hf_folder import load_model, model_info
from refit.core.manifest import Manifest
from refit.core.padding import native_padding_side
from refit.export.weight_map import canonical_params
from refit.learner.run.sync import Contract, WeightSync
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams


def logprob_gap(fp32, int8, prompts: list[list[int]], new_tokens: int) -> dict:
    """Both engines score the fp32 engine's sampled batch; |int8 - fp32| log-prob on its response tokens."""
    b = fp32.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=11))
    m = b.response_mask.bool()
    a = fp32.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask).logprobs[m]
    q = int8.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask).logprobs[m]
    d = (q - a).abs().double()
    return {"tokens": int(m.sum()), "mean_abs": float(d.mean()), "p99_abs": float(d.quantile(0.99)),
            "max_abs": float(d.max()), "mean_signed": float((q - a).double().mean())}


def push_seconds(engine, params: dict[str, torch.Tensor], repeats: int) -> tuple[list[float], dict[str, float]]:
    """``repeats`` full pushes of ``params`` (perturbed): (their seconds, the median of each phase of them)."""
    out, phases = [], []
    for r in range(repeats):
        new = {n: p.detach() + 1e-3 * (r + 1) for n, p in params.items()}
        t0 = time.perf_counter()
        engine.update_weights(new)
        out.append(round(time.perf_counter() - t0, 4))
        phases.append(engine.last_push_s)
    return out, {k: round(statistics.median(p[k] for p in phases), 4) for k in phases[0]}


def push_check(int8, model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """Push ``model``'s tensors moved by 0.1 x their std x N(0, 1) into ``int8``: how far the engine's log-probs move
    on a batch it sampled, and how far they then are from the quantize-dequantize reference holding the same tensors
    (the learner's push-probe side, ``WeightSync.learner_side``), against the export gate's tolerances. ``model`` is
    left holding the perturbed tensors."""
    b = int8.generate(prompts, SamplingParams(max_new_tokens=new_tokens, seed=12))
    m = b.response_mask.bool()
    score = lambda: int8.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask).logprobs[m]  # noqa: E731
    before = score()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # a constant one (a LayerNorm's ones, a zero bias) stays as it is
            if p.numel() > 1:
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=gen))
    int8.update_weights(canonical_params(model)[0])
    after = score()
    q = int8.manifest.quantization
    # the sync room's learner half, with batch b as its probe batch (the comparison is made here, against the gate)
    sync = WeightSync(int8, b, Contract(temperature=1.0, probe_tol=q.tolerance_logprob, int8_manifest=int8.manifest),
                      int8.engine_dir.parent)
    ref = sync.learner_side(model).logprobs[m]
    d = (after - ref).abs()
    out = {"tokens": int(m.sum()), "moved_max_abs": float((after - before).abs().max()),
           "vs_reference_max_abs": float(d.max()), "vs_reference_mean_abs": float(d.mean()),
           "gate_tolerance": q.tolerance_logprob, "gate_tolerance_mean": q.tolerance_mean}
    out["took"] = (out["moved_max_abs"] > q.tolerance_logprob and out["vs_reference_max_abs"] <= q.tolerance_logprob
                   and out["vs_reference_mean_abs"] <= q.tolerance_mean)
    return out


_CT2_SCRIPT = r"""
import json, sys, time, statistics, ctranslate2
d = json.loads(sys.argv[1])
vocab = json.load(open(d["model"] + "/vocabulary.json"))
gen = ctranslate2.Generator(d["model"], device="cpu", compute_type="int8", intra_threads=d["threads"], inter_threads=1)
out = {}
for bs in d["batch_sizes"]:
    toks = [[vocab[t] for t in p] for p in d["prompts"][:bs]]
    run = lambda s: gen.generate_batch(toks, max_length=d["new_tokens"], min_length=d["new_tokens"], sampling_topk=0,
                                       sampling_temperature=1.0, include_prompt_in_result=False, beam_size=1)
    run(0)
    t = []
    for r in range(d["repeats"]):
        t0 = time.perf_counter(); res = run(r); t.append(time.perf_counter() - t0)
    n = sum(len(x.sequences_ids[0]) for x in res)
    out[str(bs)] = {"tokens_per_s": n / statistics.median(t), "call_s": statistics.median(t), "tokens": n}
print(json.dumps(out))
"""


def _full_vocab_source(model_dir: Path, work: Path) -> Path:
    """``model_dir`` itself when its tokenizer covers the model's vocabulary, else a folder beside it with the same
    weights (symlinked) and a placeholder word-level tokenizer of ``vocab_size`` tokens ``t0``, ``t1``, ...: the
    benchmark geometries pair a 50257-row model with a 384-token tokenizer, and CTranslate2's converter wants
    one vocabulary entry per row (the bench feeds token ids, so the names do not matter)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    n = cfg.vocab_size
    if len(AutoTokenizer.from_pretrained(model_dir)) == n:
        return model_dir
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    src = work / f"{model_dir.name}-ct2-source"
    src.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and "token" not in f.name and not (src / f.name).exists():
            (src / f.name).symlink_to(f.resolve())
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {k: f"t{getattr(cfg, f'{k}_id', None) or 0}" for k in ("bos_token", "eos_token", "pad_token")}
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", **special).save_pretrained(str(src))
    return src


def ctranslate2_int8(python: str, model_dir: Path, work: Path, prompts, batch_sizes, new_tokens, repeats,
                     threads, log=print) -> dict:
    """CTranslate2 int8 on the same checkpoint, run by ``python`` (its own environment); {} with a reason on failure.

    The converter runs in this process's environment with ``python``'s site-packages appended (it needs
    transformers and torch, which are here; ctranslate2 is there)."""
    where = "import ctranslate2, os; print(os.path.dirname(os.path.dirname(ctranslate2.__file__)))"
    site = subprocess.run([python, "-c", where], capture_output=True, text=True)
    if site.returncode:
        return {"error": f"no ctranslate2 under {python}: {site.stderr.strip().splitlines()[-1:]}"}
    out = work / f"{model_dir.name}-ct2-int8"
    env = {**os.environ, "PYTHONPATH": site.stdout.strip()}
    if not (out / "model.bin").exists():
        conv = subprocess.run([sys.executable, "-c", "from ctranslate2.converters.transformers import main; main()",
                               "--model", str(_full_vocab_source(model_dir, work)), "--output_dir", str(out),
                               "--quantization", "int8",
                               "--force"], capture_output=True, text=True, env=env)
        if conv.returncode:
            return {"error": "conversion failed: " + (conv.stderr.strip().splitlines() or ["?"])[-1]}
    arg = json.dumps({"model": str(out), "threads": threads, "batch_sizes": batch_sizes, "prompts": prompts,
                      "new_tokens": new_tokens, "repeats": repeats})
    run = subprocess.run([python, "-c", _CT2_SCRIPT, arg], capture_output=True, text=True)
    if run.returncode:
        return {"error": "run failed: " + (run.stderr.strip().splitlines() or ["?"])[-1]}
    res = json.loads(run.stdout.strip().splitlines()[-1])
    log("ctranslate2 int8: " + ", ".join(f"batch {b} {r['tokens_per_s']:.1f} tok/s" for b, r in res.items()))
    return res


def bench_quantized(model_dir: Path, fp32_dir: Path, int8_dir: Path, batch_sizes: list[int], prompt_len: int,
                    new_tokens: int, repeats: int, threads: int, ct2_python: str = "", work: Path | None = None,
                    push_repeats: int = 3, log=print) -> dict:
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    info = model_info(model_dir)
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, info.vocab_size, size=(max(batch_sizes), prompt_len)).tolist()
    hf = load_model(model_dir, info, attn="sdpa")
    side = native_padding_side(bool(getattr(hf.config, "is_encoder_decoder", False)), model_dir)
    engines = {"fp32": create_engine("onnxruntime", fp32_dir, threads=threads),
               "int8": create_engine("onnxruntime", int8_dir, threads=threads)}
    results = []
    for bs in batch_sizes:
        rows = {"hf_generate": run_hf_generate(hf, prompts[:bs], new_tokens, repeats, info.pad_id, side)}
        for name, eng in engines.items():
            rows[name] = run_engine(eng, prompts[:bs], new_tokens, repeats)
        for name, r in rows.items():
            results.append({"backend": name, "batch": bs, **r})
            log(f"batch {bs:>3} {name:<12} {r['tokens_per_s']:8.1f} tok/s  ttft {r['ttft_ms']:7.1f} ms  "
                f"decode p50 {r['decode_ms_p50']:6.1f} ms")
    tps = {(r["backend"], r["batch"]): r["tokens_per_s"] for r in results}
    ratio = {str(b): round(tps[("int8", b)] / tps[("fp32", b)], 3) for b in batch_sizes}
    vs_hf = {str(b): round(tps[("int8", b)] / tps[("hf_generate", b)], 3) for b in batch_sizes}
    gap = logprob_gap(engines["fp32"], engines["int8"], prompts[:min(8, max(batch_sizes))], new_tokens)
    log(f"log-prob gap int8 vs fp32 on {gap['tokens']} sampled tokens: mean {gap['mean_abs']:.4f}, "
        f"p99 {gap['p99_abs']:.4f}, max {gap['max_abs']:.4f}")
    params = canonical_params(hf)[0]
    timed = {name: push_seconds(eng, params, push_repeats) for name, eng in engines.items()}
    push, phases = {k: v[0] for k, v in timed.items()}, {k: v[1] for k, v in timed.items()}
    for name in engines:
        log(f"update_weights {name}: median {statistics.median(push[name]):.3f} s of {push[name]}; phases (median) "
            + ", ".join(f"{k} {v:.3f} s" for k, v in phases[name].items()))
    check = push_check(engines["int8"], hf, prompts[:4], 16)  # hf holds the perturbed tensors from here on
    log(f"int8 push check: moved {check['moved_max_abs']:.3g}, vs reference max {check['vs_reference_max_abs']:.3g} "
        f"mean {check['vs_reference_mean_abs']:.3g} (gate tol {check['gate_tolerance']:.3g} / "
        f"{check['gate_tolerance_mean']:.3g}): {'took' if check['took'] else 'NOT TAKEN'}")
    for e in engines.values():
        e.close()
    q = Manifest.read(int8_dir).quantization
    ct2 = (ctranslate2_int8(ct2_python, model_dir, work or int8_dir.parent, prompts, batch_sizes, new_tokens,
                            repeats, threads, log) if ct2_python else {"error": "not run (no --ct2_python)"})
    return {"bench": "generate-quantized", "model": str(model_dir), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "threads": threads, "repeats": repeats, "results": results, "int8_over_fp32": ratio,
            "int8_over_hf_generate": vs_hf, "logprob_gap_sampled": gap,
            "logprob_gap_export": dict(q.gap_vs_fp32) if q else None,
            "update_weights_s": {k: statistics.median(v) for k, v in push.items()}, "update_weights_all_s": push,
            "update_weights_phases_s": phases, "int8_push_check": check,
            "ctranslate2_int8": ct2, "load_avg": _load(load_before)}
