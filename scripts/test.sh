#!/usr/bin/env bash
# Install Refit with its test extras into ./.venv and run the test suite (what CI runs).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` or `-k export`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,3p' "$0"; exit 0; fi
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q -ra "$@"
