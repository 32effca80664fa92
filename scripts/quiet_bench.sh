#!/usr/bin/env bash
# Issue 21's benchmarks on a quiet machine with many cores (e.g. a lent GPU machine): each job pinned (taskset)
# to two physical cores of its own, the jobs side by side, so every figure is a 2-core figure without neighbours.
# Jobs: gen (small-gpt2, 16 prompts x 8, 128 new tokens: engine vs HF generate(), 2 then 1 thread), genold (gen on
# OLD_SRC, another checkout), int8 (GPT-2 small: int8 vs fp32 vs HF vs CTranslate2 int8), ppo (bench ppo
# --max_staleness 1, 2 then 1 thread), prof (ORT's per-node profile of the gen workload, 1 thread), gpu (pytest -m
# gpu). Models and engines are built first, unpinned, a work folder per job; logs and JSON lines go to OUT.
# WHEELS: <name>.tar.xz files for a machine that installs nothing (ort/: an onnxruntime newer than the installed
# one; ct2/: ctranslate2; extra/: pure-Python modules such as tyro, used only where missing).
# Usage: [PYTHON=python3] [OUT=dir] [WORK=dir] [WHEELS=dir] [OLD_SRC=dir] [JOBS="gen int8 ppo prof gpu"] [QUICK=1] bash scripts/quiet_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY="${PYTHON:-python3}"; OUT="${OUT:-runs/quiet_bench}"; WORK="${WORK:-/tmp/refit_quiet_bench}"
JOBS="${JOBS:-gen int8 ppo prof gpu}"; QUICK="${QUICK:-0}"
mkdir -p "$OUT" "$WORK/site"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS

# carried wheels, unpacked (WHEELS/<name>.tar.xz holds <name>/): onnxruntime goes first on the path when the
# installed one is older than it; ctranslate2 only ever on the path of the CTranslate2 side's Python
for f in "${WHEELS:-/nonexistent}"/*.tar.xz; do [[ -f "$f" ]] && tar -C "$WORK/site" -xJf "$f"; done
if [[ -d "$WORK/site/ort/onnxruntime" ]]; then
  have="$("$PY" -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || echo 0)"
  carried="$(PYTHONPATH="$WORK/site/ort" "$PY" -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || echo 0)"
  if [[ "$(printf '%s\n%s\n' "$have" "$carried" | sort -V | tail -1)" != "$have" ]]; then
    export PYTHONPATH="$WORK/site/ort:$PYTHONPATH"; echo "onnxruntime $have installed; using the carried $carried"
  fi
fi
# WHEELS/extra.tar.xz: pure-Python modules (e.g. tyro) for a machine that installs nothing, used only where missing
for d in "$WORK/site/extra"/*/; do
  m="$(basename "$d")"; [[ $m == *.dist-info || $m == __pycache__ ]] && continue
  "$PY" -c "import $m" 2>/dev/null || { export PYTHONPATH="$PYTHONPATH:$WORK/site/extra"; break; }
done
CT2=""
if [[ -d "$WORK/site/ct2/ctranslate2" ]]; then
  CT2="$WORK/ct2python"
  printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$WORK/site/ct2" "$(command -v "$PY")" >"$CT2"
  chmod +x "$CT2"
fi

"$PY" - >"$OUT/machine.json" 2>&1 <<'PY'
import json, os, platform
row = {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg()}
for m in ("torch", "transformers", "onnx", "onnxruntime", "numpy"):
    try:
        row[m] = __import__(m).__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        row[m] = f"missing ({type(e).__name__})"
import torch
row["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        row["cpu"] = line.split(":", 1)[1].strip()
    if line.startswith("flags"):
        row["isa"] = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512_vnni", "avx512_bf16", "amx", "avx_vnni")))
        break
print(json.dumps(row))
PY
cat "$OUT/machine.json"

# two physical cores per job: one logical CPU of each core, cores in order
mapfile -t PAIRS < <("$PY" - <<'PY'
import glob, os
seen, cpus = set(), []
for p in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda s: int(s.rsplit("cpu", 1)[1])):
    cpu = int(p.rsplit("cpu", 1)[1])
    try:
        core = (open(p + "/topology/physical_package_id").read().strip(), open(p + "/topology/core_id").read().strip())
    except OSError:
        core = ("?", str(cpu))
    if core not in seen and cpu in os.sched_getaffinity(0):
        seen.add(core); cpus.append(cpu)
for i in range(0, len(cpus) - 1, 2):
    print(f"{cpus[i]},{cpus[i + 1]}")
PY
)
echo "core pairs (one logical CPU per physical core): ${PAIRS[*]}"

if [[ $QUICK == 1 ]]; then  # plumbing check: tiny settings
  GEN=(--new_tokens 8 --repeats 1); I8=(--batch_sizes 1,8 --new_tokens 8 --repeats 1); PPO=(--response_length 16 --repeats 1)
