"""Generation overlapped with the update (rollout.max_staleness, refit.learner.ppo.overlap): the staleness bound,
k=0 unchanged, resume with a rollout in flight, KL at step 0."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo, setup, train_step
from refit.learner.run.metrics import read_metrics

GOLDEN = Path(__file__).parent / "data" / "ppo-k0-metrics.json"
WALL_CLOCK = ("time/", "tokens_per_s")  # the only fields two runs may differ in


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """An overlapped run splits torch's threads with the engine (setup sets the learner's share): restore them."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cfg(model_dirs, engine_dirs, out, **kw):
    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]), output_dir=str(out),
                steps=4, batch_size=4, num_generations=2, advantage_estimator="grpo", num_mini_batches=1,
                num_ppo_epochs=1, response_length=4, save_steps=2, probe_size=4, progress=False, tensorboard=False,
                plots=False, max_operand=9, num_prompts=32, learning_rate=1e-3, export_final=False,
                reward="refit.learner.builtin.tasks:length_reward", engine_threads=1)
    base.update(kw)
    return PPOConfig.from_flat(**base)


def _same(a: list[dict], b: list[dict], more: bool = False, rel: float = 1e-5, abs_: float = 1e-6,
          kl_abs: float = 1e-6) -> None:
    """Two runs' metrics rows: the same steps and fields, equal values but for wall-clock (``more``: ``b`` may have
    fields ``a`` has not, metrics added since ``a`` was recorded); every value off by more than the tolerance is
    named in the failure, with its relative difference. ``kl_abs``: the absolute tolerance of the ``kl/`` figures,
    means and sums of log-prob differences, whose error is absolute (that of the log-probs), not relative."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    off = []
    for ra, rb in zip(a, b):
        assert (set(ra) <= set(rb)) if more else (set(ra) == set(rb)), (ra["step"], set(ra) ^ set(rb))
        for k, v in ra.items():
            tol = dict(rel=rel, abs=max(abs_, kl_abs) if k.startswith("kl/") else abs_)
            if not k.startswith(WALL_CLOCK) and v is not None and rb[k] != pytest.approx(v, **tol):
                off.append((ra["step"], k, v, rb[k], abs(rb[k] - v) / max(abs(v), 1e-12)))
    assert not off, off


def test_k0_is_the_synchronous_loop_unchanged(model_dirs, engine_dirs, tmp_path):
    """max_staleness 0 (the default) logs what the loop logged before overlap existed: the metrics of a fixed-seed
    run were recorded with the code before this change (tests/data/ppo-k0-metrics.json, REFIT_RECORD_GOLDEN=1
    rewrites it; tolerance rel 1e-5 / abs 1e-6, as the resume tests); no overlap field appears. On torch's BLAS
    route, as the golden was recorded: oneDNN's (run.cpu_matmul auto) fp32 sums move a KL figure by 5e-5 relative.
    The golden was recorded on an AMD EPYC; on an Intel Xeon the same BLAS route sums in another order, which moves
    the KL figures by up to 2e-6 absolute (1.7e-4 relative of kl/k1 = -0.0118 at step 2): those are compared to
    2e-5 absolute, a log-prob's precision, every other figure as before."""
    cfg = _cfg(model_dirs, engine_dirs, tmp_path, cpu_matmul="blas")
    assert cfg.rollout.max_staleness == 0 and cfg.correction == "none"
    rows = read_metrics(run_ppo(cfg, log=lambda *_: None))
    if os.environ.get("REFIT_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    _same(json.loads(GOLDEN.read_text()), rows, more=True, kl_abs=2e-5)
    assert not any(k.startswith("rollout/") or k in ("time/generate", "time/push_wait") for k in rows[-1])


def test_k1_first_step_kl_zero_then_one_push_behind(model_dirs, engine_dirs, tmp_path):
    """With k=1 step 1's batch comes from the step-0 weights (lag 0, every KL estimator 0 within 1e-6); every later
    batch is one push behind the learner, corrected by TIS (auto), named 'version_lag' once; every push checked
    on the probe batch, on the engine's thread, its diff logged on the next step's row (the last push: its own)."""
    logs = []
    rows = read_metrics(run_ppo(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), log=logs.append))
    assert [r["mismatch/version_lag"] for r in rows] == [0, 1, 1, 1]
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(rows[0][f"kl/{k}"]) <= 1e-6, (k, rows[0][f"kl/{k}"])
    assert rows[0]["mismatch/max_abs_diff"] < 1e-4 and rows[-1]["mismatch/max_abs_diff"] > 1e-3  # the lag shows
    assert all("ppo/is_weights_mean" in r for r in rows) and "probe/max_abs_logprob_diff" not in rows[0]
    assert all(r["probe/max_abs_logprob_diff"] < 1e-3 for r in rows[1:])
    assert [r["engine/weights_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["time/generate"] > 0 and "time/push_wait" in r for r in rows)
    assert rows[0]["time/push_engine"] == 0 and all(r["time/push_engine"] > 0 for r in rows[1:])
    named = [m for m in logs if "engine/learner mismatch (version_lag)" in m]
    assert len(named) == 1 and "told once" in named[0], logs
    assert any("generation overlapped with the update; engine 1 intra-op thread(s)" in m for m in logs), logs


def test_k1_rows_are_a_function_of_seed_prompt_sample_and_version(model_dirs, engine_dirs, tmp_path):
    """The batch generated ahead for step 2 (during step 1's update, from the step-0 weights) is the batch the
    synchronous loop's engine draws for step 2's prompts and seed from those weights; no push meets a generation,
    and every push runs on the engine's thread, not the learner's."""
    import threading

    from conftest import same_rows

    from refit.learner.ppo.cycle import step_batch
    from refit.rollout.engine import create_engine

    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), resume=False, log=lambda *_: None)
    in_flight, pushed_on = [], []
    generate, push = run.engine.generate, run.engine.update_weights

    def counted(*a, **kw):
        in_flight.append(1)
        try:
            return generate(*a, **kw)
        finally:
            in_flight.pop()

    def checked(*a, **kw):
        assert not in_flight, "a push met a generation"
        pushed_on.append(threading.current_thread())
        return push(*a, **kw)

    run.engine.generate, run.engine.update_weights = counted, checked
    try:
        train_step(run, 1, log=lambda *_: None)
        step, ahead, queued = run.ahead.held()
        assert step == 2 and ahead.weights_version == 0 and run.engine.weights_version == 1
        assert [p.version for p in queued] == [1]  # step 1's push, done, its probe not yet logged
        idx, sampling = step_batch(run, 2, run.cfg.run.batch_size)
        fresh = create_engine("onnxruntime", engine_dirs["tiny-gpt2"], threads=1)  # the step-0 weights
        same_rows(ahead, fresh.generate([run.prompt_ids[i] for i in idx], sampling), tol=1e-6)
        fresh.close()
        row = train_step(run, 2, log=lambda *_: None)
        assert row["probe/max_abs_logprob_diff"] < 1e-3 and row["engine/weights_version"] == 2
        run.ahead.wait()
        assert len(pushed_on) == 2 and threading.current_thread() not in pushed_on, pushed_on
        assert all(t.name.startswith("refit-rollout") for t in pushed_on), pushed_on
    finally:
        run.ahead.close()
        run.engine.close()


