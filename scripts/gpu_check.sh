#!/usr/bin/env bash
# GPU / TensorRT check: the CPU-side TensorRT checks, then (only where a CUDA GPU is visible) every
# test marked gpu or tensorrt and a small `refit bench generate` over torch, onnxruntime, tensorrt.
# Ends with one summary line; exits 0 on a machine without a GPU once the CPU checks pass.
# Usage: bash scripts/gpu_check.sh [--help]
# Env: PYTHON (default .venv/bin/python, else python3); GPU_CHECK_BUDGET_S (whole run, default 470);
#      GPU_CHECK_TEST_TIMEOUT_S (default 270); GPU_CHECK_BENCH_ARGS (extra `bench generate` flags).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [[ $# -gt 0 ]]; then echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2; fi

PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
budget="${GPU_CHECK_BUDGET_S:-470}"
test_timeout="${GPU_CHECK_TEST_TIMEOUT_S:-270}"
logs="$(mktemp -d)"
t0=$SECONDS
last_line() { grep -E '[0-9]+ (passed|failed|skipped|error|deselected)' "$1" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//'; }

# 1. CPU checks: engine-folder checks, one-line refusals, the host stand-in of build/refit/backend
echo "== gpu_check 1/3: CPU-side TensorRT checks (tests/test_tensorrt.py, the stand-in rows of tests/test_parity.py)"
if ! "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_tensorrt.py tests/test_parity.py -k tensorrt \
    -m "not gpu and not tensorrt" >"$logs/cpu.log" 2>&1; then
  tail -40 "$logs/cpu.log"
  echo "gpu_check: FAILED cpu_checks=\"$(last_line "$logs/cpu.log")\" seconds=$((SECONDS - t0))"
  exit 1
fi
cpu="$(last_line "$logs/cpu.log")"
echo "   $cpu"

gpu="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null || true)"
if [[ -z "$gpu" ]]; then
  echo "gpu_check: no CUDA GPU on this machine: ran the CPU checks only; cpu_checks=\"$cpu\" seconds=$((SECONDS - t0))"
  exit 0
fi
trt="$("$PY" -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null || echo none)"

# 2. every gpu/tensorrt-marked test (they skip with a reason where TensorRT is missing)
echo "== gpu_check 2/3: pytest -m 'gpu or tensorrt' on $gpu (TensorRT $trt), limit ${test_timeout}s"
set +e
timeout "$test_timeout" "$PY" -m pytest -q -ra -p no:cacheprovider -m "gpu or tensorrt" tests/ >"$logs/gpu.log" 2>&1
test_rc=$?
set -e
tail -25 "$logs/gpu.log"
case $test_rc in
  0) tests="passed" ;; 5) tests="none-collected" ;; 124) tests="timeout" ;; *) tests="failed(rc=$test_rc)" ;;
esac
[[ "$trt" != none ]] || tests="$tests(tensorrt-missing:its-tests-skipped)"

# 3. latency benchmark with small settings, inside what is left of the budget
left=$((budget - (SECONDS - t0)))
bench="skipped(no-time)"
if [[ $left -gt 30 ]] && "$PY" -m refit bench generate --help >"$logs/bench_help.txt" 2>&1; then
  args=()
  grep -qE -- '--max[-_]new[-_]tokens' "$logs/bench_help.txt" && args+=(--max-new-tokens 16)
  grep -qE -- '(^|[ ,])--new[-_]tokens' "$logs/bench_help.txt" && args+=(--new-tokens 16)
  grep -qE -- '--batch[-_]sizes' "$logs/bench_help.txt" && args+=(--batch-sizes 1,8)
  grep -qE -- '--prompt[-_]len' "$logs/bench_help.txt" && args+=(--prompt-len 32)
  grep -q -- '--repeats' "$logs/bench_help.txt" && args+=(--repeats 3)
  grep -q -- '--warmup' "$logs/bench_help.txt" && args+=(--warmup 1)
  # shellcheck disable=SC2206
  extra=(${GPU_CHECK_BENCH_ARGS:-})
  echo "== gpu_check 3/3: bench generate --backends torch,onnxruntime,tensorrt ${args[*]} ${extra[*]}, limit ${left}s"
  set +e
  timeout "$left" "$PY" -m refit bench generate --backends torch,onnxruntime,tensorrt "${args[@]}" "${extra[@]}" \
    >"$logs/bench.log" 2>&1
  bench_rc=$?
  set -e
  tail -5 "$logs/bench.log"
  case $bench_rc in 0) bench="ok" ;; 124) bench="timeout" ;; *) bench="failed(rc=$bench_rc)" ;; esac
elif [[ $left -gt 30 ]]; then
  bench="unavailable(bench generate --help failed)"
fi

status=0
[[ "$tests" == passed* ]] || status=1
[[ "$bench" == "ok" || "$bench" == unavailable* ]] || status=1
echo "gpu_check: gpu=\"$gpu\" tensorrt=$trt cpu_checks=\"$cpu\" gpu_tests=$tests (\"$(last_line "$logs/gpu.log")\") bench=$bench seconds=$((SECONDS - t0)) logs=$logs"
exit $status
