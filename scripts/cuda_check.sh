#!/usr/bin/env bash
# CUDA learner check on a GPU machine without TensorRT (e.g. PyTorch + onnxruntime-CPU preinstalled): the
# tests marked gpu, one learner score + update at vocab 152k on CUDA (time and peak CUDA memory; with
# OLD_SRC=<checkout> the same step of that checkout too), and `refit demo` with its learner on CUDA.
# Runs from the source tree (PYTHONPATH=.); logs under OUT (default runs/cuda_check), models and run folders
# under WORK (default /tmp/refit_cuda_check); ends with one JSON line.
# Usage: [PYTHON=python3] [OUT=dir] [WORK=dir] [OLD_SRC=dir] [EXTRA_SITE=dir] [STEPS=123] bash scripts/cuda_check.sh [--help]
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY="${PYTHON:-python3}"
OUT="${OUT:-runs/cuda_check}"; WORK="${WORK:-/tmp/refit_cuda_check}"; mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
# a machine that installs nothing: EXTRA_SITE/<module>/ holds pure-Python wheels unpacked (the module and its
# own dependencies), added to the path only where <module> does not import already
for d in "${EXTRA_SITE:-/nonexistent}"/*/; do
  [[ -d "$d" ]] || continue
  "$PY" -c "import $(basename "$d")" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$(realpath "$d")"
done
t0=$SECONDS
"$PY" - >"$OUT/versions.json" 2>&1 <<'PY'
import json, platform, torch
row = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for m in ("transformers", "onnx", "onnxruntime", "onnxscript", "tyro", "pytest", "matplotlib", "tensorboard"):
    try:
        row[m] = __import__(m).__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        row[m] = f"missing ({type(e).__name__})"
print(json.dumps(row))
PY
cat "$OUT/versions.json"
if grep -q '"gpu": null' "$OUT/versions.json" || ! grep -q '"gpu"' "$OUT/versions.json"; then
  echo '{"cuda_check": {"skipped": "no CUDA device visible to torch"}}'
  exit 0
fi
summ() { grep -E '[0-9]+ (passed|failed|skipped|error)' "$1" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//; s/"/'"'"'/g'; }

STEPS="${STEPS:-123}"; pytest_rc=-1; mem_rc=-1; demo_rc=-1; : >"$OUT/pytest_gpu.log"
if [[ $STEPS == *1* ]]; then
echo "== 1/3 pytest -m gpu (the learner's CUDA tests; TensorRT ones skip with a reason)"
timeout 120 "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_chunked_losses.py tests/test_ppo_update.py \
  tests/test_fused.py >"$OUT/pytest_gpu.log" 2>&1; pytest_rc=$?
tail -15 "$OUT/pytest_gpu.log"
fi

if [[ $STEPS == *2* ]]; then
echo "== 2/3 one learner score + update at vocab 151936 (Qwen2.5-0.5B widths, 2 layers) on CUDA"
sources=(--source .); [[ -n "${OLD_SRC:-}" ]] && sources=(--source "$OLD_SRC" --source .)
timeout 150 "$PY" -m refit.bench.ppo_memory --work "$WORK/ppo_memory" --learner-only --device cuda "${sources[@]}" \
  >"$OUT/ppo_memory_cuda.log" 2>&1; mem_rc=$?
tail -1 "$OUT/ppo_memory_cuda.log"
fi

if [[ $STEPS == *3* ]]; then
echo "== 3/3 refit demo, learner on CUDA (run.device auto), rollouts on the onnxruntime CPU engine"
timeout 170 "$PY" -m refit demo --out "$WORK/demo" --no_progress >"$OUT/demo.log" 2>&1; demo_rc=$?
cp "$WORK"/demo/ppo/metrics.jsonl "$WORK"/demo/ppo/curves.png "$OUT/" 2>/dev/null
tail -6 "$OUT/demo.log"
fi
echo "{\"cuda_check\": {\"pytest_rc\": $pytest_rc, \"pytest\": \"$(summ "$OUT/pytest_gpu.log")\", \"ppo_memory_cuda_rc\": $mem_rc, \"demo_rc\": $demo_rc, \"seconds\": $((SECONDS - t0))}}"
