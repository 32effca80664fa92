"""``refit bench generate|refit|ppo|grpo|workers|inflight|lora``: benchmarks whose last stdout line is one JSON document."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from refit.bench.generate import bench_generate, bench_refit
from refit.bench.grpo import DEFAULT_DATASET, Workload, bench_grpo
from refit.bench.grpo_model import prepare_model
from refit.bench.inflight import bench_inflight
from refit.bench.lora import main as lora_main
from refit.bench.ppo import bench_ppo
from refit.bench.quantized import bench_quantized
from refit.bench.workers import bench_workers
from refit.core.errors import RefitError
from refit.core.parsing import FLAT, opt, parse
from refit.export.options import ExportOptions
from refit.learner.builtin.models import build_model
from refit.rollout.build import build, ensure_engine, guard_engine


@dataclass(frozen=True)
class Machine:
    """Where built models and engines are cached, and the threads."""

    work_dir: str = opt("runs/bench", "where built models and engines are cached")
    threads: int = opt(2, "intra-op threads for torch and the engines")


@dataclass(frozen=True)
class Source:
    """The benchmark model and its engine."""

    model: str = opt("", "HF checkpoint folder (empty: build --geometry locally)")
    geometry: str = opt("gpt2-small", "local geometry to build when --model is not given")
    engine: str = opt("", "engine folder (empty: exported into --work_dir)")
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
                                "the log-prob gap and the push time (refit/bench/quantized.py); --backends is then "
                                "unused")
    ct2_python: str = opt("", "with --quantize int8: a Python that has ctranslate2 (a separate venv) to run "
                              "CTranslate2 int8 on the same model too")

    def run(self) -> dict:
        m, s = self.machine, self.source
        batch_sizes = [int(x) for x in self.batch_sizes.split(",")]
        if self.quantize != "none":
            model, fp32 = _model_and_engine(m, s)
            _, int8 = _model_and_engine(m, s, quantize=self.quantize)
            return bench_quantized(model, fp32, int8, batch_sizes, self.prompt_len, self.new_tokens, s.repeats,
                                   m.threads, self.ct2_python, Path(m.work_dir))
        model, engine = _model_and_engine(m, s, self.backends, rows=max(batch_sizes) * self.n)
        return bench_generate(model, engine, self.backends.split(","), batch_sizes, self.prompt_len, self.new_tokens,
                              s.repeats, m.threads, n=self.n, shards=self.shards)


@dataclass(frozen=True)
class BenchRefit(OnModel):
    """update_weights vs a full re-export."""

    def run(self) -> dict:
        model, engine = _model_and_engine(self.machine, self.source, any_size=True)
        return bench_refit(model, engine, self.source.repeats, self.machine.threads, Path(self.machine.work_dir))


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
    engine_shards: int = opt(0, "the synchronous engine run's rollout.engine_shards (0: auto, as refit ppo; its "
                                "rows decoded in that many shards, one thread each; --threads shared out)")

    def run(self) -> dict:
        m = self.machine
        model, engine = _model_and_engine(m, self.source, max_len=max(256, 128 + self.response_length))  # prompts ~60
        return bench_ppo(model, engine, self.backend, self.batch_size, self.response_length, m.threads,
                         Path(m.work_dir), repeats=self.source.repeats, max_staleness=self.max_staleness,
                         num_generations=self.num_generations, engine_shards=self.engine_shards)


@dataclass(frozen=True)
class BenchWorkers(OnMachine):
    """A demo-sized PPO iteration with 1 vs N Ray rollout workers (always the embedded demo's policy)."""

    workers: int = opt(2, "rollout workers compared with one engine")
    steps: int = opt(8, "PPO steps per run (the first 2 are not timed)")

    def run(self) -> dict:
        return bench_workers(Path(self.machine.work_dir) / "workers", self.workers, self.steps, self.machine.threads)


@dataclass(frozen=True)
class BenchInflight(OnModel):
    """A variable-length workload: static batches vs in-flight batching (same rows, tokens/s, peak RSS)."""

    rows: int = opt(128, "rows (prompts) in the workload")
    slots: int = opt(32, "engine batch: slots (in-flight) or batch size (static)")
    prompt_len: int = opt(32, "prompt tokens per row")
    new_tokens: int = opt(128, "max new tokens per row")
    stop_frac: float = opt(1 / 32, "fraction of the vocabulary whose tokens stop a row (mean length ~1/stop_frac)")

    def run(self) -> dict:
        _, engine = _model_and_engine(self.machine, self.source)
        return bench_inflight(engine, self.rows, self.slots, self.prompt_len, self.new_tokens, self.stop_frac,
                              self.source.repeats, self.machine.threads)


@dataclass(frozen=True)
class BenchGRPO(OnMachine):
    """GRPO steps side by side: Refit's refit ppo against TRL's GRPOTrainer (--vs trl) or HF generate() rollouts."""

    vs: str = opt("hf", "the baseline: 'trl' (TRL 1.16's GRPOTrainer, installed on first use into --trl_venv) or "
                        "'hf' (refit ppo with --rollout.backend hf)")
    model_dir: str = opt("", "local HF folder, decoder-only, with a chat template (empty: --geometry built locally)")
    geometry: str = opt("small-gpt2", "built when --model_dir is not given (random weights, chat tokenizer): a local "
                                      "geometry (small-gpt2, tiny-gpt2, ...) or a published one by name "
                                      "(qwen2.5-0.5b, llama-3.2-1b, smollm2-135m, ...)")
    layers: int = opt(0, "a published geometry cut to this many layers (0: its published depth)")
    dataset: str = opt("", "jsonl with a prompt column and the reward's answer column "
                           "(empty: examples/trl_chat/data.jsonl)")
    prompts_per_step: int = opt(16, "prompts per optimizer step (one generation, one update)")
    num_generations: int = opt(8, "completions per prompt (the GRPO group)")
    max_completion_length: int = opt(128, "new tokens per completion at most")
    temperature: float = opt(1.0, "sampling temperature")
    learning_rate: float = opt(1e-5, "AdamW learning rate")
    lr_scheduler: str = opt("constant", "learning-rate schedule on both sides: constant, linear, cosine")
    beta: float = opt(0.0, "KL coefficient: TRL's beta (0, its default: no reference model); Refit's kl_coef, "
                           "a k3 term in the loss")
    steps: int = opt(10, "optimizer steps per run; each run's first is the warm-up, reported apart")
    rounds: int = opt(2, "interleaved rounds: each side runs --steps in a fresh process per round")
    seed: int = opt(0, "seed of round 0 on both sides (round r: seed + r)")
    device: str = opt("cpu", "the learners' device on both sides (cpu, cuda)")
    lora_r: int = opt(0, "LoRA rank on both sides (0: full fine-tuning)")
    lora_alpha: float = opt(16.0, "LoRA alpha on both sides")
    lora_target: str = opt("all-linear", "LoRA target modules on both sides: all-linear or a comma list")
    lora_base_dtype: Literal["auto", "fp32", "bf16", "int8"] = opt(
        "auto", "the frozen base's dtype on the learners (bf16: TRL's model_init_kwargs dtype, Refit's "
                "lora.base_dtype; int8: Refit's only, TRL's base fp32; auto: what refit ppo picks on this machine, "
                "refit.learner.run.precision)")
    quantize: Literal["auto", "none", "int8"] = opt(
        "auto", "Refit's engine only: int8 linear layers (rollout.quantize; TIS corrects the gap; auto: what refit ppo "
                "picks on this machine); the learners stay as set on both sides")
    refit_args: str = opt("", "further refit ppo flags for Refit's side, e.g. --refit_args='--rollout.max_staleness 1' "
                                "(with '=': a value starting with -- is otherwise read as a flag)")
    trl_args: str = opt("", "JSON object of further GRPOConfig fields for TRL's side")
    trl_search: bool = opt(True, "--vs trl: first try the TRL configurations a careful user would (checkpointing on/off, "
                                 "16-row micro-batches with accumulation, bf16 autocast), --trial_steps steps each, and "
                                 "run the rounds with the fastest that fits in memory (--no_trl_search: TRL's defaults)")
    trial_steps: int = opt(3, "steps of each TRL trial (the first is the warm-up; the median of the rest is compared)")
    trl_venv: str = opt(".venv-trl", "the TRL side's virtual environment (made on first use)")

    def run(self) -> dict:
        m, work = self.machine, Path(self.machine.work_dir)
        model = Path(self.model_dir) if self.model_dir else prepare_model(work, self.geometry, self.layers)
        w = Workload(model=str(model.resolve()), dataset=str(Path(self.dataset or DEFAULT_DATASET).resolve()),
                     prompts_per_step=self.prompts_per_step, num_generations=self.num_generations,
                     max_completion_length=self.max_completion_length, temperature=self.temperature,
                     learning_rate=self.learning_rate, lr_scheduler=self.lr_scheduler, steps=self.steps,
                     beta=self.beta, threads=m.threads, device=self.device, lora_r=self.lora_r,
                     lora_alpha=self.lora_alpha, lora_target=self.lora_target,
                     lora_base_dtype=self.lora_base_dtype, quantize=self.quantize)
        return bench_grpo(w, work.resolve(), self.vs, self.rounds, self.seed, self.refit_args, self.trl_args,
                          Path(self.trl_venv).resolve(), trl_search=self.trl_search, trial_steps=self.trial_steps)


# every bench by name -> its options, whose ``run()`` runs it and returns the JSON document (the flags, the help and the
# run in one place: main() looks the bench up here and has no branch per bench)
BENCHES = {"generate": BenchGenerate, "refit": BenchRefit, "ppo": BenchPPO, "grpo": BenchGRPO, "workers": BenchWorkers,
           "inflight": BenchInflight}
# every bench by name -> its one-line help: the usage line, the list below it and "unknown bench" are made from this
# (lora has its own parser, refit/bench/lora.py: its stages run in child processes)
HELP = {**{name: cls.__doc__.splitlines()[0] for name, cls in BENCHES.items()},
        "lora": "LoRA at published geometries, full depth: export, adapter vs full push, GRPO steps"}


def _usage() -> str:
    lines = ["usage: refit bench {" + ",".join(HELP) + "} [options]", "", __doc__.splitlines()[0], "", "benches:"]
    lines += [f"  {name:<10} {help_}" for name, help_ in HELP.items()]
    return "\n".join(lines + ["", "Run 'refit bench <bench> --help' for its options."])


def _model_and_engine(m: Machine, s: Source, backends: str = "", log=print, max_len: int = 256,
                      quantize: str = "none", rows: int = 64, any_size: bool = False) -> tuple[Path, Path]:
    """The benchmark model (built locally when not given) and its ONNX engine folder (exported or reused; one the
    user named is used as it is, refused when it cannot serve the bench; ``any_size``: any engine of the model's
    weights serves, as for a weight push)."""
    work = Path(m.work_dir)
    model = Path(s.model) if s.model else work / s.geometry
    if not s.model and not (model / "config.json").exists():
        log(f"building the {s.geometry} geometry locally in {model}")
        build_model(s.geometry, model)
    suffix = "" if quantize == "none" else f"-{quantize}"
    engine = Path(s.engine) if s.engine else work / f"{model.name}-engine{suffix}"
    backend = "tensorrt" if "tensorrt" in backends.split(",") else "onnxruntime"
    if s.engine:  # a folder the user named: used as it is when it serves the bench, never exported over
        guard_engine(model, engine, log=log)
        ensure_engine(model, engine, 1 if any_size else rows, 1 if any_size else max_len, backend, log, quantize,
                      own=False)
        return model, engine
    # rows: the bench's largest call, so that it runs as one call (an engine runs a larger one in calls of max_batch)
    build(model, engine, backend, ExportOptions(max_batch=max(64, rows), max_len=max_len, quantize=quantize), log=log)
    return model, engine


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "lora":  # its own argument parser: stages in child processes (refit/bench/lora.py)
        return lora_main(argv[1:])
    if argv[0] not in BENCHES:
        raise RefitError(f"unknown bench {argv[0]!r}; one of {', '.join(HELP)}")
    which = argv[0]
    a, _ = parse(BENCHES[which], argv[1:], f"refit bench {which}")
    print(json.dumps(a.run()))
    return 0
