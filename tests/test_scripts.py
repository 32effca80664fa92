"""Smoke-run the shell drivers with tiny settings (they are thin wrappers over `refit`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, *args, timeout=600):
    env = {**os.environ, "REFIT": f"{sys.executable} -m refit", "SFT_STEPS": "10",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("script", ["export.sh", "train_ppo.sh", "setup.sh", "test.sh", "bench_latency.sh",
                                    "distill_batch.sh", "family_table.sh", "cuda_check.sh", "quiet_bench.sh",
                                    "gpu_check.sh"])
def test_help(script):
    r = _run(script, "--help")
    assert r.returncode == 0 and ("usage" in r.stdout.lower() or "install" in r.stdout.lower()), r.stdout + r.stderr


@pytest.mark.slow  # CI's budget: a script's whole default run (the slow suite smoke-runs it); 45 s in CI
def test_export_script_default(tmp_path):
    r = _run("export.sh", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    for role in ("policy", "teacher"):
        m = json.loads((tmp_path / "engines" / role / "manifest.json").read_text())
        assert m["parity"]["max_abs_logprob_diff"] < 1e-4


@pytest.mark.slow  # CI's budget: a script's whole default run (the slow suite smoke-runs it); 22 s in CI
def test_train_ppo_script_default(tmp_path):
    r = _run("train_ppo.sh", "-o", str(tmp_path), "--run.steps", "2", "--run.batch_size", "4", "--num_generations", "2",
             "--advantage_estimator", "gae",
             "--log.no_progress", "--ckpt.save_steps", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["min_exact_kl"] >= 0


@pytest.mark.slow
def test_family_table_script_one_family(tmp_path, monkeypatch):
    """The table script on one family (Marian, the seed's): a row that passed every stage, written into
    a README between the markers, and the JSON record last."""
    monkeypatch.setenv("PYTHON", sys.executable)  # the script's interpreter: this one, not a .venv it looks for
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- families:start -->\nold\n<!-- families:end -->\nafter\n")
    r = _run("family_table.sh", "--only", "Marian", "--readme", str(readme))
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])[0]
    assert rec["export"] == "ok" and rec["parity"] < 1e-4 and rec["trt_check"] == "ok"
    assert abs(rec["ppo"]["kl0"]) <= 1e-6 and rec["ppo"]["min_exact_kl"] >= 0 and abs(rec["distill"]["kl0"]) <= 1e-6
    text = readme.read_text()
    assert "| Marian | sinusoidal" in text and "old" not in text and text.endswith("after\n")


def test_unknown_argument_is_one_line(tmp_path):
    """Flags the script does not own go to `refit ppo`, whose parser refuses an unknown one in one line."""
    r = _run("train_ppo.sh", "--model", str(tmp_path), "-o", str(tmp_path / "out"), "--bogus")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--bogus" in r.stderr, r.stderr


@pytest.mark.slow  # CI's budget: a script's whole default run (the slow suite smoke-runs it); 19 s in CI
def test_bench_latency_script_tiny(tmp_path):
    r = _run("bench_latency.sh", "--batch-sizes", "1", "--geometry", "tiny-gpt2", "--work-dir", str(tmp_path),
             "--new-tokens", "3", "--prompt-len", "4", "--repeats", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "speedup_vs_hf_generate" in json.loads(r.stdout.strip().splitlines()[-1])


def _recording_python(tmp_path) -> Path:
    """A stand-in for python/refit/torchrun that appends its arguments to CALLS and prints a summary line;
    ``-`` (a heredoc script) still runs on the real interpreter."""
    stub = tmp_path / "stub"
    stub.write_text(f"""#!/usr/bin/env bash
if [[ "${{1:-}}" == "-" ]]; then exec {sys.executable} "$@"; fi
echo "$*" >> {tmp_path / 'CALLS'}
echo '{{"run_dir": "x", "steps": 1, "loss": "jsd", "lmbda": 0, "seq_kd": false}}'
""")
    stub.chmod(0o755)
    return stub


def test_scale_flags_pass_through(tmp_path):
    """--workers / --ray-address / --nproc reach `refit ppo` and `refit distill` (under torchrun when K > 1)."""
    stub = _recording_python(tmp_path)
    models = tmp_path / "models"
    for name in ("teacher", "student"):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text("{}")
    env = {**os.environ, "PYTHON": str(stub), "TORCHRUN": f"{stub} TORCHRUN", "REFIT": str(stub)}
    r = subprocess.run(["bash", "scripts/distill_batch.sh", "--configs", "gkd_lmbda1", "--models", str(models),
                        "--out", str(tmp_path / "d"), "--workers", "3", "--ray-address", "HOST:6379", "--nproc", "2"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", "scripts/train_ppo.sh", "--model", str(models / "student"), "-o", str(tmp_path / "p"),
                        "--workers", "2", "--ray-address", "auto", "--nproc", "2"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "CALLS").read_text().splitlines()
    distill = next(c for c in calls if "-m refit distill" in c)
    assert distill.startswith("TORCHRUN --nproc-per-node 2 --standalone -m refit distill")
    assert "--scale.workers 3" in distill and "--scale.ray_address HOST:6379" in distill
    ppo = next(c for c in calls if "-m refit ppo" in c)
    assert ppo.startswith("TORCHRUN --nproc-per-node 2 --standalone -m refit ppo")
    assert "--scale.workers 2" in ppo and "--scale.ray_address auto" in ppo
    r = subprocess.run(["bash", "scripts/distill_batch.sh", "--nproc", "two"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_compare_runs_plots_and_summarises(tmp_path):
    """scripts/compare_runs.py: one PNG, one JSON line with each run's reward over its first/last 5 steps."""
    for name, base in (("a", 0.0), ("b", 0.5)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": s, "reward/mean": base + s / 10, "kl/exact": s / 100, "mismatch/mean_abs_diff": 1e-3}
                for s in range(1, 11)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    r = subprocess.run([sys.executable, "scripts/compare_runs.py", "--out", str(tmp_path / "c.png"),
                        f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (tmp_path / "c.png").stat().st_size > 0
    assert out["runs"]["a"]["reward_first5"] == 0.3 and out["runs"]["b"]["reward_last5"] == 1.3
    assert out["runs"]["a"]["kl_exact_first"] == 0.01 and out["runs"]["a"]["tis_grad_scale_mean"] is None


def test_cuda_check_without_a_gpu_says_so(tmp_path):
    """scripts/cuda_check.sh on a machine without CUDA: the versions, then one JSON line saying why nothing ran."""
    if torch_cuda():
        pytest.skip("a CUDA device is here: the script would run its checks")
    r = subprocess.run(["bash", "scripts/cuda_check.sh"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "w")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"cuda_check": {"skipped": "no CUDA device visible to torch"}}
    assert json.loads((tmp_path / "out" / "versions.json").read_text())["gpu"] is None


def test_gpu_check_without_a_gpu_says_so():
    """scripts/gpu_check.sh on a machine without CUDA: its quick CPU-side checks pass, then one JSON line says no GPU."""
    if torch_cuda():
        pytest.skip("a CUDA device is here: the script would run its probe")
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])["gpu_check"]
    assert last["gpu"] is None and "no CUDA GPU" in last["skipped"] and " passed" in last["cpu_checks"]
    assert "failed" not in last["cpu_checks"]


def test_quiet_bench_pins_each_job_to_its_own_cores(tmp_path):
    """scripts/quiet_bench.sh's plumbing with its quickest job (pytest -m gpu: skips here): the machine record, the
    core pairs, the pinned job's log, one JSON line."""
    r = subprocess.run(["bash", "scripts/quiet_bench.sh"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "w"),
                            "JOBS": "gpu", "QUICK": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["quiet_bench"]["jobs"] == "gpu"
    assert "core pairs (one logical CPU per physical core)" in r.stdout and "gpu on cpus" in r.stdout
    machine = json.loads((tmp_path / "out" / "machine.json").read_text())
    assert machine["cpus"] >= 1 and "onnxruntime" in machine
    assert "passed" in (tmp_path / "out" / "pytest_gpu.log").read_text() or "skipped" in (tmp_path / "out" / "pytest_gpu.log").read_text()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_attention_ab_standard_ops_equal_group_query_attention():
    """scripts/attention_ab.py times ORT's GroupQueryAttention against standard-op attention on the cache the op
    wrote; both must compute the same attention (grouped heads: 4 query heads over 2 KV heads), whatever the
    cache length each reads (exact, chunk-rounded, the whole masked buffer), and so must PyTorch's SDPA over views
    of the same buffers."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "attention_ab.py"), "--rows", "3", "--heads", "4",
                        "--kv_heads", "2", "--head_dim", "8", "--layers", "2", "--contexts", "1,5,16",
                        "--buffer", "16", "--chunk", "4", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["contexts"]) == {"1", "5", "16"}
    for T, row in out["contexts"].items():
        assert row["lengths"] == {"matmul_exact": int(T), "matmul_chunk": min(16, -(-int(T) // 4) * 4),
                                  "matmul_buffer": 16}
        assert max(row["max_abs_diff_vs_gqa"].values()) < 1e-5, row
        assert set(row["ms"]) == {"gqa", "matmul_exact", "matmul_chunk", "matmul_buffer", "torch_sdpa", "read_only"}
        assert all(ms > 0 for ms in row["ms"].values())
