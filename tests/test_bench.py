"""Benchmarks: smoke-run each with tiny settings (numbers are for the bench scripts, never asserted).

The HF ``generate()`` baseline's parity with the reference is in the matrix (tests/test_parity.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest


def _bench(tmp_path, *args, geometry: str = "tiny-gpt2"):
    r = subprocess.run([sys.executable, "-m", "refit", "bench", *args, "--geometry", geometry,
                        "--work-dir", str(tmp_path), "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_generate_json(tmp_path):
    out = _bench(tmp_path, "generate", "--batch-sizes", "1,2", "--new-tokens", "4", "--prompt-len", "8")
    backends = {(r["backend"], r["batch"]) for r in out["results"]}
    assert backends == {(b, n) for b in ("hf_generate", "torch", "onnxruntime", "onnxruntime-plain") for n in (1, 2)}
    assert out["onnxruntime_attention"] == "fused" and out["matmul_limit"]["2"]["matmul_gflops"] > 0
    for r in out["results"]:  # phase times from the engines' on_step hook (HF: its HFStepClock)
        assert r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["decode_ms_p95"] >= r["decode_ms_p50"] > 0
        assert r["ttft_ms"] < 1e3 * r["call_s"], "the first token comes before the call ends"
        assert r["matmul_fraction"] > 0 and r["floor_fraction"] > 0
    lim = out["matmul_limit"]["2"]
    assert lim["read_gbps"] > 0 and lim["floor_ms"] > 0 and lim["hf_decode_over_floor"] > 0
    assert lim["kv_mb_per_step_shared_prefix"] == lim["kv_mb_per_step"]  # n = 1: no prefix shared
    assert set(out["speedup_vs_hf_generate"]["onnxruntime"]) == {"1", "2"}


def test_decode_step_kv_bytes_and_floor_by_hand():
    """The roofline floor's inputs, against a hand count: Llama-like GQA geometry (8 KV heads x 64), 2 layers."""
    from types import SimpleNamespace

    from refit.bench.generate import decode_step_kv_bytes, step_floor

    dims = SimpleNamespace(n_layers=2, n_kv_heads=8, head_dim=64)
    per_pos = 2 * 2 * 8 * 64 * 4  # K and V x layers x heads x dim x fp32 bytes = 8192
    assert decode_step_kv_bytes(dims, batch=16, context=100) == 16 * 100 * per_pos
    # 16 rows = 2 prompts x 8 samples; their 30 prompt positions read once per prompt
    assert decode_step_kv_bytes(dims, 16, 100, shared_prefix=30, n=8) == (16 * 70 + 2 * 30) * per_pos
    assert decode_step_kv_bytes(dims, 16, 100, itemsize=2) == 16 * 100 * per_pos // 2
    # 0.2 GFLOP at 100 GFLOP/s = 2 ms; 30 MB at 15 GB/s = 2 ms
    assert step_floor(0.2, 100.0, 30_000_000, 15.0) == pytest.approx(4.0)


@pytest.mark.slow  # 28 s; the decoder bench (test_bench_generate_json) stays in CI
def test_bench_generate_encoder_decoder(tmp_path):
    """T5: HF generate() on the encoder's native (right) padding, its clock from the decoder's start token; with
    --shards 2 the engine also runs as onnxruntime-shards2 in the same rounds."""
    out = _bench(tmp_path, "generate", "--batch-sizes", "2", "--new-tokens", "4", "--prompt-len", "8",
                 "--backends", "onnxruntime", "--shards", "2", geometry="tiny-t5")
    assert {r["backend"] for r in out["results"]} == {"hf_generate", "onnxruntime", "onnxruntime-shards2"}
    assert out["shards"] == 2 and set(out["hf_call_s_over_engine_call_s"]["onnxruntime-shards2"]) == {"2"}
    assert all(r["ttft_ms"] > 0 and r["decode_ms_p50"] > 0 for r in out["results"])
    assert out["onnxruntime_attention"] == "fused"


