#!/usr/bin/env bash
# Export the policy, run the PPO-KL cycle with weight pushes into the live engine, print a summary.
# Thin driver over `refit export` and `refit ppo`.
#
# usage: scripts/train_ppo.sh [--model DIR] [--config FILE] [-o OUT] [--steps N] [--backend B] [-- extra refit ppo flags]
#   --model DIR     policy HF folder (default: the embedded warmed-up demo policy, built locally)
#   --config FILE   YAML config for `refit ppo` (fields as in `refit ppo --help`)
#   -o OUT          output root (default: runs/train_ppo): OUT/engine, OUT/run
#   --steps N       PPO iterations (default: 20)
#   --backend B     onnxruntime (default), torch or tensorrt
# With no arguments it runs on the embedded default: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
REFIT="${REFIT:-python -m learner.cli}"
model="" config="" out="runs/train_ppo" steps=20 backend="onnxruntime" extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --model) model="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "train_ppo.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$model" ]]; then
  model=$($REFIT demo --policy-only --sft-steps "${SFT_STEPS:-150}" -o "$out/models" | tail -n 1)
fi
echo "== export"
$REFIT export "$model" -o "$out/engine"
echo "== train"
args=(--model_dir "$model" --engine_dir "$out/engine" --output_dir "$out/run" --steps "$steps" --backend "$backend")
[[ -n "$config" ]] && args=(--config "$config" "${args[@]}")
summary=$($REFIT ppo "${args[@]}" "${extra[@]}" | tail -n 1)
echo "== summary"
echo "$summary"
