"""``refit bench lora``: LoRA at published geometries, full depth by default, on this machine; one JSON line.

Per geometry (random weights, built locally from refit/learner/builtin/published.py), each stage in a process of its own
so that its peak RSS (``wait4``'s ``ru_maxrss``: the child's high-water mark) is its own:

1. ``export``: the LoRA-ready engine (refit/export/lora.py; ``--quantize int8``: an int8 base) - seconds, peak RSS.
2. ``push``: the engine and the learner's PEFT model (LoRA r, all-linear, a random adapter): the adapter push
   (median of ``--repeats``) against today's full push of every base weight into the same engine, each followed by
   the probe (engine vs PEFT on a fixed batch, as the jobs check every push).
3. ``grpo``: ``refit ppo`` with GRPO and LoRA, ``--steps`` steps of ``--prompts`` x ``--generations`` with
   ``--response_length``-token responses - peak RSS, seconds a step by phase (the mean of the steps after the
   first), KL(0) (step 1's exact KL, taken before any update), the adapter push's seconds.
4. ``full`` (``--full_ft``): the same run with full fine-tuning under ``--rss_cap_gb`` of anonymous memory: where
   full fine-tuning stops.

Rows go to stdout as they finish; the last line is one JSON document with every row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from refit.bench.trl_best import status_gb  # the /proc memory reader both child watches use

STAGES = ("export", "push", "grpo", "full")


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace(".", "")


def run_child(args: list[str], cap_gb: float | None = None, log=print) -> tuple[int, float, float, str]:
    """(exit status, seconds, peak RSS GB of the child, its last output line); with ``cap_gb`` the child is killed
    once its anonymous memory passes it (status -9, "stopped at the cap")."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    capped = []

    def watch():
        while proc.poll() is None:
            if cap_gb is not None and status_gb(proc.pid, "RssAnon") > cap_gb:
                capped.append(True)
                proc.kill()
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    last = ""
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            last = line
            if line.startswith(("refit", "step", "{", "[bench")):
                log(f"    {line[:300]}")
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return (-9 if capped else code), time.perf_counter() - t0, usage.ru_maxrss / 2**20, last


# ----------------------------------------------------------------------------- stages (run in the child)
# Each stage imports Refit inside itself (and this module only the standard library at its top): a child's peak RSS
# is then its own stage's, with nothing loaded that only another stage needs.

def stage_export(a) -> dict:
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    t0 = time.perf_counter()
    build(a.model_dir, a.engine_dir, opts=ExportOptions(max_batch=max(64, a.prompts * a.generations),
                                                        max_len=a.max_len, quantize=a.quantize, lora=("all-linear",),
                                                        round_weights="bf16" if a.base_dtype == "bf16" else "none"))
    return {"export_s": round(time.perf_counter() - t0, 1)}


