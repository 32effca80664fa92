#!/usr/bin/env bash
# Generation latency benchmark: HF generate() vs Refit's engines, one run, one process
# (thin wrapper over `refit bench generate`; the last stdout line is one JSON document).
#
# usage: scripts/bench_latency.sh [--model DIR] [--backends LIST] [--batch-sizes LIST] [--threads N] [-- more flags]
#   --model DIR        HF checkpoint folder (default: the GPT-2-small geometry, 124M, built locally)
#   --backends LIST    comma list of Refit backends (default: torch,onnxruntime; add tensorrt on NVIDIA)
#   --batch-sizes LIST default 1,8,32
#   --threads N        intra-op threads (default 2)
# Also runs `refit bench refit` (update_weights vs re-export) when REFIT_BENCH_PUSH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m learner.cli}"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --model|--backends|--batch-sizes|--threads) args+=("$1" "$2"); shift 2 ;;
    --) shift; args+=("$@"); break ;;
    *) echo "bench_latency.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
$REFIT bench generate "${args[@]}"
if [[ "${REFIT_BENCH_PUSH:-0}" == "1" ]]; then
  $REFIT bench refit
fi