def test_staleness_bound_is_enforced(model_dirs, engine_dirs, tmp_path):
    """A batch more than k pushes older than the learner's weights (or newer) is refused in one line before any
    update; k=2 takes the same batch, logging its lag."""
    from refit.learner.ppo.cycle import step_batch

    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), resume=False, log=lambda *_: None)
    try:
        idx, sampling = step_batch(run, 1, 0)
        batch = run.engine.generate([run.prompt_ids[i] for i in idx], sampling)
        before = [p.detach().clone() for p in run.policy.parameters()]
        for version, lag in ((run.sync.version - 2, 2), (run.sync.version + 1, -1)):
            run.ahead.restore(1, replace(batch, weights_version=version))
            with pytest.raises(RefitError, match=rf"stale rollout: .* {lag} pushes behind, rollout.max_staleness "
                                                 r"allows 0 to 1"):
                train_step(run, 1, log=lambda *_: None)
            run.state.data_position = 0
        assert all(torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))  # nothing updated
        run = replace(run, cfg=replace(run.cfg, rollout=replace(run.cfg.rollout, max_staleness=2)))
        run.ahead.restore(1, replace(batch, weights_version=run.sync.version - 2))
        assert train_step(run, 1, log=lambda *_: None)["mismatch/version_lag"] == 2
    finally:
        run.ahead.close()
        run.engine.close()


