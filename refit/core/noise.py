"""What a command prints: progress, results and real warnings; the libraries' notes and the resolved config only
with ``--verbose``.

The front door (``refit/cli.py``) calls :func:`quiet` once, before a command imports torch, transformers or PEFT,
so the settings that those libraries read at import time take effect. Each silenced source is named below with
why it is noise for a Refit user; a child process (a bench stage, a torchrun rank) inherits the environment.
"""

from __future__ import annotations

import logging
import os
import warnings

_state = {"verbose": False}

# (environment variable, value): read by the library when it is imported
QUIET_ENV = (
    # transformers' notes that Refit's own calls trigger and a user cannot act on: "`loss_type=None` was set in the
    # config but it is unrecognized" (every causal LM given labels: the builtin warm-up) and the like; its errors stay
    ("TRANSFORMERS_VERBOSITY", "error"),
    # transformers' tqdm is on only while the Hub's bars are: its "Writing model shards" bar at every save_pretrained
    # (a checkpoint, the final model) broke the PPO progress bar's line
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
)
# loggers lowered to errors: the ONNX exporter's registry says "torchvision is not installed. Skipping ..." for each
# torchvision op it knows, 4 lines per export, though no language model uses one
QUIET_LOGGERS = ("torch.onnx._internal.exporter._registration",)
# Python warnings filtered, (category, module): PEFT's notes on wrapping a model ("fan_in_fan_out is set to False but
# the target module is `Conv1D`", "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"),
# said again for each PEFT model a run builds, and transformers' deprecations of its own names that PEFT calls
# ("`is_gradient_checkpointing` is deprecated"): nothing a Refit user can act on
QUIET_WARNINGS = ((UserWarning, r"peft(\..*)?"), (FutureWarning, r"transformers(\..*)?"))


def quiet(verbose: bool = False) -> None:
    """Silence the noise named above, unless ``verbose``; an environment variable the user set is kept."""
    _state["verbose"] = verbose
    if verbose:
        return
    for name, value in QUIET_ENV:
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)


def verbose() -> bool:
    """True when the command line asked for ``--verbose`` (the resolved config printed, the libraries' notes)."""
    return _state["verbose"]
