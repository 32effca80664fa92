#!/usr/bin/env bash
# Distil one teacher into one student under several configs; write results.json + results.md to --out.
# Usage: bash scripts/distill_batch.sh [--out DIR] [--configs "NAME ..."] [--models DIR] [--workers N]
#                                      [--ray-address ADDR] [--nproc K] [refit distill flags...]
#   default set: supervised_kd seq_kd_ce gkd_lmbda0 gkd_lmbda0.5 gkd_lmbda1 (same prompts, teacher, student)
#   --models DIR: reuse DIR/{teacher,student}[_engine] (as `refit distill --build_models DIR` writes them, or a
#   default run's OUTPUT_DIR/models) instead of building; every other flag goes to every `refit distill` call
#   (and to the one-time build) as given, e.g. --run.steps 50 --teacher_sft_steps 50 (refit distill --help)
#   --workers N         = --scale.workers N: engines per model as Ray actors (N teacher + N student engines;
#                       default 1: in-process);
#                       N > 1 needs pip install 'refit[dist]'; every Ray node must see the engine folders
#                       (--models DIR, or OUT/models) at the same path
#   --ray-address ADDR  = --scale.ray_address ADDR: an existing Ray cluster (`ray start --head` on one node, `ray start --address HEAD:6379`
#                       on the others; 'auto' from a node of it); default $RAY_ADDRESS, else each run starts
#                       and stops a local Ray instance of its own
#   --nproc K           learner processes: K > 1 runs each config under `torchrun --nproc-per-node K` (DDP, gloo
#                       on CPU, NCCL on GPU; batch_size divisible by K x gradient_accumulation_steps); more
#                       nodes: TORCHRUN_ARGS="--nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29500"
#
# A thin driver over `python -m refit distill`: the embedded teacher (SFT, 4x128) and student (2x64)
# and their engines are built ONCE (`refit distill --build_models DIR`), then each config runs in its own
# process and folder (OUT/NAME, stdout OUT/NAME.log, stderr OUT/NAME.err); the table is read from each
# run's last stdout line.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }

declare -A FLAGS=(
  [supervised_kd]="--lmbda 0 --loss topk_kl"              # dataset completions, teacher engine top-k, forward KL
  [seq_kd_ce]="--seq_kd --lmbda 0 --loss ce"               # teacher engine generates; CE on its tokens, one pass
  [gkd_lmbda0]="--lmbda 0 --loss jsd --beta 0.5"          # GKD, generalized JSD, full vocab (PyTorch teacher)
  [gkd_lmbda0.5]="--lmbda 0.5 --loss jsd --beta 0.5"
  [gkd_lmbda1]="--lmbda 1 --loss jsd --beta 0.5"          # fully on-policy: the student engine generates
)
CONFIGS="supervised_kd seq_kd_ce gkd_lmbda0 gkd_lmbda0.5 gkd_lmbda1"
OUT="runs/distill_batch"
MODELS=""
EXTRA=()  # flags for every `refit distill` call
NPROC=1
while [[ $# -gt 0 ]]; do  # only the script's own flags; the rest goes to `refit distill` as given
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) OUT="$2"; shift 2 ;;
    --configs) CONFIGS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --workers) EXTRA+=(--scale.workers "$2"); shift 2 ;;
    --ray-address) EXTRA+=(--scale.ray_address "$2"); shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --) shift ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
for name in $CONFIGS; do
  [[ -n "${FLAGS[$name]+x}" ]] || { echo "distill_batch.sh: unknown config $name; known: ${!FLAGS[*]}" >&2; exit 2; }
done

[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "distill_batch.sh: --nproc must be a positive integer, got $NPROC" >&2; exit 2; }

PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
distill=("$PY" -m refit distill)
if [[ "$NPROC" -gt 1 ]]; then  # DDP learner: rank 0 drives the engines, writes metrics and checkpoints
  # shellcheck disable=SC2206  # TORCHRUN and TORCHRUN_ARGS are word lists
  distill=(${TORCHRUN:-"$PY" -m torch.distributed.run} --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:---standalone}
           -m refit distill)
fi

if [[ -z "$MODELS" ]]; then
  MODELS="$OUT/models"
  echo "== building teacher and student once: $MODELS"
  "$PY" -m refit distill --build_models "$MODELS" "${EXTRA[@]}" > "$OUT/models.log" 2>&1 \
    || { tail -n 20 "$OUT/models.log" >&2; exit 1; }
fi
model_flags=()
for name in teacher student; do
  [[ -f "$MODELS/$name/config.json" ]] || { echo "distill_batch.sh: no model in $MODELS/$name" >&2; exit 2; }
  model_flags+=("--$name.model_dir" "$MODELS/$name" "--$name.engine_dir" "$MODELS/${name}_engine")
done

for name in $CONFIGS; do
  echo "== $name: ${FLAGS[$name]}"
  # shellcheck disable=SC2086  # FLAGS values are word lists on purpose
  "${distill[@]}" -o "$OUT/$name" "${model_flags[@]}" ${FLAGS[$name]} --log.no_progress "${EXTRA[@]}" > "$OUT/$name.log" 2> "$OUT/$name.err" \
    || { echo "run $name failed:" >&2; tail -n 20 "$OUT/$name.err" >&2; exit 1; }
  tail -n 2 "$OUT/$name.log" | head -n 1
done

"$PY" - "$OUT" $CONFIGS <<'EOF'
"""Results table: each run's last stdout line (one JSON document) -> results.json and results.md."""
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
runs = []
for name in names:
    s = json.loads((out / f"{name}.log").read_text().strip().splitlines()[-1])
    runs.append({"name": name, **s})
(out / "results.json").write_text(json.dumps({"runs": runs}, indent=1))
fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
lines = ["| config | loss | lmbda | seq_kd | held-out KL to teacher (start -> end) | accuracy (start -> end, teacher) "
         "| student tokens/s | teacher passes / batch | wall s |", "|" + "---|" * 9]
for r in runs:
    lines.append(f"| {r['name']} | {r['loss']} | {r['lmbda']:g} | {str(r['seq_kd']).lower()} "
                 f"| {fmt(r.get('kl_start'), '.4f')} -> {fmt(r.get('kl_end'), '.4f')} "
                 f"| {fmt(r.get('accuracy_start'), '.3f')} -> {fmt(r.get('accuracy_end'), '.3f')}, "
                 f"{fmt(r.get('teacher_accuracy'), '.3f')} | {fmt(r.get('student_tokens_per_s'), '.0f')} "
                 f"| {fmt(r.get('teacher_passes_per_batch'), '.2f')} | {fmt(r.get('wall_s'), '.1f')} |")
text = "\n".join(lines) + "\n"
(out / "results.md").write_text(text)
print(text, end="")
print(f"tables: {out / 'results.json'}, {out / 'results.md'}")
EOF