def test_k1_resume_equals_uninterrupted(model_dirs, engine_dirs, tmp_path):
    """A k=1 run stopped after its step-2 checkpoint (step 3's batch in flight, generated from the step-1 weights,
    saved with it) and resumed logs what the uninterrupted k=1 run logs, step for step."""
    full = read_metrics(run_ppo(_cfg(model_dirs, engine_dirs, tmp_path / "full", max_staleness=1),
                                log=lambda *_: None))
    part = tmp_path / "part"
    run_ppo(_cfg(model_dirs, engine_dirs, part, max_staleness=1, max_steps_this_run=2), log=lambda *_: None)
    pending = torch.load(part / "checkpoints" / "step_000002" / "pending_rollout.pt", weights_only=False)
    assert pending["step"] == 3 and pending["batch"].weights_version == 1
    run_ppo(_cfg(model_dirs, engine_dirs, part, max_staleness=1), resume=True, log=lambda *_: None)
    _same(full, read_metrics(part))
    assert [r["mismatch/version_lag"] for r in read_metrics(part)] == [0, 1, 1, 1]


def test_overlap_config(tmp_path):
    """The field, its flag and range; distill refuses it; auto correction is tis with it."""
    from refit.learner.distill.config import DistillConfig
    from refit.learner.ppo.overlap import split_threads
    from refit.learner.run.config import parse_job

    cfg, _ = parse_job(PPOConfig, ["--rollout.max_staleness", "1"], "refit ppo")
    assert cfg.rollout.max_staleness == 1 and cfg.correction == "tis"
    assert replace(cfg, mismatch_correction="none").correction == "none"
    with pytest.raises(RefitError, match="rollout.max_staleness = -1 is out of range"):
        PPOConfig.from_flat(max_staleness=-1)
    with pytest.raises(RefitError, match="PPO only"):
        DistillConfig.from_flat(max_staleness=1)
    assert split_threads(0, 2) == (1, 1) and split_threads(0, 8) == (4, 4) and split_threads(3, 4) == (3, 1)
    assert split_threads(0, 1) == (1, 1)
    # engine shards decode at once, one thread each: the engine's share covers them, the learner keeps at least one
    assert split_threads(0, 8, shards=2) == (4, 4) and split_threads(1, 4, shards=2) == (2, 2)
    assert split_threads(0, 2, shards=2) == (2, 1) and split_threads(0, 4, shards=6) == (6, 1)


def test_k1_with_sync_every_2(model_dirs, engine_dirs, tmp_path):
    """Pushes every 2 steps: the batch generated during a step without a push runs on into the next step (its
    wait is time/rollout); the lag stays within one push; a push's probe is logged on the next row (the last
    step's on its own)."""
    rows = read_metrics(run_ppo(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1, sync_every=2),
                                log=lambda *_: None))
    assert [r["mismatch/version_lag"] for r in rows] == [0, 0, 1, 0]
    assert [r["engine/weights_version"] for r in rows] == [0, 1, 1, 2]
    assert ["probe/max_abs_logprob_diff" in r for r in rows] == [False, False, True, True]


def test_k1_push_that_does_not_take_stops_on_the_probe_batch(model_dirs, engine_dirs, tmp_path):
    """Overlapped, the next rollout comes from older weights and cannot check a push: the probe batch does, on the
    engine's thread; the learner raises its one line at the next step, before that step's row."""
    from conftest import corrupting

    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), resume=False, log=lambda *_: None)
    try:
        run.engine.update_weights = corrupting(run.engine.update_weights)
        train_step(run, 1, log=lambda *_: None)  # queued, not yet checked
        with pytest.raises(RefitError, match="parity probe failed after weight push .* on the probe batch"):
            train_step(run, 2, log=lambda *_: None)
    finally:
        run.ahead.close()
        run.engine.close()


