#!/usr/bin/env bash
# Export policy and teacher engine folders from HF checkpoint folders (thin driver over `refit export`).
#
# usage: scripts/export.sh [--policy DIR] [--teacher DIR] [-o OUT] [refit export flags, e.g. --dtype fp16]
#   --policy DIR    policy HF folder (default: build the embedded warmed-up demo policy into OUT/models/policy)
#   --teacher DIR   teacher HF folder (default: build a larger local model into OUT/models/teacher)
#   -o OUT          output root (default: runs/export); engines go to OUT/engines/{policy,teacher}
#   other flags go to both `refit export` calls (--dtype, --backend, --max_batch, ...: refit export --help)
# With no arguments it runs on the embedded default: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m refit}"
policy="" teacher="" out="runs/export" pass=()
while [[ $# -gt 0 ]]; do  # only the script's own flags; the rest goes to `refit export` as given
  case "$1" in
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --policy) policy="$2"; shift 2 ;;
    --teacher) teacher="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    *) pass+=("$1"); shift ;;
  esac
done
if [[ -z "$policy" ]]; then
  policy=$($REFIT demo --policy_only --sft_steps "${SFT_STEPS:-150}" -o "$out/models" | tail -n 1)
fi
if [[ -z "$teacher" ]]; then
  teacher="$out/models/teacher"
  [[ -f "$teacher/config.json" ]] || $REFIT build-model small-gpt2 -o "$teacher" >/dev/null
fi
for role in policy teacher; do
  $REFIT export "${!role}" -o "$out/engines/$role" "${pass[@]}"
done
echo "engines: $out/engines/policy $out/engines/teacher"
