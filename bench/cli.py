"""``refit bench generate|refit|ppo``: benchmarks whose last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _model_and_engine(a, log=print, max_len: int = 256) -> tuple[Path, Path]:
    """The benchmark model (built locally when not given) and its ONNX engine folder (exported or reused)."""
    from export.build import build
    from export.models import build_model
    from export.onnx_export import ExportOptions

    work = Path(a.work_dir)
    model = Path(a.model) if a.model else work / a.geometry
    if not a.model and not (model / "config.json").exists():
        log(f"building the {a.geometry} geometry locally in {model}")
        build_model(a.geometry, model)
    engine = Path(a.engine) if a.engine else work / f"{model.name}-engine"
    backend = "tensorrt" if "tensorrt" in getattr(a, "backends", "").split(",") else "onnxruntime"
    build(model, engine, backend, ExportOptions(max_batch=64, max_len=max_len), log=log)
    return model, engine


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refit bench", description=__doc__)
    sub = p.add_subparsers(dest="which", required=True)
    for name, help_ in (("generate", "generation latency: HF generate() vs Refit engines"),
                        ("refit", "update_weights vs a full re-export"),
                        ("ppo", "one PPO iteration with engine rollouts vs HF generate() rollouts"),
                        ("workers", "a demo-sized PPO iteration with 1 vs N Ray rollout workers")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--work-dir", default="runs/bench", help="where built models and engines are cached")
        s.add_argument("--threads", type=int, default=2, help="intra-op threads for torch and the engines")
        if name != "workers":  # bench workers always runs the embedded demo's policy and settings
            s.add_argument("--model", default="", help="HF checkpoint folder (default: build --geometry locally)")
            s.add_argument("--geometry", default="small-gpt2" if name == "ppo" else "gpt2-small",
                           help="local geometry to build when --model is not given")
            s.add_argument("--engine", default="", help="engine folder (default: exported into --work-dir)")
            s.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
        if name == "generate":
            s.add_argument("--backends", default="torch,onnxruntime", help="comma list of Refit backends")
            s.add_argument("--batch-sizes", default="1,8,32", help="comma list of batch sizes")
            s.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row")
            s.add_argument("--new-tokens", type=int, default=64, help="generated tokens per row")
        if name == "workers":
            s.add_argument("--workers", type=int, default=2, help="rollout workers compared with one engine")
            s.add_argument("--steps", type=int, default=8, help="PPO steps per run (the first 2 are not timed)")
        if name == "ppo":
            s.add_argument("--batch-size", type=int, default=8, help="rows per PPO iteration")
            s.add_argument("--response-length", type=int, default=192, help="generated tokens per row")
            s.add_argument("--backend", default="onnxruntime", help="engine backend compared with HF generate()")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.which == "generate":
        from bench.generate import bench_generate

        model, engine = _model_and_engine(a)
        out = bench_generate(model, engine, a.backends.split(","), [int(x) for x in a.batch_sizes.split(",")],
                             a.prompt_len, a.new_tokens, a.repeats, a.threads)
    elif a.which == "refit":
        from bench.generate import bench_refit

        model, engine = _model_and_engine(a)
        out = bench_refit(model, engine, a.repeats, a.threads, Path(a.work_dir))
    elif a.which == "workers":
        from bench.workers import bench_workers

        out = bench_workers(Path(a.work_dir) / "workers", a.workers, a.steps, a.threads)
    else:
        from bench.ppo import bench_ppo

        model, engine = _model_and_engine(a, max_len=max(256, 128 + a.response_length))  # prompts ~60 tokens
        out = bench_ppo(model, engine, a.backend, a.batch_size, a.response_length, a.threads, Path(a.work_dir),
                        repeats=a.repeats)
    print(json.dumps(out))
    return 0