def test_k1_bad_push_stops_the_run_naming_the_last_checkpoint(model_dirs, engine_dirs, tmp_path, monkeypatch):
    """A whole k=1 run whose third push does not take (the engine's weights made wrong) stops in one line naming the
    step-2 checkpoint: no row and no checkpoint after the bad push's check."""
    from conftest import corrupting

    from refit.rollout.ort_backend import OrtEngine

    calls = []
    real = OrtEngine.update_weights

    def third_bad(self, named, version=None):
        calls.append(version)
        push = partial(real, self, version=version)
        return corrupting(push)(named) if len(calls) == 3 else push(named)

    monkeypatch.setattr(OrtEngine, "update_weights", third_bad)
    with pytest.raises(RefitError) as err:
        run_ppo(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), log=lambda *_: None)
    msg = str(err.value)
    assert "\n" not in msg and "parity probe failed after weight push (engine weights_version 3" in msg, msg
    assert msg.endswith(str(tmp_path / "checkpoints" / "step_000002")), msg
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def _bad_push(monkeypatch, nth: int) -> None:
    """The ``nth`` push into the ORT engine does not take (its weights made wrong): its probe fails."""
    from conftest import corrupting

    from refit.rollout.ort_backend import OrtEngine

    calls = []
    real = OrtEngine.update_weights

    def bad(self, named, version=None):
        calls.append(version)
        push = partial(real, self, version=version)
        return corrupting(push)(named) if len(calls) == nth else push(named)

    monkeypatch.setattr(OrtEngine, "update_weights", bad)


def _rollout_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("refit-rollout")]


def test_k1_last_push_failing_after_the_last_step_fails_the_run(model_dirs, engine_dirs, tmp_path, monkeypatch):
    """A k=1 run that ends at max_steps_this_run (3 of 4, no checkpoint there) leaves its last push and probe
    queued on the engine's thread: the normal end waits for them, and the failed probe's one line is the run's
    error (not a run that reports success); the thread is closed."""
    _bad_push(monkeypatch, 3)  # step 3's push: queued at the end of step 3, never collected by a step
    cfg = _cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1, max_steps_this_run=3, save_steps=4)
    with pytest.raises(RefitError) as err:
        run_ppo(cfg, log=lambda *_: None)
    msg = str(err.value)
    assert "\n" not in msg and "parity probe failed after weight push (engine weights_version 3" in msg, msg
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert _rollout_threads() == []


def test_k1_last_push_that_passes_is_logged_at_the_end(model_dirs, engine_dirs, tmp_path):
    """The same end with a good push: the run succeeds, and the last push's probe, which no step's row carries,
    is logged in one line with the engine's version after it (3: one push per step)."""
    lines = []
    run_ppo(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1, max_steps_this_run=3, save_steps=4),
            log=lambda *a: lines.append(" ".join(map(str, a))))
    last = [ln for ln in lines if ln.startswith("last weight push")]
    assert len(last) == 1 and "(version 3)" in last[0], lines[-5:]
    assert float(last[0].rsplit(" ", 1)[1]) < 1e-3  # within the probe's tolerance: it passed
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_k1_error_in_flight_is_not_masked_by_a_failed_push(model_dirs, engine_dirs, tmp_path, monkeypatch):
    """An error already unwinding the run (here: writing step 3's row) stays the one reported, though the push
    queued at step 3 fails its probe while the run closes; the thread is closed all the same."""
    from refit.learner.run.metrics import MetricsLog

    _bad_push(monkeypatch, 3)
    real_log = MetricsLog.log

    def log_then_fail(self, step, metrics):
        if step == 3:
            raise OSError("disk full at step 3")
        real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLog, "log", log_then_fail)
    with pytest.raises(OSError, match="^disk full at step 3$"):
        run_ppo(_cfg(model_dirs, engine_dirs, tmp_path, max_staleness=1), log=lambda *_: None)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert _rollout_threads() == []


def test_k1_with_engine_shards_logs_what_one_shard_logs(model_dirs, engine_dirs, tmp_path):
    """rollout.engine_shards 2 with generation overlapped: the background thread's generate decodes in two shards
    on two more threads (the engine's share of the threads covers them) and the run logs what the one-shard k=1
    run logs, step for step (rows do not depend on the shards)."""
    one = read_metrics(run_ppo(_cfg(model_dirs, engine_dirs, tmp_path / "one", max_staleness=1), log=lambda *_: None))
    two = read_metrics(run_ppo(_cfg(model_dirs, engine_dirs, tmp_path / "two", max_staleness=1, engine_shards=2),
                               log=lambda *_: None))
    _same(one, two)
    assert [r["mismatch/version_lag"] for r in two] == [0, 1, 1, 1]
