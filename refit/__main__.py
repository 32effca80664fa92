"""``python -m refit <command> ...``: the same front door as the ``refit`` console command (:mod:`refit.cli`)."""

import sys

from refit.cli import main

sys.exit(main())
