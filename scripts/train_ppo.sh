#!/usr/bin/env bash
# Run the PPO-KL cycle (engine exported or reused in OUT/engine, weight pushes into the live engine), print a
# summary. Thin driver over `refit ppo` (under torchrun when --nproc > 1).
#
# usage: scripts/train_ppo.sh [--model DIR] [-o OUT] [--nproc K] [--workers N] [--ray-address ADDR] [refit ppo flags]
#   --model DIR         policy HF folder (default: the embedded warmed-up demo policy, built locally)
#   -o OUT              output root (default: runs/train_ppo): OUT/engine, OUT/run
#   --nproc K           learner processes: K > 1 runs `torchrun --nproc-per-node K --standalone -m refit
#                       ppo` (DDP, gloo on CPU, NCCL on GPU); more nodes: TORCHRUN_ARGS="--nnodes 2 --node-rank R
#                       --rdzv-backend c10d --rdzv-endpoint HOST:29500" on each node (replaces --standalone)
#   --workers N         = --scale.workers N: rollout engines as Ray actors (default 1: one engine in this process);
#                       N > 1 needs pip install 'refit[dist]', and every Ray node must see OUT/engine at the same path
#   --ray-address ADDR  = --scale.ray_address ADDR: an existing Ray cluster (`ray start --head` on one node,
#                       `ray start --address HEAD:6379` on the others; 'auto' from a node of it); default
#                       $RAY_ADDRESS, else a local Ray instance
#   other flags go to `refit ppo` as given: --config FILE, --run.steps N, --rollout.backend B, ... (refit ppo --help)
# With no arguments it runs on the embedded default: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
REFIT="${REFIT:-$PY -m refit}"
model="" out="runs/train_ppo" nproc=1 pass=()
while [[ $# -gt 0 ]]; do  # only the script's own flags; the rest goes to `refit ppo` as given
  case "$1" in
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --model) model="$2"; shift 2 ;;
    -o|--out) out="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --workers) pass+=(--scale.workers "$2"); shift 2 ;;
    --ray-address) pass+=(--scale.ray_address "$2"); shift 2 ;;
    --) shift ;;
    *) pass+=("$1"); shift ;;
  esac
done
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "train_ppo.sh: --nproc must be a positive integer, got $nproc" >&2; exit 2; }
if [[ -z "$model" ]]; then
  model=$($REFIT demo --policy_only --sft_steps "${SFT_STEPS:-150}" -o "$out/models" | tail -n 1)
fi
ppo=($REFIT ppo)
if [[ "$nproc" -gt 1 ]]; then  # DDP learner: rank 0 drives the rollouts, writes metrics and checkpoints
  # shellcheck disable=SC2206  # TORCHRUN_ARGS is a list of flags
  ppo=(${TORCHRUN:-$PY -m torch.distributed.run} --nproc-per-node "$nproc" ${TORCHRUN_ARGS:---standalone}
       -m refit ppo)
fi
echo "== train"
summary=$("${ppo[@]}" --model.model_dir "$model" --model.engine_dir "$out/engine" -o "$out/run" "${pass[@]}" | tail -n 1)
echo "== summary"
echo "$summary"
