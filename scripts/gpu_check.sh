#!/usr/bin/env bash
# GPU / TensorRT check: CPU-side checks of the GPU path that need no export (GPU_CHECK_CPU=full: all of
# tests/test_tensorrt_gpu_path.py and the stand-in rows of tests/test_tensorrt.py), then, only where torch sees a CUDA
# device, scripts/gpu_probe.py: one JSON line per check. Without a GPU: one line says so, exit 0 once the CPU checks
# pass. GPU_CHECK_TESTS=1 adds pytest -m 'gpu or tensorrt'; GPU_CHECK_PROBE_S limits the probe (default 300 s).
# Usage: bash scripts/gpu_check.sh [--help]   Env: PYTHON (default .venv/bin/python, else python3), GPU_CHECK_WORK
#        (the probe's folder), GPU_CHECK_CPU (quick/full), GPU_CHECK_TESTS (0/1), GPU_CHECK_PROBE_S.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [[ $# -gt 0 ]]; then echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2; fi

PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"  # the venv setup.sh made, if any
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
logs="$(mktemp -d)"
t0=$SECONDS
last_line() { grep -E '[0-9]+ (passed|failed|skipped|error|deselected)' "$1" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//'; }

# 1. CPU: the GPU path's defects (issue 45) that need no export: addresses, dtype tables, providers, CUDA majors,
#    the gpu extras, the parser's op table; GPU_CHECK_CPU=full: every stand-in build/refit/push check (exports: minutes)
if [[ "${GPU_CHECK_CPU:-quick}" == full ]]; then
  sel=(tests/test_tensorrt_gpu_path.py tests/test_tensorrt.py tests/test_package.py -k "not wheel and not import_from")
else
  sel=(tests/test_tensorrt_gpu_path.py tests/test_tensorrt.py tests/test_package.py
       -k "aligned_copies or bf16 or default_providers or cuda_major or gpu_extras or check_ops")
fi
echo "== gpu_check 1/2: CPU-side checks (${GPU_CHECK_CPU:-quick}: ${sel[*]})"
if ! "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu and not tensorrt and not slow" "${sel[@]}" \
    >"$logs/cpu.log" 2>&1; then
  tail -40 "$logs/cpu.log"
  echo "{\"gpu_check\": {\"ok\": false, \"cpu_checks\": \"$(last_line "$logs/cpu.log")\", \"seconds\": $((SECONDS - t0)), \"logs\": \"$logs\"}}"
  exit 1
fi
cpu="$(last_line "$logs/cpu.log")"
echo "   $cpu"

gpu="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null || true)"
if [[ -z "$gpu" ]]; then
  echo "{\"gpu_check\": {\"gpu\": null, \"skipped\": \"no CUDA GPU visible to torch: ran the CPU-side checks only\", \"cpu_checks\": \"$cpu\", \"seconds\": $((SECONDS - t0))}}"
  exit 0
fi

# 2. the probe: one JSON line per check; then, on request, every gpu/tensorrt-marked test
echo "== gpu_check 2/2: scripts/gpu_probe.py on $gpu, limit ${GPU_CHECK_PROBE_S:-300}s"
set +e
timeout "${GPU_CHECK_PROBE_S:-300}" "$PY" scripts/gpu_probe.py ${GPU_CHECK_WORK:+--work "$GPU_CHECK_WORK"} \
  2>"$logs/probe.err" | tee "$logs/probe.jsonl"
probe_rc=${PIPESTATUS[0]}
tests="not-run"
if [[ "${GPU_CHECK_TESTS:-0}" == 1 ]]; then
  timeout 270 "$PY" -m pytest -q -ra -p no:cacheprovider -m "gpu or tensorrt" tests/ >"$logs/gpu.log" 2>&1
  tests="rc=$? $(last_line "$logs/gpu.log")"
fi
set -e
[[ $probe_rc == 0 ]] || tail -5 "$logs/probe.err"
echo "{\"gpu_check\": {\"gpu\": \"$gpu\", \"cpu_checks\": \"$cpu\", \"probe_rc\": $probe_rc, \"gpu_tests\": \"$tests\", \"seconds\": $((SECONDS - t0)), \"logs\": \"$logs\"}}"
[[ $probe_rc == 0 ]]