@pytest.mark.slow  # CI's budget (22 s in CI); bench generate and bench ppo stay in the fast suite
def test_bench_generate_quantized_json(tmp_path):
    """--quantize int8: the int8 engine vs the fp32 engine vs HF generate(), the log-prob gap, the push times."""
    out = _bench(tmp_path, "generate", "--batch-sizes", "1,2", "--new-tokens", "4", "--prompt-len", "8",
                 "--quantize", "int8")
    assert {(r["backend"], r["batch"]) for r in out["results"]} == {
        (b, n) for b in ("hf_generate", "fp32", "int8") for n in (1, 2)}
    assert set(out["int8_over_fp32"]) == {"1", "2"} and all(v > 0 for v in out["int8_over_fp32"].values())
    gap = out["logprob_gap_sampled"]
    assert gap["tokens"] > 0 and gap["max_abs"] >= gap["p99_abs"] >= 0 and out["logprob_gap_export"]["max_abs_logprob"] > 0
    assert out["update_weights_s"]["int8"] > 0 and out["update_weights_s"]["fp32"] > 0
    for name, ph in out["update_weights_phases_s"].items():  # map, re-quantize, session re-open, held-set copy
        assert set(ph) == {"map", "quantize", "open", "copy"} and ph["open"] > 0, (name, ph)
    check = out["int8_push_check"]  # a perturbed push moved the int8 engine onto the quantize-dequantize reference
    assert check["took"] and check["moved_max_abs"] > check["gate_tolerance"] >= check["vs_reference_max_abs"], check
    assert "error" in out["ctranslate2_int8"]  # not asked for


def test_bench_refit_json(tmp_path, model_dirs, default_engine_dirs):
    """Issue 43 #3: an engine folder the user names (exported with other options than the bench's) is used as it
    is, never exported over, and the bench's re-export leaves nothing in the work folder."""
    import shutil

    engine = tmp_path / "mine"
    shutil.copytree(default_engine_dirs["tiny-gpt2"], engine)
    before = {p.name: p.read_bytes() for p in engine.iterdir() if p.is_file()}
    out = _bench(tmp_path / "w", "refit", "--model", str(model_dirs["tiny-gpt2"]), "--engine", str(engine))
    assert out["update_weights_s"] > 0 and out["reexport_s"] > 0 and out["ratio_reexport_over_update"] > 0
    assert {p.name: p.read_bytes() for p in engine.iterdir() if p.is_file()} == before
    assert not [p for p in (tmp_path / "w").iterdir() if "reexport" in p.name and not p.name.endswith(".lock")]


def test_bench_ppo_json(tmp_path):
    out = _bench(tmp_path, "ppo", "--batch-size", "4", "--response-length", "4")
    assert out["speedup"] > 0 and set(out["phases_s"]) == {"onnxruntime", "hf"}
    assert len(out["speedup_per_iteration"]) == out["repeats"] and min(out["speedup_per_iteration"]) > 0
    assert set(out["phases_s"]["hf"]) >= {"time/rollout", "time/score", "time/update", "time/weight_push"}
    assert out["ref_backend"] == {"onnxruntime": "onnxruntime", "hf": "torch"} and out["engine_attention"] == "fused"
    assert out["learner"] == {"single_pass": True, "probe_on_rollout": True}
    assert 0 < out["push_share_of_step"] < 1


def test_bench_ppo_grpo_with_shards_json(tmp_path):
    """--num_generations 4: GRPO steps (2 prompts x 4 samples); --engine_shards 2: the engine run decodes in two
    shards (HF's run is unchanged); both recorded in the JSON."""
    out = _bench(tmp_path, "ppo", "--batch-size", "2", "--response-length", "4", "--num-generations", "4",
                 "--engine-shards", "2")
    assert out["num_generations"] == 4 and out["engine_shards"] == 2 and out["speedup"] > 0
    assert set(out["phases_s"]) == {"onnxruntime", "hf"}


@pytest.mark.slow  # CI's budget (17 s in CI); bench generate and bench ppo stay in the fast suite
def test_bench_inflight_json(tmp_path):
    out = _bench(tmp_path, "inflight", "--rows", "12", "--slots", "4", "--new-tokens", "12", "--prompt-len", "6",
                 "--stop-frac", "0.2")
    assert out["rows_identical"] and set(out["results"]) == {"static", "inflight"}
    assert out["length_min"] < out["length_max"] and out["generated_tokens"] > 0
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0 for r in out["results"].values())


