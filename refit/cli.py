"""``refit``: the front door. One console command, one subcommand per job, the table below.

Each subcommand's code lives in the room that owns the job and exposes ``main(argv) -> int``; this file only
names them and dispatches. The imports are plain statements inside small functions (the face may import
lazily), so ``refit export --help`` never imports the learner, nothing imports ``tensorrt`` unless asked, and
every arrow is visible to ``tests/test_layout.py``. A :class:`refit.core.errors.RefitError` becomes one line on
stderr and exit status 2; nothing half-written is left behind by the jobs themselves. Any other exception is
one line too (:mod:`refit.core.explain`: files, graphs, the disk; else "unexpected", with a hint); ``--debug``
(anywhere on the line) re-raises it with its traceback instead.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

from refit.core.errors import RefitError, Stopped
from refit.core.explain import explain, unexpected


def _build_model(argv: list[str]) -> int:
    from refit.learner.build_model import main
    return main(argv)


def _export(argv: list[str]) -> int:
    from refit.rollout.build import main
    return main(argv)


def _generate(argv: list[str]) -> int:
    from refit.rollout.cli import main
    return main(argv)


def _bench(argv: list[str]) -> int:
    from refit.bench.cli import main
    return main(argv)


def _ppo(argv: list[str]) -> int:
    from refit.learner.ppo.cli import main
    return main(argv)


def _distill(argv: list[str]) -> int:
    from refit.learner.distill.cli import main
    return main(argv)


def _demo(argv: list[str]) -> int:
    from refit.learner.builtin.demo import main
    return main(argv)


# name -> (the command's main, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "build-model": (_build_model, "build a small random-weight HF checkpoint (tiny-gpt2, gpt2-small, ...) locally"),
    "export": (_export, "export an HF checkpoint folder to an engine folder (ONNX, or TensorRT on NVIDIA)"),
    "generate": (_generate, "generate from an engine folder with padded batches and per-token log-probs"),
    "bench": (_bench, "benchmarks: 'generate' latency, 'refit' weight push, 'ppo' iteration"),
    "ppo": (_ppo, "PPO-KL training cycle: export -> rollouts -> update -> weight push"),
    "distill": (_distill, "knowledge distillation (GKD, supervised KD, sequence-level KD)"),
    "demo": (_demo, "the embedded default: a small verifiable task trained with PPO on CPU"),
}


def _usage() -> str:
    lines = ["usage: refit <command> [options]", "", "Refit: RLHF and distillation with generation on exported engines.",
             "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'refit <command> --help' for the options of a command."]
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
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"refit: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
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
