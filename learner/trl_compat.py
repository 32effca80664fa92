"""The TRL facade's earlier home, kept importable: everything now lives in :mod:`refit.learner.trl`."""

from refit.learner.trl import *  # noqa: F401,F403
from refit.learner.trl import __all__  # noqa: F401
from refit.learner.trl.common import demo_chat_model, resolve_model  # noqa: F401
