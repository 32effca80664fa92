"""Deprecated: ``refit.learner.examples`` is now :mod:`refit.learner.builtin` (the builtin tasks and model builders).

The old module paths still load, for one release, with a DeprecationWarning: ``from
refit.learner.examples.models import build_model`` and reward specs such as
``refit.learner.examples.tasks:length_reward`` reach the same modules under their new names.
"""

import sys
import warnings

from refit.learner.builtin import demo, distill_pair, models, moe_models, published, sft, tasks

warnings.warn("refit.learner.examples is now refit.learner.builtin; the old name is deprecated",
              DeprecationWarning, stacklevel=2)

for _module in (demo, distill_pair, models, moe_models, published, sft, tasks):  # the old dotted names, aliased
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
