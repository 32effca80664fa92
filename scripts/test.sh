#!/usr/bin/env bash
# Install Refit with its test extras into ./.venv and run the test suite (what CI runs).
# With no arguments: every test not marked slow. Extra arguments go to pytest instead,
# e.g. `bash scripts/test.sh -m slow` or `bash scripts/test.sh -k export`.
# How long: the non-slow suite takes about 22 min on 2 cores (CI's 25-minute budget), plus the install the first time;
# one file (`bash scripts/test.sh tests/test_config.py`) takes seconds to a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,6p' "$0"; exit 0; fi
bash scripts/setup.sh dev
if [[ $# -eq 0 ]]; then
  echo "scripts/test.sh: the tests not marked slow; about 22 min on 2 cores" >&2
  set -- -m "not slow" --durations=50  # the 50 slowest named, so the budget stays visible
fi
exec .venv/bin/python -m pytest -q -ra "$@"