def stage_push(a) -> dict:
    import torch

    from refit.core.hf_folder import load_model, model_info
    from refit.core.manifest import Manifest
    from refit.export.weight_map import canonical_params
    from refit.learner.run.config import LoraSection
    from refit.learner.run.sync import Contract, WeightSync
    from refit.learner.run.lora import apply_lora
    from refit.rollout.engine import create_engine
    from refit.rollout.types import SamplingParams

    torch.set_num_threads(a.threads)
    manifest = Manifest.read(a.engine_dir)
    int8 = manifest if manifest.quantization is not None else None
    model = apply_lora(load_model(a.model_dir, model_info(a.model_dir)), LoraSection(r=a.r, alpha=2.0 * a.r,
                                                                                     base_dtype=a.base_dtype))
    eng = create_engine("onnxruntime", a.engine_dir, threads=a.threads, hold_weights=False)
    probe = eng.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14]], SamplingParams(max_new_tokens=8, greedy=True))
    # the run's sync room: the push carries the adapter only (the engine is LoRA-ready), checked on the probe batch
    sync = WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-3, int8_manifest=int8),
                      Path(a.engine_dir).parent)

    def push_adapter(seed: int) -> tuple[float, float]:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        pushed = sync.push_now(model)  # push_s: the adapter's tensors gathered and update_weights, as before
        return pushed.push_s, pushed.probe_diff

    adapter = [push_adapter(s) for s in range(a.repeats)]
    out = {"adapter_push_s": statistics.median(s for s, _ in adapter),
           "adapter_probe_diff": max(d for _, d in adapter),
           "adapter_mb": round(eng.last_push_s["adapter_bytes"] / 2**20, 2),
           "trainable_params_m": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)}
    if int8 is None and a.base_dtype == "fp32":  # the full push: every base weight by its HF name (today's route)
        base = {k.replace(".base_layer", ""): v for k, v in canonical_params(model.get_base_model())[0].items()
                if ".lora_" not in k}
        full = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            eng.update_weights(base)
            full.append(time.perf_counter() - t)
        out["full_push_s"] = statistics.median(full)
        out["full_push_over_adapter_push"] = round(out["full_push_s"] / out["adapter_push_s"], 1)
        out["probe_after_full_push"] = push_adapter(99)[1]  # the adapter again, on the fully pushed base
    return out


def _ppo_args(a, lora: bool) -> list[str]:
    out = Path(a.work_dir) / f"{_slug(a.geometry)}-{'lora' if lora else 'full'}{_variant(a)}"
    args = ["-m", "refit", "ppo", "--model.model_dir", a.model_dir, "--model.engine_dir", a.engine_dir,
            "-o", str(out), "--overwrite", "--run.steps", str(a.steps), "--run.batch_size", str(a.prompts),
            "--num_generations", str(a.generations), "--advantage_estimator", "grpo", "--response_length",
            str(a.response_length), "--num_ppo_epochs", "1", "--num_mini_batches", "1", "--kl_coef", "0.05",
            "--kl_penalty", "loss", "--kl_estimator", "k3",  # GRPO's KL term (TRL's beta): the one-pass update
            "--rollout.engine_threads", str(a.threads), "--rollout.quantize", a.quantize, "--log.no_progress",
            "--log.no_plots", "--log.no_tensorboard", "--no_export_final", "--ckpt.save_steps", str(a.steps),
            "--optim.learning_rate", "1e-4" if lora else "1e-5",
            "--optim.gradient_accumulation_steps", str(a.grad_accum)]
    if lora:
        args += ["--lora.r", str(a.r), "--lora.alpha", str(2.0 * a.r), "--lora.base_dtype", a.base_dtype]
    return args


def stage_grpo(a, lora: bool = True) -> dict:
    """The PPO job's own rows (metrics.jsonl) of a run made by this process's parent."""
    from refit.learner.run.metrics import read_metrics

    run_dir = Path(_ppo_args(a, lora)[_ppo_args(a, lora).index("-o") + 1])
    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    later = rows[1:] or rows
    mean = lambda k: round(statistics.mean(r.get(k, 0.0) for r in later), 2)  # noqa: E731
    return {"steps": len(rows), "step_s": mean("time/step"), "rollout_s": mean("time/rollout"),
            "score_s": mean("time/score"), "update_s": mean("time/update"), "push_s": mean("time/weight_push"),
            "first_step_s": round(rows[0]["time/step"], 1), "kl0": rows[0]["kl/exact"],
            "kl_last": rows[-1]["kl/exact"], "probe_max": max(r.get("probe/max_abs_logprob_diff") or 0.0 for r in rows)}


# ----------------------------------------------------------------------------- the driver

def _variant(a) -> str:
    """The folder suffix of an engine base and learner base other than fp32: '-int8', '-bf16', '-int8-bf16'."""
    return ("-int8" if a.quantize != "none" else "") + ("-bf16" if a.base_dtype == "bf16" else "")


