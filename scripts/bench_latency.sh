#!/usr/bin/env bash
# Generation latency benchmark: HF generate() vs Refit's engines, one run, one process
# (thin driver over `refit bench generate`; the last stdout line is one JSON document).
#
# usage: scripts/bench_latency.sh [refit bench generate flags]   (all flags: refit bench generate --help)
#   e.g. --model DIR --backends torch,onnxruntime,tensorrt --batch_sizes 1,8,32 --threads 2
#   default model: the GPT-2-small geometry (124M), built locally; nothing is downloaded
# Also runs `refit bench refit` (update_weights vs re-export) when REFIT_BENCH_PUSH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m refit}"
$REFIT bench generate "$@"
if [[ "${REFIT_BENCH_PUSH:-0}" == "1" ]]; then
  $REFIT bench refit
fi