@pytest.mark.slow
def test_bench_workers_json(tmp_path):
    """A demo-sized PPO iteration with 1 and 2 Ray rollout workers (Ray starts and stops a local instance)."""
    pytest.importorskip("ray", reason="bench workers needs Ray: pip install 'refit[dist]'")
    r = subprocess.run([sys.executable, "-m", "refit", "bench", "workers", "--steps", "3", "--work-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["phases_s"]) == {"1", "2"} and out["timed_steps"] == 1
    assert out["step_ratio_1_over_n"] > 0 and out["phases_s"]["2"]["time/rollout"] > 0


def test_bench_ppo_overlap_json(tmp_path):
    """--max_staleness 1: the overlapped engine loop timed beside the synchronous one and HF generate()."""
    out = _bench(tmp_path, "ppo", "--batch-size", "4", "--response-length", "4", "--max-staleness", "1")
    assert set(out["phases_s"]) == {"onnxruntime", "hf", "onnxruntime-overlap"}
    o = out["overlap"]
    assert o["speedup_vs_hf"] > 0 and o["speedup_vs_sync"] > 0 and 0 < o["push_probe_share_of_step"] < 1
    assert o["version_lag"][1:] == [1] * out["repeats"] and o["correction"] == "tis"
    assert {"time/generate", "time/push_wait"} <= set(out["phases_s"]["onnxruntime-overlap"])


def test_bench_ppo_overlap_waits_for_a_slow_generation(model_dirs, engine_dirs, tmp_path, monkeypatch):
    """The overlapped iteration counts a generation longer than the learner's phases: with each background
    generation slowed by 0.4 s, the timed step waits for it (the bench once interleaved single
    steps, so the generation ran during the other runs' steps and the overlapped step read as the learner alone)."""
    import time

    from refit.bench.ppo import bench_ppo
    from refit.learner.ppo import overlap

    real = overlap._timed_generate

    def slow(engine, prompts, sampling):
        time.sleep(0.4)
        return real(engine, prompts, sampling)

    monkeypatch.setattr(overlap, "_timed_generate", slow)
    out = bench_ppo(model_dirs["tiny-gpt2"], engine_dirs["tiny-gpt2"], "onnxruntime", 4, 4, 1, tmp_path,
                    repeats=1, log=lambda *_: None, max_staleness=1)
    o = out["phases_s"]["onnxruntime-overlap"]
    # the timed step waited for the batch made during the step before it: 0.4 s less that step's learner phases
    learner = o["time/step"] - o["time/rollout"]
    assert o["time/rollout"] >= 0.4 - learner - 0.05 and o["time/step"] >= 0.35, o
    assert out["overlap"]["hidden_generation_share"] < 0.9 and out["overlap"]["version_lag"] == [1, 1]


def _bench_grpo(tmp_path, *args):
    r = subprocess.run([sys.executable, "-m", "refit", "bench", "grpo", "--geometry", "tiny-gpt2",
                        "--work-dir", str(tmp_path), "--prompts-per-step", "2", "--num-generations", "2",
                        "--max-completion-length", "6", "--steps", "2", "--rounds", "1", *args],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_side(side: dict, phases: set[str], steps: int = 2, rounds: int = 1, max_len: int = 6):
    assert set(side["phases_s"]) == phases and side["step_s"] > 0 and side["first_step_s"] > 0
    assert side["generation_s"] > 0 and side["learner_s"] > 0
    assert len(side["reward_by_step"]) == steps and len(side["reward_by_round"]) == rounds
    assert all(0 <= x <= 1 for x in side["reward_by_step"])  # refit/bench/grpo_reward.py is in [0, 1]
    assert all(0 < n <= max_len for n in side["completion_length_by_step"])
    assert side["peak_rss_gb"] > 0.1 and len(side["peak_rss_gb_by_round"]) == rounds  # a Python with torch


@pytest.mark.slow  # CI's budget: two training runs in child processes, 39 s in CI; the bench's aligned flags stay in the fast suite
def test_bench_grpo_vs_hf_json(tmp_path):
    """Without --vs trl: refit ppo (GRPO, engine rollouts) against the same learner with HF generate() rollouts,
    each a child process; the engine is exported once and reused by the Refit run."""
    out = _bench_grpo(tmp_path)
    assert out["bench"] == "grpo" and out["baseline"] == "refit-hf" and set(out["sides"]) == {"refit", "refit-hf"}
    for name in ("refit", "refit-hf"):
        _check_side(out["sides"][name], {"rollout", "score", "update", "weight_push"})
    assert out["speedup"] > 0 and out["generation_speedup"] > 0 and out["speedup_by_round"][0] > 0
    assert out["speedup_round_median"] == pytest.approx(out["speedup_by_round"][0], abs=1e-3)
    assert out["stops"]["refit"] == out["stops"]["trl"] and len(out["stops"]["refit"]) == 2  # EOS, <|im_end|>
    assert out["refit_export"]["peak_rss_gb"] > 0
    assert "reusing engine" in (tmp_path / "grpo-runs" / "refit-r0.log").read_text()
    assert out["settings"]["num_generations"] == 2 and out["reward_gap"]["noise"] is not None  # from the steps
    assert out["machine"]["cpus"] >= 1 and out["machine"]["loadavg_1m_max"] >= 0


def test_bench_grpo_aligns_both_sides(tmp_path):
    """Every aligned setting reaches both command lines with the same value (refit ppo's flag, TRL's argument)."""
    from refit.bench.grpo import REWARD_FILE, Workload, refit_command, trl_command

    w = Workload(model="m", dataset="d.jsonl", prompts_per_step=3, num_generations=5, max_completion_length=7,
                 temperature=0.7, learning_rate=3e-5, lr_scheduler="linear", steps=4, beta=0.02, threads=2,
                 device="cpu", lora_r=8, lora_alpha=32.0, lora_target="q_proj,v_proj", lora_base_dtype="bf16")
    refit = refit_command(w, tmp_path / "r", 11, "onnxruntime", tmp_path / "e", "--rollout.max_staleness 1")
    trl = trl_command(tmp_path / "py", w, tmp_path / "t", 11, '{"gradient_checkpointing": false}')

    def flag(cmd, name, n=1):
        i = cmd.index(name)
        return cmd[i + 1:i + 1 + n] if n > 1 else cmd[i + 1]

    pairs = {"--run.batch_size": "--prompts_per_step", "--num_generations": "--num_generations",
             "--response_length": "--max_completion_length", "--temperature": "--temperature",
             "--optim.learning_rate": "--learning_rate", "--optim.lr_scheduler_type": "--lr_scheduler",
             "--run.steps": "--steps", "--kl_coef": "--beta", "--run.seed": "--seed",
             "--rollout.engine_threads": "--threads", "--run.device": "--device", "--lora.r": "--lora_r",
             "--lora.alpha": "--lora_alpha", "--lora.base_dtype": "--lora_base_dtype"}
    for ours, theirs in pairs.items():
        assert flag(refit, ours) == flag(trl, theirs), (ours, theirs)
    assert flag(refit, "--lora.target_modules", 2) == flag(trl, "--lora_target").split(",")
    assert flag(refit, "--reward") == f"{REWARD_FILE}:reward" and flag(trl, "--reward_file") == str(REWARD_FILE)
    assert flag(refit, "--data.dataset") == flag(trl, "--dataset") == "d.jsonl"
    assert flag(refit, "--model.model_dir") == flag(trl, "--model_dir") == "m"
    # one update per generation (TRL's num_iterations 1, one micro-batch of prompts x generations), k3 in the loss
    assert (flag(refit, "--num_ppo_epochs"), flag(refit, "--num_mini_batches")) == ("1", "1")
    assert (flag(refit, "--kl_penalty"), flag(refit, "--kl_estimator")) == ("loss", "k3")
    assert flag(refit, "--run.precision") == w.precision  # as at_defaults resolved it (below)
    assert refit[-2:] == ["--rollout.max_staleness", "1"]
    assert flag(trl, "--trl_args") == '{"gradient_checkpointing": false}'
    assert flag(refit, "--rollout.quantize") == w.quantize
    # --quantize int8: Refit's engine only; TRL's side has no such argument (it generates with its learner's model)
    int8 = refit_command(replace(w, quantize="int8"), tmp_path / "r", 11, "onnxruntime", tmp_path / "e", "")
    assert flag(int8, "--rollout.quantize") == "int8" and "--lora.base_dtype" in int8
    assert trl_command(tmp_path / "py", replace(w, quantize="int8"), tmp_path / "t", 11, "") == trl_command(
        tmp_path / "py", w, tmp_path / "t", 11, "")


@pytest.mark.parametrize("lora_r", [0, 8])
def test_bench_grpo_runs_refit_at_the_defaults_refit_ppo_picks(lora_r):
    """The bench's Refit side at its defaults: its auto settings resolve to what a `refit ppo` of the same shape
    resolves on this machine (settle_precision on a real PPOConfig, the job's own setup step); explicit ones stay."""
    from dataclasses import replace as rep

    from refit.bench.grpo import Workload, at_defaults
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.run.precision import settle_precision

    w = Workload(model="m", dataset="d.jsonl", prompts_per_step=3, num_generations=5, max_completion_length=7,
                 temperature=1.0, learning_rate=1e-5, lr_scheduler="constant", steps=2, beta=0.0, threads=2,
                 device="cpu", lora_r=lora_r, lora_alpha=16.0, lora_target="all-linear")
    got, line = at_defaults(w)
    cfg = PPOConfig()
    cfg = rep(cfg, lora=rep(cfg.lora, r=lora_r), rollout=rep(cfg.rollout, backend="onnxruntime"))
    ref = settle_precision(cfg, "cpu", log=lambda *_: None)
    assert (got.precision, got.quantize) == (ref.run.precision, ref.rollout.quantize), line
    if lora_r:
        assert got.lora_base_dtype == ref.lora.base_dtype
    assert line.startswith("refit bench grpo: precision: learner ")
    pinned, _ = at_defaults(rep(w, precision="fp32", quantize="none", lora_base_dtype="fp32"))
    assert (pinned.precision, pinned.quantize, pinned.lora_base_dtype) == ("fp32", "none", "fp32")


def test_grpo_reward_and_summaries_by_hand():
    """The shared reward on hand cases (chat completions as TRL passes them); a side's summary and the reward gap
    on hand-made rows: medians skip each run's first step, curves average the rounds."""
    from refit.bench.grpo_report import reward_gap, summarize, trl_rows
    from refit.bench.grpo_reward import reward

    chat = lambda t: [{"role": "assistant", "content": t}]  # noqa: E731
    assert reward(None, [chat(" 7 "), chat("7a"), chat("xx"), "12"], ["7", "7", "7", "12"]) == [1.0, 0.25, 0.0, 1.0]

    def row(step, s, gen, r):
        return {"step": step, "step_s": s, "generation_s": gen, "phases": {"a": gen, "b": s - gen}, "reward": r,
                "completion_length": 4.0}

    runs = [{"rows": [row(1, 9.0, 5.0, 0.0), row(2, 2.0, 1.0, 0.2), row(3, 4.0, 1.0, 0.4)], "wall_s": 20.0,
             "peak_rss_gb": 1.5, "loadavg_1m": 1.0},
            {"rows": [row(1, 7.0, 5.0, 0.2), row(2, 3.0, 2.0, 0.4), row(3, 5.0, 2.0, 0.6)], "wall_s": 21.0,
             "peak_rss_gb": 2.5, "loadavg_1m": 2.0}]
    s = summarize(runs)
    assert s["step_s"] == 3.5 and s["first_step_s"] == 8.0 and s["generation_s"] == 1.5 and s["learner_s"] == 2.0
    assert s["phases_s"] == {"a": 1.5, "b": 2.0} and s["step_s_by_round"] == [3.0, 4.0] and s["peak_rss_gb"] == 2.5
    assert s["reward_by_step"] == [0.1, 0.3, 0.5] and s["reward_mean_by_round"] == [0.2, 0.4]
    g = reward_gap(s, {**s, "reward_by_round": [[0.1, 0.1, 0.1], [0.3, 0.3, 0.3]]})
    # steps 0, .2, .4, .2, .4, .6 (mean .3, variance .044) against .1 x3, .3 x3 (mean .2, variance .012)
    assert g["gap"] == 0.1 and g["noise"] == 0.0966 and g["gap_over_noise"] == 1.04  # sqrt(.044/6 + .012/6)
    t = trl_rows({"rows": [{"step": 1, "step_s": 3.0, "generate_s": 1.0, "generate_and_score_s": 1.5,
                            "reward": 0.5, "completion_length": 6.0}]})
    assert t[0]["phases"] == {"generate": 1.0, "score": 0.5, "update": 1.5} and t[0]["generation_s"] == 1.0


@pytest.mark.slow
def test_bench_grpo_vs_trl_json(tmp_path):
    """--vs trl: TRL 1.16's GRPOTrainer in its own virtual environment (the repository's .venv-trl, installed on
    first use: a few minutes), on the same tiny model, data, reward and settings."""
    from refit.bench.grpo import HERE

    out = _bench_grpo(tmp_path, "--vs", "trl", "--trl-venv", str(HERE.parents[1] / ".venv-trl"))  # the checkout's
    assert out["baseline"] == "trl" and set(out["sides"]) == {"refit", "trl"}
    _check_side(out["sides"]["refit"], {"rollout", "score", "update", "weight_push"})
    _check_side(out["sides"]["trl"], {"generate", "score", "update"})
    trl = out["trl"]
    assert trl["versions"]["trl"].startswith("1.16.") and trl["threads"] == 2 and trl["ref_model"] is False
    # TRL at its best: each configuration tried, the fastest that finished is what the rounds ran
    tried = {t["name"]: t for t in out["trl_trials"]}
    assert set(tried) == {"ckpt-on", "ckpt-off", "bf16"} and all(t["status"] == "ok" for t in tried.values())
    best = min(tried.values(), key=lambda t: t["step_s"])
    assert json.loads(out["trl_args"]) == best["fields"]
    assert trl["config"]["gradient_checkpointing"] is best["fields"]["gradient_checkpointing"]
    assert trl["config"]["bf16"] is best["fields"].get("bf16", False)
    assert trl["config"]["per_device_train_batch_size"] == 4 and trl["config"]["num_iterations"] == 1
    assert trl["config"]["disable_dropout"] is True  # as Refit's learner and engine: no dropout on either side
    assert sorted(trl["eos_token_ids"]) == out["stops"]["trl"] == out["stops"]["refit"]


def test_bench_lora_names_a_refused_full_fine_tuning_row():
    """The full fine-tuning column says why a geometry has no row: the memory check's own line (a 1.5B model on a
    24 GB box), turned into the cell's words; any other failure keeps its line."""
    from refit.bench.lora import markdown, refused

    line = ("refit ppo: error: a batch of 64 rows (run.batch_size 16 x num_generations 4) of up to 65 tokens of m, "
            "3 rows a micro-batch in the update, needs about 32.8 GiB (KV cache 227.5 MiB, engine weights 5.8 GiB, "
            "learner activations 2.2 GiB, weights 23.0 GiB, batch tensors 0.4 MiB), more than the 22.7 GiB of memory "
            "available; the weights alone do not fit")
    cell = refused(line)
    assert cell == "refused before any work: needs 32.8 GiB (weights 23.0 GiB), 22.7 GiB available"
    assert refused("Traceback: something else") is None
    row = {"geometry": "Qwen2.5 1.5B", "params_b": 1.544, "quantize": "none", "base_dtype": "fp32",
           "full_status": cell, "full_wall_s": 9.1, "full_peak_rss_gb": 0.4}
    assert f"| {cell} (9.1 s, 0.4 GB) |" in markdown([row])


def test_trl_candidates_and_the_memory_watch(tmp_path):
    """refit/bench/trl_best.py: the configurations tried for a step's rows (micro-batches only where 16 divides them),
    and a candidate that passes its memory cap is stopped and reported as over memory, not run to the machine's
    limit."""
    from refit.bench.trl_best import candidates, run_capped

    assert [n for n, _ in candidates(4, True)] == ["ckpt-on", "ckpt-off"]
    names = dict(candidates(128, True))
    assert names["ckpt-off-mb16"] == {"gradient_checkpointing": False, "per_device_train_batch_size": 16,
                                      "gradient_accumulation_steps": 8}
    hog = [sys.executable, "-c", "import time; x = bytearray(400 * 2**20); time.sleep(30)"]
    status, wall, rss = run_capped(hog, tmp_path / "hog.log", dict(os.environ), memory_gb=0.2)
    assert status == "over memory" and wall < 20 and rss > 0.2
    assert run_capped([sys.executable, "-c", "pass"], tmp_path / "ok.log", dict(os.environ), 4.0)[0] == "ok"
    assert run_capped([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "f.log", dict(os.environ), 4.0)[0] == \
        "failed (exit 3)"