def refused(line: str) -> str | None:
    """The memory check's refusal (refit.learner.run.engines.check_batch_memory) in a table cell's words: what the
    run needed, of it the weights, and what the machine had; None for any other line."""
    m = re.search(r"needs about ([\d.]+ \w+) \(.*\bweights ([\d.]+ \w+).*more than the ([\d.]+ \w+)", line)
    return (f"refused before any work: needs {m[1]} (weights {m[2]}), {m[3]} available" if m else None)


def geometry_row(a, log=print) -> dict:
    from refit.learner.builtin.published import build_published, n_params

    work = Path(a.work_dir)
    model_dir = work / f"{_slug(a.geometry)}-model"
    engine_dir = work / f"{_slug(a.geometry)}-engine-lora{_variant(a)}"
    row = {"geometry": a.geometry, "params_b": round(n_params(a.geometry, None) / 1e9, 3), "quantize": a.quantize,
           "base_dtype": a.base_dtype,
           "lora_r": a.r, "shape": f"{a.prompts}x{a.generations}x{a.response_length}", "threads": a.threads}
    a = argparse.Namespace(**{**vars(a), "model_dir": str(model_dir), "engine_dir": str(engine_dir)})
    if not (model_dir / "config.json").is_file():
        log(f"[bench lora] building {a.geometry} (full depth, random weights) in {model_dir}")
        build_published(a.geometry, model_dir, n_layers=None)
    common = ["--geometry", a.geometry, "--model_dir", str(model_dir), "--engine_dir", str(engine_dir),
              "--work_dir", str(work), "--r", str(a.r), "--threads", str(a.threads), "--quantize", a.quantize,
              "--prompts", str(a.prompts), "--generations", str(a.generations), "--response_length",
              str(a.response_length), "--steps", str(a.steps), "--repeats", str(a.repeats), "--max_len",
              str(a.max_len), "--grad_accum", str(a.grad_accum), "--base_dtype", a.base_dtype]
    for stage in a.stages.split(","):
        log(f"[bench lora] {a.geometry}: {stage}")
        if stage in ("grpo", "full"):
            lora = stage == "grpo"
            code, secs, rss, last = run_child(_ppo_args(a, lora), a.rss_cap_gb if stage == "full" else None, log)
            capped = code == -9 and stage == "full"
            res = {"status": "ok" if code == 0 else ("stopped at the cap" if capped else
                                                     "killed (-9: out of memory)" if code == -9 else
                                                     refused(last) or f"failed: {last[:200]}")}
            if code == 0:
                code2, _, _, last2 = run_child(["-m", "refit.bench.lora", "--stage", stage, *common], log=log)
                res.update(json.loads(last2) if code2 == 0 else {"status": f"failed: {last2[:200]}"})
        else:
            code, secs, rss, last = run_child(["-m", "refit.bench.lora", "--stage", stage, *common], log=log)
            res = json.loads(last) if code == 0 else {"status": f"failed: {last[:200]}"}
        row.update({f"{stage}_{k}": v for k, v in res.items()})
        row[f"{stage}_wall_s"], row[f"{stage}_peak_rss_gb"] = round(secs, 1), round(rss, 2)
        log(f"[bench lora] {json.dumps(row)}")
    return row


MARKS = ("<!-- lora-full-depth:start -->", "<!-- lora-full-depth:end -->")


def _cell(r: dict, stage: str, fmt) -> str:
    status = r.get(f"{stage}_status")
    if status is None and f"{stage}_wall_s" not in r:
        return "not run"
    if status not in (None, "ok"):
        return f"{status} ({r.get(f'{stage}_wall_s')} s, {r.get(f'{stage}_peak_rss_gb')} GB)"
    return fmt(r)