else
  GEN=(--new_tokens 128 --repeats 3); I8=(--batch_sizes 1,8,32 --new_tokens 64 --repeats 3); PPO=(--response_length 192 --repeats 5)
fi
B="$PY -m refit bench"
gen_cmd()  { $B generate --geometry small-gpt2 --backends onnxruntime --batch_sizes 128 --n 8 --prompt_len 32 --work_dir "$WORK/b-gen" "${GEN[@]}" "$@"; }
int8_cmd() { $B generate --quantize int8 ${CT2:+--ct2_python "$CT2"} --prompt_len 32 --work_dir "$WORK/b-int8" "${I8[@]}" "$@"; }
genold_cmd() { PYTHONPATH="$OLD_SRC:$PYTHONPATH" $B generate --geometry small-gpt2 --backends onnxruntime --batch_sizes 128 \
  --n 8 --prompt_len 32 --work_dir "$WORK/b-genold" "${GEN[@]}" "$@"; }  # OLD_SRC: another checkout, same job
ppo_cmd()  { $B ppo --max_staleness 1 --work_dir "$WORK/b-ppo" "${PPO[@]}" "$@"; }

# 1. build models, engines and the CTranslate2 conversion once, unpinned (a one-token run of each bench)
echo "== build (unpinned)"
pids=()
[[ " $JOBS " == *" gen "* || " $JOBS " == *" prof "* ]] && { gen_cmd --new_tokens 1 --repeats 1 --threads 4 >"$OUT/build_gen.log" 2>&1 & pids+=($!); }
[[ " $JOBS " == *" genold "* ]] && { genold_cmd --new_tokens 1 --repeats 1 --threads 4 >"$OUT/build_genold.log" 2>&1 & pids+=($!); }
[[ " $JOBS " == *" int8 "* ]] && { int8_cmd --batch_sizes 1 --new_tokens 1 --repeats 1 --threads 4 >"$OUT/build_int8.log" 2>&1 & pids+=($!); }
[[ " $JOBS " == *" ppo "* ]] && { ppo_cmd --response_length 2 --repeats 1 --threads 4 >"$OUT/build_ppo.log" 2>&1 & pids+=($!); }
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/build_*.log; do echo "$(basename "$f"): $(tail -1 "$f" | cut -c1-200)"; done
echo "built in $((SECONDS - t0)) s"

# 2. the timed runs, each job on its own pair of physical cores, side by side
run_job() {  # name pair: runs in a subshell pinned to the pair (its children inherit the affinity)
  local name=$1 pair=$2
  taskset -p -c "$pair" "$BASHPID" >/dev/null
  case $name in
    gen)  gen_cmd --threads 2 >"$OUT/gen_t2.log" 2>&1; gen_cmd --threads 1 >"$OUT/gen_t1.log" 2>&1 ;;
    genold) genold_cmd --threads 2 >"$OUT/genold_t2.log" 2>&1; genold_cmd --threads 1 >"$OUT/genold_t1.log" 2>&1 ;;
    int8) int8_cmd --threads 2 >"$OUT/int8_t2.log" 2>&1 ;;
    ppo)  ppo_cmd --threads 2 >"$OUT/ppo_t2.log" 2>&1; ppo_cmd --threads 1 >"$OUT/ppo_t1.log" 2>&1 ;;
    prof) "$PY" scripts/ort_profile.py --engine "$WORK/b-gen/small-gpt2-engine" --threads 1 --label quiet-t1 \
            --out "$OUT/profile-t1" >"$OUT/profile_t1.log" 2>&1
          find "$OUT/profile-t1" -name '*.json' -size +4M -delete ;;  # the raw trace; the table stays
    gpu)  timeout 120 "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_chunked_losses.py \
            tests/test_ppo_update.py tests/test_fused.py >"$OUT/pytest_gpu.log" 2>&1 ;;
  esac
}
echo "== timed runs (pinned), load $(cut -d' ' -f1-3 /proc/loadavg)"
i=0; pids=()
for j in $JOBS; do
  pair="${PAIRS[$i]:-${PAIRS[0]}}"; i=$((i + 1))
  echo "   $j on cpus $pair"
  ( run_job "$j" "$pair" ) & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
for f in "$OUT"/{gen_t2,gen_t1,genold_t2,genold_t1,int8_t2,ppo_t2,ppo_t1,profile_t1,pytest_gpu}.log; do
  [[ -f "$f" ]] && { echo "--- $(basename "$f")"; grep -v '^{' "$f" | tail -12; tail -1 "$f" | cut -c1-3000; }
done
echo "{\"quiet_bench\": {\"jobs\": \"$JOBS\", \"quick\": $QUICK, \"seconds\": $((SECONDS - t0)), \"out\": \"$OUT\"}}"
