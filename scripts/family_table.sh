#!/usr/bin/env bash
# The model-family table (docs/families.md) from real runs (thin wrapper over `python -m refit.bench.families`): for each
# family (GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, Phi, OPT, T5, BART, Marian) build a tiny checkpoint,
# export it (parity gate), run refit.rollout.tensorrt.check, 2 PPO steps and 2 distillation steps; print the table.
#
# --set real: the published geometries instead (Llama 3.2 1B ... opus-mt-en-de at real widths and vocab,
# 2 layers; refit.learner.builtin.published), one process each, with a weight-push check, export seconds and peak RSS.
#
# usage: scripts/family_table.sh [--set tiny|real] [--only NAME ...] [--readme FILE] [--work-dir DIR]
#   --only NAME ...  families (table names or tiny-* geometries) to run (default: all, ~5 min on 2 cores)
#   --readme FILE    also replace the table between FILE's <!-- families:start/end --> markers
#                    (--set real: <!-- real-geometry:start/end -->)
#   --work-dir DIR   keep checkpoints, engines and runs there (default: a temporary folder)
#   --rss-cap-gb G   --set real: stop a geometry whose processes pass G GB resident (default 16)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
case "${1:-}" in
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
exec $PY -m refit.bench.families "$@"
