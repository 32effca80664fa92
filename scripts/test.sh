#!/usr/bin/env bash
# Install Refit with its test extras into ./.venv and run the test suite (what CI runs).
# With no arguments: every test not marked slow. Extra arguments go to pytest instead,
# e.g. `bash scripts/test.sh -m slow` or `bash scripts/test.sh -k export`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,4p' "$0"; exit 0; fi
bash scripts/setup.sh dev
if [[ $# -eq 0 ]]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q -ra "$@"
