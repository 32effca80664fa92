#!/usr/bin/env bash
# Export policy and teacher engine folders from HF checkpoint folders (thin driver over `refit export`).
#
# usage: scripts/export.sh [--policy DIR] [--teacher DIR] [-o OUT] [--dtype fp32|fp16|bf16] [--backend onnx|tensorrt]
#   --policy DIR    policy HF folder (default: build the embedded warmed-up demo policy into OUT/models/policy)
#   --teacher DIR   teacher HF folder (default: build a larger local model into OUT/models/teacher)
#   -o OUT          output root (default: runs/export); engines go to OUT/engines/{policy,teacher}
#   --dtype, --backend   passed to `refit export`
# With no arguments it runs on the embedded default: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m learner.cli}"
policy="" teacher="" out="runs/export" dtype="fp32" backend="onnx"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --policy) policy="$2"; shift 2 ;;
    --teacher) teacher="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    --dtype) dtype="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    *) echo "export.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$policy" ]]; then
  policy=$($REFIT demo --policy-only --sft-steps "${SFT_STEPS:-150}" -o "$out/models" | tail -n 1)
fi
if [[ -z "$teacher" ]]; then
  teacher="$out/models/teacher"
  [[ -f "$teacher/config.json" ]] || $REFIT build-model small-gpt2 -o "$teacher" >/dev/null
fi
for role in policy teacher; do
  src="${!role}"
  $REFIT export "$src" -o "$out/engines/$role" --dtype "$dtype" --backend "$backend"
done
echo "engines: $out/engines/policy $out/engines/teacher"
