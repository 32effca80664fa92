"""``refit``: the front door. One console command, one subcommand per job, the table below.

Each subcommand's code lives in the room that owns the job and exposes ``main(argv) -> int``; this file only
names them and dispatches. The imports are plain statements inside small functions (the face may import
lazily), so ``refit export --help`` never imports the learner, nothing imports ``tensorrt`` unless asked, and
every arrow is visible to ``tests/test_layout.py``. A :class:`refit.core.errors.RefitError` becomes one line on
stderr and exit status 2; nothing half-written is left behind by the jobs themselves. Any other exception is
one line too (:mod:`refit.core.explain`: files, graphs, the disk; else "unexpected", with a hint); ``--debug``
(anywhere on the line) re-raises it with its traceback instead. ``--verbose`` (anywhere on the line) prints the
resolved config and the libraries' notes that are otherwise kept off the terminal (:mod:`refit.core.noise`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from refit.core.errors import RefitError, Stopped
from refit.core.explain import explain, unexpected
from refit.core.noise import quiet


def _build_model(argv: list[str]) -> int:
    from refit.learner.build_model import main
    return main(argv)


# A command that loads torch, transformers or onnxruntime is reached in two steps: its line is parsed and checked
# first (the flags, the YAML, the folders it names) by a module that imports none of them, so a mistake is answered
# in well under a second; only then is the command's module imported and run (tests/test_cli_fast.py).

def _export(argv: list[str]) -> int:
    from refit.rollout.config import parse_export
    job = parse_export(argv)
    from refit.rollout.build import run_export
    return run_export(job)


def _generate(argv: list[str]) -> int:
    from refit.rollout.config import parse_generate
    job = parse_generate(argv)
    from refit.rollout.cli import run_generate
    return run_generate(*job)


def _bench(argv: list[str]) -> int:
    from refit.bench.cli import main
    return main(argv)


def _ppo(argv: list[str]) -> int:
    from refit.learner.ppo.config import parse_ppo
    job = parse_ppo(argv)
    from refit.learner.ppo.cli import run
    return run(*job)


def _distill(argv: list[str]) -> int:
    from refit.learner.distill.config import parse_distill
    job = parse_distill(argv)
    from refit.learner.distill.cli import run
    return run(*job)


def _demo(argv: list[str]) -> int:
    from refit.learner.demo import main
    return main(argv)


# name -> (the command's main, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "build-model": (_build_model, "build a small random-weight HF checkpoint (tiny-gpt2, gpt2-small, ...) locally"),
    "export": (_export, "export an HF checkpoint folder to an engine folder (ONNX, or TensorRT on NVIDIA)"),
    "generate": (_generate, "generate from an engine folder with padded batches and per-token log-probs"),
    # the benches named as refit.bench.cli.HELP lists them (tests/test_cli_fast.py), without importing it for --help
    "bench": (_bench, "benchmarks: generate, refit, ppo, grpo, workers, inflight, lora ('refit bench --help')"),
    "ppo": (_ppo, "PPO-KL training cycle: export -> rollouts -> update -> weight push"),
    "distill": (_distill, "knowledge distillation (GKD, supervised KD, sequence-level KD)"),
    "demo": (_demo, "the embedded default: a small verifiable task trained with PPO on CPU"),
}


# REFIT_TOUR_SHORT=1 (the README tour, run as written by tests/test_readme_tour.py): flags appended to a command's
# own, so the last one wins, that make every training command of the tour a few small steps
TOUR_SHORT = {
    "ppo": ["--run.steps", "2", "--run.batch_size", "4", "--ckpt.save_steps", "2", "--eval_steps", "0"],
    "distill": ["--run.steps", "2", "--run.batch_size", "4", "--teacher_sft_steps", "4", "--eval_every", "2",
                "--eval_size", "4", "--ckpt.save_steps", "2"],
    "demo": ["--steps", "2", "--sft_steps", "4", "--batch_size", "4"],
}


def _usage() -> str:
    lines = ["usage: refit <command> [options]", "", "Refit: RLHF and distillation with generation on exported engines.",
             "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'refit <command> --help' for the options of a command. Any command also takes --verbose (the",
              "resolved config and the libraries' notes on the terminal) and --debug (a traceback, not one line)."]
    return "\n".join(lines)


def _raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _stop_on(signum: int) -> None:
    """Raise :class:`Stopped` in the main thread on ``signum`` (SIGTERM), where the default would end the process
    at once: the job unwinds as on Ctrl-C, and the line says what it kept. Only from the main thread (a caller
    running ``main`` in a thread keeps its own handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, _raise_stopped)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, verbose = "--debug" in argv, "--verbose" in argv
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    quiet(verbose)  # before any command imports torch or transformers: they read these settings at import
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"refit: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if os.environ.get("REFIT_TOUR_SHORT", "") not in ("", "0"):
        rest = rest + TOUR_SHORT.get(name, [])
    _stop_on(signal.SIGTERM)
    try:
        return int(COMMANDS[name][0](rest) or 0)
    except RefitError as e:
        if debug:
            raise
        print(f"refit {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as Stopped: the job's finally blocks have run
        sig = getattr(e, "signal_name", "SIGINT")
        kept = getattr(e, "kept", "")
        print(f"refit {name}: stopped by {sig}{f'; {kept}' if kept else ''}", file=sys.stderr)
        return 128 + int(getattr(signal, sig))
    except SystemExit:
        raise  # --help, tyro's own usage errors
    except Exception as e:  # noqa: BLE001 - the one dispatch point: every exception is one line
        if debug:
            raise
        line = explain(e, name)
        print(f"refit {name}: error: {line or unexpected(e)}", file=sys.stderr)
        return 2 if line else 1


if __name__ == "__main__":
    sys.exit(main())
