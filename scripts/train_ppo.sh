#!/usr/bin/env bash
# Export the policy, run the PPO-KL cycle with weight pushes into the live engine, print a summary.
# Thin driver over `refit export` and `refit ppo` (under torchrun when --nproc > 1).
#
# usage: scripts/train_ppo.sh [--model DIR] [--config FILE] [-o OUT] [--steps N] [--backend B]
#                             [--workers N] [--ray-address ADDR] [--nproc K] [-- extra refit ppo flags]
#   --model DIR         policy HF folder (default: the embedded warmed-up demo policy, built locally)
#   --config FILE       YAML config for `refit ppo` (fields as in `refit ppo --help`)
#   -o OUT              output root (default: runs/train_ppo): OUT/engine, OUT/run
#   --steps N           PPO iterations (default: 20)
#   --backend B         onnxruntime (default), torch or tensorrt
#   --workers N         rollout engines as Ray actors (default 1: one engine in this process); N > 1 needs
#                       pip install 'refit[dist]', and every Ray node must see OUT/engine at the same path
#   --ray-address ADDR  an existing Ray cluster (`ray start --head` on one node, `ray start --address HEAD:6379`
#                       on the others; 'auto' from a node of it); default $RAY_ADDRESS, else a local Ray instance
#   --nproc K           learner processes: K > 1 runs `torchrun --nproc-per-node K --standalone -m learner.cli
#                       ppo` (DDP, gloo on CPU, NCCL on GPU); more nodes: TORCHRUN_ARGS="--nnodes 2 --node-rank R
#                       --rdzv-backend c10d --rdzv-endpoint HOST:29500" on each node (replaces --standalone)
# With no arguments it runs on the embedded default: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m learner.cli}"
model="" config="" out="runs/train_ppo" steps=20 backend="onnxruntime" workers="" ray_address="" nproc=1 extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --model) model="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --ray-address) ray_address="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
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
[[ -n "$workers" ]] && args+=(--rollout_workers "$workers")  # unset: the config file's value (default 1)
[[ -n "$ray_address" ]] && args+=(--ray_address "$ray_address")
[[ -n "$config" ]] && args=(--config "$config" "${args[@]}")
ppo=($REFIT ppo)
if [[ "$nproc" -gt 1 ]]; then  # DDP learner: rank 0 drives the rollouts, writes metrics and checkpoints
  # shellcheck disable=SC2206  # TORCHRUN_ARGS is a list of flags
  ppo=(${TORCHRUN:-$PY -m torch.distributed.run} --nproc-per-node "$nproc" ${TORCHRUN_ARGS:---standalone}
       -m learner.cli ppo)
fi
summary=$("${ppo[@]}" "${args[@]}" "${extra[@]}" | tail -n 1)
echo "== summary"
echo "$summary"
