"""``refit bench generate|refit|ppo|workers|inflight``: benchmarks whose last stdout line is one JSON document."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated


from refit.core.errors import RefitError
from refit.core.parsing import FLAT, opt, parse


@dataclass(frozen=True)
class Machine:
    """Where built models and engines are cached, and the threads."""

    work_dir: str = opt("runs/bench", "where built models and engines are cached")
    threads: int = opt(2, "intra-op threads for torch and the engines")


@dataclass(frozen=True)
class Source:
    """The benchmark model and its engine."""

    model: str = opt("", "HF checkpoint folder (default: build --geometry locally)")
    geometry: str = opt("gpt2-small", "local geometry to build when --model is not given")
    engine: str = opt("", "engine folder (default: exported into --work_dir)")
    repeats: int = opt(3, "timed repeats (median reported)")


@dataclass(frozen=True)
class OnMachine:
    """The section every bench starts with: its flags keep no prefix (--work_dir, --threads)."""

    machine: Annotated[Machine, FLAT] = opt(help_="", factory=Machine)


@dataclass(frozen=True)
class OnModel(OnMachine):
    """The sections of a bench on one model and its engine (--model, --geometry, --engine, --repeats)."""

    source: Annotated[Source, FLAT] = opt(help_="", factory=Source)


@dataclass(frozen=True)
class BenchGenerate(OnModel):
    """Generation latency: HF generate() vs Refit engines."""

    backends: str = opt("torch,onnxruntime,onnxruntime-plain",
                        "comma list of Refit backends (onnxruntime: the engine folder, fused attention by default; "
                        "onnxruntime-plain: the standard-op graph of the same model)")
    batch_sizes: str = opt("1,8,32", "comma list of batch sizes")
    prompt_len: int = opt(32, "prompt tokens per row")
    new_tokens: int = opt(64, "generated tokens per row")
    n: int = opt(1, "samples per prompt (a PPO/GRPO group): each batch is batch/n prompts x n samples")
    shards: int = opt(1, "> 1: each onnxruntime backend also runs as '<backend>-shards<S>', its rows decoded in S "
                         "shards on S threads sharing --threads (HF generate() keeps --threads intra-op threads)")
    quantize: str = opt("none", "int8: the int8 engine (export --quantize int8) vs the fp32 engine vs HF generate(), "
                                "the log-prob gap and the push time (bench/quantized.py); --backends is then unused")
    ct2_python: str = opt("", "with --quantize int8: a Python that has ctranslate2 (a separate venv) to run "
                              "CTranslate2 int8 on the same model too")


@dataclass(frozen=True)
class BenchRefit(OnModel):
    """update_weights vs a full re-export."""


@dataclass(frozen=True)
class BenchPPO(OnModel):
    """One PPO iteration with engine rollouts vs HF generate() rollouts."""

    source: Annotated[Source, FLAT] = opt(help_="", factory=lambda: Source(geometry="small-gpt2"))
    batch_size: int = opt(8, "rows per PPO iteration")
    response_length: int = opt(192, "generated tokens per row")
    backend: str = opt("onnxruntime", "engine backend compared with HF generate()")
    max_staleness: int = opt(0, "k >= 1: also time the engine loop with generation overlapped with the update "
                                "(rollout.max_staleness k), side by side with the synchronous loop and HF")
    num_generations: int = opt(1, "samples per prompt; > 1 runs GRPO (group advantages, no critic): batch_size "
                                  "prompts x num_generations rows")
    engine_shards: int = opt(1, "the synchronous engine run's rollout.engine_shards (its rows decoded in that many "
                                "shards, one thread each; --threads shared out)")


@dataclass(frozen=True)
class BenchWorkers(OnMachine):
    """A demo-sized PPO iteration with 1 vs N Ray rollout workers (always the embedded demo's policy)."""

    workers: int = opt(2, "rollout workers compared with one engine")
    steps: int = opt(8, "PPO steps per run (the first 2 are not timed)")


@dataclass(frozen=True)
class BenchInflight(OnModel):
    """A variable-length workload: static batches vs in-flight batching (same rows, tokens/s, peak RSS)."""

    rows: int = opt(128, "rows (prompts) in the workload")
    slots: int = opt(32, "engine batch: slots (in-flight) or batch size (static)")
    prompt_len: int = opt(32, "prompt tokens per row")
    new_tokens: int = opt(128, "max new tokens per row")
    stop_frac: float = opt(1 / 32, "fraction of the vocabulary whose tokens stop a row (mean length ~1/stop_frac)")


BENCHES = {"generate": BenchGenerate, "refit": BenchRefit, "ppo": BenchPPO, "workers": BenchWorkers,
           "inflight": BenchInflight}


def _usage() -> str:
    lines = ["usage: refit bench {" + ",".join(BENCHES) + "} [options]", "", __doc__.splitlines()[0], "", "benches:"]
    lines += [f"  {name:<10} {cls.__doc__.splitlines()[0]}" for name, cls in BENCHES.items()]
    return "\n".join(lines + ["", "Run 'refit bench <bench> --help' for its options."])


def _model_and_engine(m: Machine, s: Source, backends: str = "", log=print, max_len: int = 256,
                      quantize: str = "none") -> tuple[Path, Path]:
    """The benchmark model (built locally when not given) and its ONNX engine folder (exported or reused)."""
    from refit.rollout.build import build
    from refit.learner.examples.models import build_model
    from refit.export.onnx_export import ExportOptions

    work = Path(m.work_dir)
    model = Path(s.model) if s.model else work / s.geometry
    if not s.model and not (model / "config.json").exists():
        log(f"building the {s.geometry} geometry locally in {model}")
        build_model(s.geometry, model)
    suffix = "" if quantize == "none" else f"-{quantize}"
    engine = Path(s.engine) if s.engine else work / f"{model.name}-engine{suffix}"
    backend = "tensorrt" if "tensorrt" in backends.split(",") else "onnxruntime"
    build(model, engine, backend, ExportOptions(max_batch=64, max_len=max_len, quantize=quantize), log=log)
    return model, engine


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] not in BENCHES:
        raise RefitError(f"unknown bench {argv[0]!r}; one of {', '.join(BENCHES)}")
    which = argv[0]
    a, _ = parse(BENCHES[which], argv[1:], f"refit bench {which}")
    m = a.machine
    if which == "generate" and a.quantize != "none":
        from refit.bench.quantized import bench_quantized

        model, fp32 = _model_and_engine(m, a.source)
        _, int8 = _model_and_engine(m, a.source, quantize=a.quantize)
        out = bench_quantized(model, fp32, int8, [int(x) for x in a.batch_sizes.split(",")], a.prompt_len,
                              a.new_tokens, a.source.repeats, m.threads, a.ct2_python, Path(m.work_dir))
    elif which == "generate":
        from refit.bench.generate import bench_generate

        model, engine = _model_and_engine(m, a.source, a.backends)
        out = bench_generate(model, engine, a.backends.split(","), [int(x) for x in a.batch_sizes.split(",")],
                             a.prompt_len, a.new_tokens, a.source.repeats, m.threads, n=a.n, shards=a.shards)
    elif which == "refit":
        from refit.bench.generate import bench_refit

        model, engine = _model_and_engine(m, a.source)
        out = bench_refit(model, engine, a.source.repeats, m.threads, Path(m.work_dir))
    elif which == "inflight":
        from refit.bench.inflight import bench_inflight

        _, engine = _model_and_engine(m, a.source)
        out = bench_inflight(engine, a.rows, a.slots, a.prompt_len, a.new_tokens, a.stop_frac, a.source.repeats,
                             m.threads)
    elif which == "workers":
        from refit.bench.workers import bench_workers

        out = bench_workers(Path(m.work_dir) / "workers", a.workers, a.steps, m.threads)
    else:
        from refit.bench.ppo import bench_ppo

        model, engine = _model_and_engine(m, a.source, max_len=max(256, 128 + a.response_length))  # prompts ~60 tok
        out = bench_ppo(model, engine, a.backend, a.batch_size, a.response_length, m.threads, Path(m.work_dir),
                        repeats=a.source.repeats, max_staleness=a.max_staleness, num_generations=a.num_generations,
                        engine_shards=a.engine_shards)
    print(json.dumps(out))
    return 0
