"""``refit bench grpo``: the GRPO workload side by side, Refit's ``refit ppo`` (GRPO) against a baseline.

    refit bench grpo --vs trl                          # small-gpt2 chat model, 16 prompts x 8, 128 tokens, 10 steps
    refit bench grpo --vs trl --refit_args='--rollout.max_staleness 1' --steps 40 --rounds 1   # overlapped Refit
    refit bench grpo --vs trl --geometry qwen2.5-0.5b --lora_r 16 --lora_alpha 32 --steps 3 --rounds 1
        --prompts_per_step 16 --num_generations 4 --max_completion_length 64   # (one command) full depth, LoRA
    refit bench grpo                                   # Refit's engine against its own HF generate() rollouts

Baselines: ``--vs trl``, TRL's ``GRPOTrainer`` (TRL 1.16, installed by the bench into a virtual environment of
its own, ``--trl_venv``, with the same torch build as Refit's; the run is refit/bench/trl_grpo_side.py, which imports
TRL and never Refit); ``--vs hf``, Refit's own learner with HF ``generate()`` rollouts (``--rollout.backend hf``).

Each side runs as a child process (``refit ppo``, or the TRL script), ``--steps`` optimizer steps from the same
model folder, in ``--rounds`` interleaved rounds (a fresh process each round, the order alternating, the seed
``--seed + round`` on both sides). Reported per side: the median seconds a step over every step but each run's
first (the warm-up, reported apart), split by phase where the side exposes it; the peak RSS of its process
(``os.wait4``'s ``ru_maxrss``); the mean reward and completion length per step. Refit's engine is exported once
before the rounds by ``refit export`` (its seconds and peak RSS reported apart), and every round reuses it.

The settings aligned on both sides (TRL's ``GRPOConfig`` name / Refit's ``refit ppo`` flag):

- prompts per step: ``per_device_train_batch_size = prompts x num_generations`` with
  ``gradient_accumulation_steps`` 1 and ``num_iterations`` 1 (TRL's defaults), so one optimizer step per
  generation / ``--run.batch_size`` prompts, ``--num_ppo_epochs 1 --num_mini_batches 1`` (Refit's PPO defaults
  are 2 and 2);
- ``num_generations`` / ``--num_generations`` (with ``--advantage_estimator grpo``; both scale by the group std);
- ``max_completion_length`` / ``--response_length``; ``temperature`` / ``--temperature`` (top-k and top-p off on
  both sides by default);
- dropout off: ``disable_dropout=True`` (TRL's default is False) / Refit's learner and engine, which never apply
  dropout (the engine's log-probs and the learner's must be the same function); on a model with dropout in its config
  (small-gpt2: 0.1) TRL would otherwise train, and generate, with dropout on;
- ``learning_rate`` / ``--optim.learning_rate`` and ``lr_scheduler_type`` / ``--optim.lr_scheduler_type``
  (``--lr_scheduler``, constant by default; TRL's default is linear decay to 0, Refit's constant);
- ``max_steps`` / ``--run.steps``; ``seed`` / ``--run.seed``;
- ``beta`` / ``--kl_coef`` with ``--kl_penalty loss --kl_estimator k3`` (TRL's GRPO KL term; 0 by default, TRL's
  default: TRL then loads no reference model, Refit still scores its reference engine and logs the KL);
- precision: Refit's side at its defaults (``run.precision``, ``lora.base_dtype`` and ``rollout.quantize`` resolved
  on this machine as ``refit ppo`` resolves them, :func:`at_defaults`, and said in one line: bf16 where the hardware
  has bf16 units, an int8 engine under LoRA where the CPU has int8 dot-product units, and then, without bf16 units,
  the LoRA base held in int8 on the learner too); TRL's side in fp32 unless its search (below) finds its bf16
  autocast faster (its LoRA base in bf16 only where Refit's is: TRL + PEFT's int8 base, bitsandbytes, is CUDA-only);
- the device: ``use_cpu`` / ``--run.device`` (``--device``, cpu by default);
- threads: ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` in the TRL process, ``OMP_NUM_THREADS`` and
  ``--rollout.engine_threads`` in Refit's;
- the reward: one function in refit/bench/grpo_reward.py, loaded by path on both sides; the data: the same jsonl;
- LoRA (``--lora_r`` > 0): ``peft_config=LoraConfig(r, lora_alpha, target_modules)`` / ``--lora.r``,
  ``--lora.alpha``, ``--lora.target_modules`` (PEFT's default dropout 0 on both); ``--lora_base_dtype bf16``: the
  frozen base in bf16 on both sides, ``model_init_kwargs={"dtype": "bfloat16"}`` (TRL's model, generation included,
  in bf16; PEFT keeps the adapter in fp32) / ``--lora.base_dtype bf16`` (the learner's base in bf16; the engine
  computes in fp32 over the same rounded base);
- ``--quantize int8``: Refit's engine only (``rollout.quantize int8``: int8 linear layers, TIS by default); TRL
  generates with its learner's model, so the learners stay fp32 (or bf16) on both sides as set;
- logging only: ``logging_steps=1``, ``save_strategy="no"``, ``report_to="none"``; Refit writes no checkpoint
  within the run and no final export.

TRL at its best (``--vs trl``, unless ``--no_trl_search``): before the rounds, TRL's side runs ``--trial_steps``
steps under each configuration a careful user tries (gradient checkpointing on and off; 16-row micro-batches with
gradient accumulation; TRL's default bf16 autocast over the fastest fp32 one), each watched for memory, and the
rounds run the fastest that finished (refit/bench/trl_best.py; every trial is in the JSON's ``trl_trials``). Refit runs
at its defaults. Without the search, everything else is each side's default: on TRL's side ``gradient_checkpointing=True``,
``loss_type="dapo"``, ``epsilon`` 0.2, ``max_grad_norm`` 1.0 (the values are in the JSON, ``trl.config``).
Departures kept visible: the two sides draw their prompts in their own orders from the same rows; a completion
stops at EOS and at the chat template's end-of-turn on Refit's side, and at the tokenizer's EOS plus the model's
``generation_config.eos_token_id`` on TRL's: the bench writes the end-of-turn into the generation config of the
models it builds, and records both stop sets (``stops``) for any model. ``--refit_args`` and ``--trl_args`` pass
further settings to one side (e.g. ``--refit_args='--rollout.max_staleness 1'``, with ``=``: a value that starts
with ``--`` is otherwise read as a flag).

Run it on a quiet machine: the JSON records the load average after each run (``machine``, ``loadavg_1m_by_round``)
and the bench warns when it passed the CPU count: with more runnable threads than cores, multi-threaded PyTorch
slows far more than its share of the CPUs (each of the many small ops of transformers ``generate()`` waits at an
OpenMP barrier for a thread the scheduler has put aside), so a loaded machine penalises TRL's side most.

Phases: Refit's own ``time/rollout``, ``time/score``, ``time/update``, ``time/weight_push`` (metrics.jsonl);
TRL's ``generate`` (its ``_generate``), ``score`` (the rest of ``_generate_and_score_completions``: rewards,
advantages, the log-probs the loss needs) and ``update`` (the rest of the optimizer step: forward, backward, the
optimizer). ``generation_s`` is Refit's rollout or TRL's generate; ``learner_s`` the step less it.

Here: the workload, each side's command and the rounds. The model the bench builds and the stop ids:
refit/bench/grpo_model.py; the rows, the summaries and the reward gap: refit/bench/grpo_report.py.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace as NS

from refit.bench.grpo_model import stops
from refit.bench.grpo_report import median, refit_rows, reward_gap, step_split, summarize, trl_rows
from refit.bench.trl_best import best_trl_config, memory_limit_gb
from refit.core.errors import RefitError
from refit.learner.run.chat import encode_prompts
from refit.learner.run.precision import hardware_facts, resolve_precision

HERE = Path(__file__).resolve().parent
REWARD_FILE = HERE / "grpo_reward.py"
TRL_SIDE = HERE / "trl_grpo_side.py"
DEFAULT_DATASET = HERE.parents[1] / "examples" / "trl_chat" / "data.jsonl"
TRL_PIN = "trl==1.16.*"


@dataclass(frozen=True)
class Workload:
    """The settings both sides run with (the aligned ones of the module docstring)."""

    model: str  # the HF folder both sides load
    dataset: str  # jsonl: a prompt column (chat messages) and the reward's answer column
    prompts_per_step: int  # prompts per optimizer step (one generation each)
    num_generations: int  # completions per prompt: a step has prompts_per_step x num_generations rows
    max_completion_length: int  # new tokens per completion at most
    temperature: float  # sampling temperature (the learner scores at it too)
    learning_rate: float  # AdamW
    lr_scheduler: str  # constant | linear | cosine
    steps: int  # optimizer steps per run, one generation each
    beta: float  # KL coefficient (a k3 term in the loss)
    threads: int  # intra-op threads of each side's process (torch, and Refit's engine)
    device: str  # cpu | cuda
    lora_r: int  # 0: full fine-tuning
    lora_alpha: float  # the adapter's output scaled by lora_alpha / lora_r
    lora_target: str  # 'all-linear' or a comma list of module names
    lora_base_dtype: str = "auto"  # bf16: the frozen base held in bf16 on both learners (the adapter in fp32)
    quantize: str = "auto"  # int8: Refit's engine only (the rollout; TRL generates with its learner's model)
    precision: str = "auto"  # Refit's run.precision (full fine-tuning: bf16 autocast where the hardware has it)


def at_defaults(w: Workload) -> tuple[Workload, str]:
    """``w`` with its ``auto`` settings made what ``refit ppo`` picks on this machine (refit.learner.run.precision:
    the same function a run's setup calls), so the bench's export and run agree with Refit at its defaults; and the
    line that says so. TRL's side holds the LoRA base in the dtype Refit's side resolved."""
    cfg = NS(run=NS(precision=w.precision, bf16=True), ref_backend="auto",
             lora=NS(enabled=w.lora_r > 0, base_dtype=w.lora_base_dtype),
             rollout=NS(quantize=w.quantize, backend="onnxruntime"))
    p = resolve_precision(cfg, hardware_facts(w.device))
    return replace(w, lora_base_dtype=p.base_dtype, quantize=p.quantize, precision=p.run_precision), p.line("bench grpo")


def trl_base_dtype(w: Workload) -> str:
    """The LoRA base's dtype on TRL's side: bf16 where Refit's is (TRL's model_init_kwargs dtype), else fp32 (an int8
    base on Refit's side: TRL + PEFT's int8 base is bitsandbytes' QLoRA, a CUDA path that does not run on a CPU)."""
    return "bf16" if w.lora_base_dtype == "bf16" else "fp32"


def engine_max_len(w: Workload) -> int:
    """The engine's prompt + completion length: the longest rendered prompt plus the completion, as ``refit ppo``
    counts it (+8), rounded up to 64 and capped at the model's positions."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(w.model)
    rows = [json.loads(line) for line in Path(w.dataset).read_text().splitlines() if line.strip()]
    longest = max(len(ids) for ids in encode_prompts(tok, [r["prompt"] for r in rows], None, 0))
    cfg = AutoConfig.from_pretrained(w.model)
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 1 << 20
    return min(-(-(longest + w.max_completion_length + 8) // 64) * 64, positions)


def child_env(threads: int, keep_pythonpath: bool) -> dict:
    """Both sides' environment: the thread count, offline hub, no tokenizer fork pool."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if not keep_pythonpath:  # the TRL side sees its own environment only
        env.pop("PYTHONPATH", None)
    return env


def run_child(cmd: list[str], log_file: Path, env: dict, what: str) -> tuple[float, float]:
    """Run ``cmd`` to its end (output to ``log_file``); (wall seconds, peak RSS in GB from ``os.wait4``)."""
    t0 = time.perf_counter()
    with open(log_file, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = " | ".join(log_file.read_text().strip().splitlines()[-3:])
        raise RefitError(f"{what} exited with {proc.returncode} after {wall:.0f} s ({log_file}): {tail}")
    return wall, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def trl_python(venv: Path, log=print) -> Path:
    """The Python of ``venv`` with TRL 1.16 and PEFT, installed there on first use: torch first, pinned to the
    build Refit runs on (a plain ``pip install torch`` would pull a multi-GB CUDA build), then TRL and PEFT."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import trl, peft, datasets; print(trl.__version__)"]

    def ready() -> bool:
        return py.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.startswith("1.16.")

    if ready():
        return py
    torch_pin = f"torch=={version('torch').split('+')[0]}"
    log(f"installing {TRL_PIN} and peft into {venv} ({torch_pin} first), a virtual environment of their own")
    steps = [[sys.executable, "-m", "venv", str(venv)], [str(py), "-m", "pip", "install", "-q", torch_pin],
             [str(py), "-m", "pip", "install", "-q", TRL_PIN, "peft"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-2:])
            raise RefitError(f"installing TRL into {venv} failed at '{' '.join(cmd[-2:])}': {tail}")
    if not ready():
        raise RefitError(f"{venv} has no TRL 1.16 after the install ({' '.join(probe)})")
    return py


def lora_targets(w: Workload) -> list[str]:
    return w.lora_target.split(",")


def export_engine(w: Workload, engine: Path, logs: Path) -> dict:
    """``refit export`` of the model (reused by every Refit round: ``refit ppo`` takes any export of the same
    weights that fits its rows and length), in a child of its own so that its peak is apart from the runs'."""
    cmd = [sys.executable, "-m", "refit", "export", w.model, "-o", str(engine), "--max_batch",
           str(w.prompts_per_step * w.num_generations), "--max_len", str(engine_max_len(w))]
    if w.lora_r:
        cmd += ["--lora", *lora_targets(w), "--round_weights", "bf16" if w.lora_base_dtype == "bf16" else "none"]
    if w.quantize != "none":
        cmd += ["--quantize", w.quantize]
    wall, rss = run_child(cmd, logs / "refit-export.log", child_env(w.threads, True), "refit export")
    return {"s": round(wall, 1), "peak_rss_gb": round(rss, 3), "engine": str(engine)}


def refit_command(w: Workload, out: Path, seed: int, backend: str, engine: Path | None, extra: str) -> list[str]:
    """``refit ppo`` with GRPO and the aligned settings."""
    cmd = [sys.executable, "-m", "refit", "ppo", "--model.model_dir", w.model, "-o", str(out),
           "--data.dataset", w.dataset, "--reward", f"{REWARD_FILE}:reward", "--advantage_estimator", "grpo",
           "--num_generations", str(w.num_generations), "--run.batch_size", str(w.prompts_per_step),
           "--response_length", str(w.max_completion_length), "--temperature", str(w.temperature),
           "--optim.learning_rate", str(w.learning_rate), "--optim.lr_scheduler_type", w.lr_scheduler,
           "--run.steps", str(w.steps), "--run.seed", str(seed), "--run.device", w.device, "--run.precision", w.precision,
           "--num_ppo_epochs", "1", "--num_mini_batches", "1",
           "--kl_coef", str(w.beta), "--kl_penalty", "loss", "--kl_estimator", "k3",
           "--rollout.backend", backend, "--rollout.engine_threads", str(w.threads), "--rollout.quantize", w.quantize,
           "--ckpt.save_steps", str(10 * w.steps), "--no_export_final", "--log.no_progress", "--log.no_tensorboard",
           "--log.no_plots", "--overwrite"]
    if engine is not None:
        cmd += ["--model.engine_dir", str(engine)]
    if w.lora_r:
        cmd += ["--lora.r", str(w.lora_r), "--lora.alpha", str(w.lora_alpha), "--lora.base_dtype", w.lora_base_dtype,
                "--lora.target_modules", *lora_targets(w)]
    return cmd + shlex.split(extra)


def trl_command(py: Path, w: Workload, out: Path, seed: int, extra: str) -> list[str]:
    """refit/bench/trl_grpo_side.py in the TRL environment, with the aligned settings."""
    cmd = [str(py), str(TRL_SIDE), "--model_dir", w.model, "--dataset", w.dataset, "--reward_file", str(REWARD_FILE),
           "--output_dir", str(out), "--out", str(out / "side.json"),
           "--prompts_per_step", str(w.prompts_per_step), "--num_generations", str(w.num_generations),
           "--max_completion_length", str(w.max_completion_length), "--temperature", str(w.temperature),
           "--learning_rate", str(w.learning_rate), "--lr_scheduler", w.lr_scheduler, "--steps", str(w.steps),
           "--beta", str(w.beta), "--seed", str(seed), "--threads", str(w.threads), "--device", w.device,
           "--lora_r", str(w.lora_r), "--lora_alpha", str(w.lora_alpha), "--lora_target", w.lora_target,
           "--lora_base_dtype", trl_base_dtype(w)]
    return cmd + (["--trl_args", extra] if extra else [])


def run_side(side: str, rnd: int, cmd: list[str], env: dict, runs_dir: Path, log=print) -> dict:
    """One side's run in round ``rnd``: its rows, wall seconds, peak RSS (and the TRL side's own record)."""
    out = runs_dir / f"{side}-r{rnd}"
    out.mkdir(parents=True, exist_ok=True)
    wall, rss = run_child(cmd, runs_dir / f"{side}-r{rnd}.log", env, f"{side} (round {rnd})")
    run = {"wall_s": wall, "peak_rss_gb": rss, "loadavg_1m": os.getloadavg()[0]}  # the machine's, this run included
    if side == "trl":
        side_json = json.loads((out / "side.json").read_text())
        run["rows"] = trl_rows(side_json)
        run["info"] = {k: side_json[k] for k in ("versions", "config", "ref_model", "trainable_params",
                                                 "eos_token_ids", "threads")}
    else:
        run["rows"] = refit_rows(out)
    rows = run["rows"]
    log(f"round {rnd} {side:<8} step {median([r['step_s'] for r in rows[1:] or rows]):.3f} s (median), "
        f"first {rows[0]['step_s']:.2f} s, reward {statistics.fmean(r['reward'] for r in rows):.4f}, "
        f"peak RSS {rss:.2f} GB, wall {wall:.0f} s")
    return run


def search_trl(py: Path, w: Workload, runs_dir: Path, seed: int, trl_args: str, trial_steps: int,
               log=print) -> tuple[str, list[dict]]:
    """TRL's fastest configuration on this machine (refit/bench/trl_best.py), each candidate ``trial_steps`` steps; the
    user's ``trl_args`` fields override a candidate's. (the TRL side's ``trl_args`` for the rounds, the trials)."""
    user, trials_dir = json.loads(trl_args or "{}"), runs_dir / "trl-trials"
    tw = replace(w, steps=trial_steps)
    best, trials = best_trl_config(lambda name, f: trl_command(py, tw, trials_dir / name, seed, json.dumps({**f, **user})),
                                   w.prompts_per_step * w.num_generations, trl_base_dtype(w) == "fp32", trials_dir,
                                   child_env(w.threads, False), memory_limit_gb(), log)
    return json.dumps({**best, **user}), trials


def bench_grpo(w: Workload, work: Path, vs: str, rounds: int, seed: int, refit_args: str = "", trl_args: str = "",
               trl_venv: Path = Path(".venv-trl"), log=print, trl_search: bool = True, trial_steps: int = 3) -> dict:
    """The side-by-side run (module docstring); returns the JSON document. ``trl_search`` (``--vs trl``): TRL's side
    runs with the fastest of the configurations a careful user tries (:func:`search_trl`), not its defaults alone."""
    if vs not in ("trl", "hf"):
        raise RefitError(f"--vs {vs!r}: 'trl' (TRL's GRPOTrainer) or 'hf' (Refit with HF generate() rollouts)")
    if vs == "hf" and w.lora_r:
        raise RefitError("--lora_r with --vs hf: Refit's HF generate() baseline (rollout.backend hf) takes no adapter "
                         "push; compare LoRA with --vs trl")
    base = "trl" if vs == "trl" else "refit-hf"
    w, line = at_defaults(w)
    log(line.replace("refit bench grpo: precision:", "refit bench grpo: Refit's side at its defaults:"))
    runs_dir = work / "grpo-runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    py = trl_python(trl_venv, log) if vs == "trl" else None
    engine = work / (f"{Path(w.model).name}-grpo-engine{'-lora' if w.lora_r else ''}"
                     f"{'-bf16' if w.lora_r and w.lora_base_dtype == 'bf16' else ''}"
                     f"{'-' + w.quantize if w.quantize != 'none' else ''}")
    export = export_engine(w, engine, runs_dir)
    log(f"refit export: {export['s']} s, peak RSS {export['peak_rss_gb']} GB ({engine})")
    trials = None
    if vs == "trl" and trl_search:
        trl_args, trials = search_trl(py, w, runs_dir, seed, trl_args, trial_steps, log)
    runs: dict[str, list[dict]] = {"refit": [], base: []}
    for rnd in range(rounds):
        for side in ("refit", base) if rnd % 2 == 0 else (base, "refit"):
            folder = runs_dir / f"{side}-r{rnd}"
            if side == "trl":
                cmd, own_path = trl_command(py, w, folder, seed + rnd, trl_args), False
            else:
                backend, eng = ("onnxruntime", engine) if side == "refit" else ("hf", None)
                cmd, own_path = refit_command(w, folder, seed + rnd, backend, eng, refit_args), True
            runs[side].append(run_side(side, rnd, cmd, child_env(w.threads, own_path), runs_dir, log))
    trl_info = runs[base][-1].get("info", {})
    sides = {name: summarize(r) for name, r in runs.items()}
    ours, theirs = sides["refit"], sides[base]
    out = {"bench": "grpo", "vs": vs, "baseline": base, "model": w.model, "settings": asdict(w), "rounds": rounds,
           "seed": seed, "refit_args": refit_args, "trl_args": trl_args, "stops": stops(Path(w.model)),
           "refit_export": export, "sides": sides,
           "speedup": round(theirs["step_s"] / ours["step_s"], 3),
           "generation_speedup": round(theirs["generation_s"] / ours["generation_s"], 3),
           "learner_speedup": round(theirs["learner_s"] / ours["learner_s"], 3),
           "speedup_by_round": [round(t / o, 3) for o, t in zip(ours["step_s_by_round"], theirs["step_s_by_round"])],
           # each round's sides ran back to back, so a change of the machine's load between rounds cancels here
           "speedup_round_median": median([t / o for o, t in zip(ours["step_s_by_round"], theirs["step_s_by_round"])]),
           "peak_rss_ratio": round(theirs["peak_rss_gb"] / ours["peak_rss_gb"], 3),
           "reward_gap": reward_gap(ours, theirs)}
    if trl_info:
        out["trl"] = trl_info
    if trials is not None:  # every TRL configuration tried, and the one the rounds ran (in trl_args)
        out["trl_trials"] = trials
        out["trl_args"] = trl_args
    load = max(x for side in sides.values() for x in side["loadavg_1m_by_round"])
    out["machine"] = {"cpus": os.cpu_count(), "loadavg_1m_max": round(load, 2)}
    if load > (os.cpu_count() or 1) + 0.5:
        log(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs: other processes ran beside the bench, and "
            "multi-threaded PyTorch (OpenMP barriers in every op) slows far more than the threads' share; rerun on a "
            "quiet machine before quoting these seconds")
    if out["stops"]["refit"] != out["stops"]["trl"]:
        log(f"note: the sides stop at different ids (Refit {out['stops']['refit']}, TRL {out['stops']['trl']}): "
            "add the template's end-of-turn to the model's generation_config.json eos_token_id")
    log(f"refit {step_split(ours)} a step, {base} {step_split(theirs)}: "
        f"{out['speedup']}x; peak RSS {ours['peak_rss_gb']} vs {theirs['peak_rss_gb']} GB; reward gap "
        f"{out['reward_gap']['gap']} (noise {out['reward_gap']['noise']})")
    return out
