#!/usr/bin/env bash
# Create ./.venv and install Refit into it. Usage: bash scripts/setup.sh [EXTRAS]   (e.g. dev, gpu, dist)
# torch is installed first and pinned to the CPU build: a plain `pip install torch` (or a package
# that depends on it) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,4p' "$0"; exit 0; fi
extras="${1:-}"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
echo "refit installed in $(pwd)/.venv"
