"""TRL at its best on this machine, before ``refit bench grpo --vs trl`` times it against Refit.

A careful user does not time TRL at its defaults alone: gradient checkpointing (TRL's default) trades compute for
memory, and one micro-batch of every row of a step may not fit. :func:`best_trl_config` runs TRL's side for
``--trial_steps`` steps under each candidate below (fields of ``GRPOConfig`` over the bench's aligned ones), each
in a fresh process watched for memory, and keeps the fastest that finished; the bench's rounds then run TRL with
it, Refit at its own defaults. Every candidate tried is reported with its seconds a step and peak memory.

    ckpt-on            gradient_checkpointing=True, one micro-batch of all P x G rows (TRL's default)
    ckpt-off           gradient_checkpointing=False, one micro-batch
    ckpt-off-mb16      gradient_checkpointing=False, micro-batches of 16 rows, gradient_accumulation_steps P x G / 16
                       (steps_per_generation follows it, so one generation of P x G rows per optimizer step still)
    ckpt-on-mb16       the same with checkpointing on
    bf16               TRL's default bf16=True (autocast) over the fastest fp32 candidate (fp32 learners only)

A candidate whose process passes ``memory_gb`` (its resident set, polled every half second) is stopped and reported
as "over memory", as one killed by the kernel is; the machine is never taken to its limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from refit.core.errors import RefitError

MICRO_ROWS = 16  # the micro-batch a user tries when one micro-batch of every row is slow or does not fit


def candidates(rows: int, fp32: bool) -> list[tuple[str, dict]]:
    """(name, GRPOConfig fields) of the fp32 candidates for a step of ``rows`` rows (bf16 is added after them)."""
    out = [("ckpt-on", {"gradient_checkpointing": True}), ("ckpt-off", {"gradient_checkpointing": False})]
    if rows > MICRO_ROWS and rows % MICRO_ROWS == 0:
        acc = {"per_device_train_batch_size": MICRO_ROWS, "gradient_accumulation_steps": rows // MICRO_ROWS}
        out += [(f"ckpt-off-mb{MICRO_ROWS}", {"gradient_checkpointing": False, **acc}),
                (f"ckpt-on-mb{MICRO_ROWS}", {"gradient_checkpointing": True, **acc})]
    return out


def status_gb(pid: int, field: str) -> float:
    """A memory figure of process ``pid`` from ``/proc/PID/status`` (``VmRSS``, ``RssAnon``, ...), GB; 0 when it is
    gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run_capped(cmd: list[str], log_file: Path, env: dict, memory_gb: float) -> tuple[str, float, float]:
    """Run ``cmd`` (output to ``log_file``), stopped when its resident set passes ``memory_gb``;
    (status "ok" | "over memory" | "failed (exit N)", wall seconds, peak RSS GB from ``os.wait4``)."""
    t0, over = time.perf_counter(), False
    with open(log_file, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if status_gb(proc.pid, "VmRSS") > memory_gb:
                over = True
                proc.send_signal(signal.SIGKILL)
            time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    wall, rss = time.perf_counter() - t0, usage.ru_maxrss / 2**20
    if over or proc.returncode in (-signal.SIGKILL, 137):  # ours, or the kernel's OOM killer
        return "over memory", wall, rss
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), wall, rss


def _steady(side_json: Path) -> float:
    """The median seconds a step over every step but the first (the warm-up) of a TRL side's JSON."""
    rows = json.loads(side_json.read_text())["rows"]
    xs = sorted(r["step_s"] for r in rows[1:] or rows)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def best_trl_config(command, rows: int, fp32: bool, trials_dir: Path, env: dict, memory_gb: float,
                    log=print) -> tuple[dict, list[dict]]:
    """Try each candidate (``command(name, fields) -> argv``, its side JSON at ``trials_dir/NAME/side.json``); return
    (the fastest finished candidate's fields, every trial's record)."""
    tried: list[dict] = []

    def trial(name: str, fields: dict) -> None:
        out = trials_dir / name
        out.mkdir(parents=True, exist_ok=True)
        status, wall, rss = run_capped(command(name, fields), trials_dir / f"{name}.log", env, memory_gb)
        step = round(_steady(out / "side.json"), 4) if status == "ok" else None
        tried.append({"name": name, "fields": fields, "status": status, "step_s": step, "peak_rss_gb": round(rss, 3),
                      "wall_s": round(wall, 1)})
        log(f"trl trial {name:<14} {status:<12} step {step if step is not None else '-'} s, peak RSS {rss:.2f} GB")

    for name, fields in candidates(rows, fp32):
        trial(name, fields)
    done = [t for t in tried if t["status"] == "ok"]
    if not done:
        what = ", ".join(f"{t['name']}: {t['status']}" for t in tried)
        raise RefitError(f"no TRL configuration finished within {memory_gb:.1f} GB ({what}); see {trials_dir}")
    if fp32:  # TRL's default bf16 autocast over the fastest fp32 setting
        best = min(done, key=lambda t: t["step_s"])
        trial("bf16", {**best["fields"], "bf16": True})
        done = [t for t in tried if t["status"] == "ok"]
    best = min(done, key=lambda t: t["step_s"])
    log(f"trl: fastest within {memory_gb:.1f} GB: {best['name']} ({best['step_s']} s a step)")
    return best["fields"], tried


def memory_limit_gb(fraction: float = 0.9) -> float:
    """``fraction`` of the memory available now (``MemAvailable``), in GB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return fraction * int(line.split()[1]) / 2**20
    return float("inf")
