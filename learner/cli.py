"""Deprecated spelling of the front door: ``python -m refit.learner.cli ...`` runs ``refit.cli`` (use ``refit ...``
or ``python -m refit ...``). The one arrow from a floor up to the face, named in tests/test_layout.py's SHIMS;
it stays while scripts and tests outside the learner still spell the old module."""

from __future__ import annotations

import sys

from refit.cli import COMMANDS, main

__all__ = ["COMMANDS", "main"]

if __name__ == "__main__":
    sys.exit(main())