def markdown(rows: list[dict]) -> str:
    """The full-depth table (docs/lora.md, between :data:`MARKS`) of :func:`geometry_row` records."""
    head = ("| model (full depth) | params | engine base | export: s, peak RSS | adapter push vs full push (probe) "
            "| GRPO + LoRA: s a step (rollout / score / update / push), peak RSS, KL(0) | full fine-tuning |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        export = _cell(r, "export", lambda r: f"{r['export_export_s']} s, {r['export_peak_rss_gb']} GB")
        push = _cell(r, "push", lambda r: (
            f"{r['push_adapter_push_s'] * 1e3:.1f} ms ({r['push_adapter_mb']} MB, r {r['lora_r']})"
            + (f" vs {r['push_full_push_s']:.2f} s: {r['push_full_push_over_adapter_push']}x" if "push_full_push_s" in r
               else "") + f"; probe {r['push_adapter_probe_diff']:.1e}"))
        grpo = _cell(r, "grpo", lambda r: (
            f"{r['grpo_step_s']} s ({r['grpo_rollout_s']} / {r['grpo_score_s']} / {r['grpo_update_s']} / "
            f"{r['grpo_push_s']}), {r['grpo_peak_rss_gb']} GB, KL(0) {r['grpo_kl0']:.1e}"))
        full = _cell(r, "full", lambda r: f"{r['full_step_s']} s a step, {r['full_peak_rss_gb']} GB")
        base = (r["quantize"] if r["quantize"] != "none" else "fp32") + (
            ", learner bf16" if r.get("base_dtype", "fp32") == "bf16" else "")
        lines.append(f"| {r['geometry']} | {r['params_b']}B | {base} "
                     f"| {export} | {push} | {grpo} | {full} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="refit bench lora", description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="Qwen2.5 0.5B", help="published geometries, comma list "
                   "(refit/learner/builtin/published.py: 'Qwen2.5 0.5B', 'Llama 3.2 1B', 'Qwen2.5 1.5B', "
                   "'Qwen2.5 3B', ...)")
    p.add_argument("--stages", default="export,push,grpo", help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--quantize", default="none", choices=("none", "int8"), help="the engine's base")
    p.add_argument("--base_dtype", default="fp32", choices=("fp32", "bf16"), help="the learner's base (lora.base_dtype; "
                                                                                  "bf16: the engine from the rounded base)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha 2r, all-linear)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed pushes (median)")
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--grad_accum", type=int, default=1, help="optim.gradient_accumulation_steps: a floor on the "
                   "update's micro-batches (the one-pass update picks its rows per forward by memory: "
                   "optim.micro_batch_rows auto)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rss_cap_gb", type=float, default=20.0, help="the full fine-tuning row's anonymous-memory cap")
    p.add_argument("--work_dir", default="runs/bench-lora")
    p.add_argument("--readme", default="", help="also write the table between the lora-full-depth markers of this "
                                                "file (docs/lora.md holds them): every row in WORK_DIR/rows.json "
                                                "(each run adds or replaces its geometries' rows there)")
    p.add_argument("--stage", default="", help=argparse.SUPPRESS)  # a child's one stage
    p.add_argument("--model_dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--engine_dir", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.stage:
        fn = {"export": stage_export, "push": stage_push, "grpo": stage_grpo,
              "full": lambda x: stage_grpo(x, lora=False)}[a.stage]
        print(json.dumps(fn(a)))
        return 0
    Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for g in [x.strip() for x in a.geometry.split(",") if x.strip()]:
        rows.append(geometry_row(argparse.Namespace(**{**vars(a), "geometry": g})))
    store = Path(a.work_dir) / "rows.json"  # every geometry measured so far, by (geometry, engine base, learner base)
    kept = json.loads(store.read_text()) if store.is_file() else {}
    for r in rows:
        key = f"{r['geometry']}|{r['quantize']}" + ("|bf16" if r["base_dtype"] == "bf16" else "")
        kept[key] = {**kept.get(key, {}), **r}  # stages run now replace theirs, others stay
    store.write_text(json.dumps(kept, indent=1))
    print(markdown(list(kept.values())))
    if a.readme:
        from refit.bench.families import update_readme

        update_readme(Path(a.readme), markdown(list(kept.values())), MARKS)
    print(json.dumps({"bench": "lora", "rows": rows,
                      "driver_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
