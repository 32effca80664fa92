"""Distillation cycle: lmbda draws, teacher passes per batch, seq-KD = CE, vocab check, resume, CLI, batch."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from refit.core.errors import RefitError
from refit.learner.distill.config import DistillConfig
from refit.learner.distill.batch import draws_student
from refit.learner.distill.cycle import run_distill, setup, train_step
from refit.learner.run.metrics import read_metrics

from conftest import corrupting, tiny_distill_config

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(log=lambda *_: None)


_cfg = tiny_distill_config  # teacher tiny-llama, student tiny-gpt2 (conftest; test_scaleout's is smaller)


def _count(obj, name: str, calls: list):
    """Wrap ``obj.name`` (an engine method) so every call appends its arguments to ``calls``."""
    inner = getattr(obj, name)

    def wrapped(*a, **k):
        calls.append((a, k))
        out = inner(*a, **k)
        calls[-1] = (a, k, out)
        return out

    setattr(obj, name, wrapped)


@pytest.mark.parametrize("lmbda,expected", [(0.0, "never"), (1.0, "always"), (0.5, "drawn")])
def test_lmbda_decides_who_generates(model_dirs, engine_dirs, tmp_path, lmbda, expected):
    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, lmbda=lmbda), resume=False, **QUIET)
    calls = []
    _count(run.student_engine, "generate", calls)
    steps = range(1, 7)
    flags = []
    for step in steps:
        before = len(calls)
        flags.append(train_step(run, step)["student/generated"])
        assert len(calls) - before == flags[-1]  # generated <=> exactly one student engine generate call
    if expected == "never":
        assert calls == [] and flags == [0] * 6
    elif expected == "always":
        assert len(calls) == 6 and flags == [1] * 6
    else:
        assert flags == [int(draws_student(run.cfg, s)) for s in steps] and 0 < sum(flags) < 6
    for a, _, out in calls:  # on-policy batches are sampled (not greedy) at the configured temperature
        assert not a[1].greedy and a[1].temperature == run.cfg.sampling.temperature and out.num_rows == 8


@pytest.mark.parametrize("mode,expect", [
    (dict(seq_kd=True, lmbda=0.0, loss="topk_kl"), {"generate": 1, "score": 0, "torch": 0}),
    (dict(seq_kd=True, lmbda=0.0, loss="ce"), {"generate": 1, "score": 0, "torch": 0}),
    (dict(seq_kd=False, lmbda=0.0, loss="topk_kl"), {"generate": 0, "score": 1, "torch": 0}),
    (dict(seq_kd=False, lmbda=1.0, loss="topk_kl"), {"generate": 0, "score": 1, "torch": 0}),
    (dict(seq_kd=False, lmbda=0.0, loss="jsd"), {"generate": 0, "score": 0, "torch": 1}),
])
def test_teacher_runs_exactly_once_per_batch(model_dirs, engine_dirs, tmp_path, mode, expect):
    """Counted on the real teacher engine (under the cycle's own counter) and with a hook on the PyTorch teacher."""
    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, **mode), resume=False, **QUIET)
    gen, score, fwd = [], [], []
    _count(run.teacher.inner, "generate", gen)
    _count(run.teacher.inner, "score", score)
    if run.teacher_model is not None:
        run.teacher_model.register_forward_hook(lambda *_: fwd.append(1))
    for step in (1, 2, 3):
        n = (len(gen), len(score), len(fwd))
        m = train_step(run, step)
        got = {"generate": len(gen) - n[0], "score": len(score) - n[1], "torch": len(fwd) - n[2]}
        assert got == expect, (step, got)
        assert m["teacher/passes"] == 1 and m["teacher/engine_generate"] == expect["generate"]
    if mode["seq_kd"]:
        sp = gen[-1][0][1]
        assert sp.return_topk == run.cfg.teacher_topk and m["batch/from_teacher"] == 1
        assert "distill/teacher_topk_kl" in m or run.cfg.loss == "topk_kl"


def _reference_ce(student, prompts, responses) -> torch.Tensor:
    """Token-mean CE of the student on the teacher's tokens: unpadded rows, one at a time, F.cross_entropy."""
    logits, targets = [], []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r])
        out = student(input_ids=ids).logits[0]  # (Tp + Tr, V)
        logits.append(out[len(p) - 1: len(p) - 1 + len(r)])
        targets.append(torch.tensor(r))
    return F.cross_entropy(torch.cat(logits), torch.cat(targets))


@pytest.mark.parametrize("accum", [1, 4])
def test_seq_kd_loss_is_cross_entropy_on_teacher_tokens(model_dirs, engine_dirs, tmp_path, accum):
    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, seq_kd=True, lmbda=0.0, loss="ce",
                     gradient_accumulation_steps=accum), resume=False, **QUIET)
    before = copy.deepcopy(run.student)
    gen = []
    _count(run.teacher.inner, "generate", gen)
    m = train_step(run, 1)
    (_, _, rollout), = gen
    prompts = [[t for t, k in zip(ids, mk) if k] for ids, mk in zip(rollout.prompt_ids.tolist(),
                                                                    rollout.prompt_mask.tolist())]
    responses = [[t for t, k in zip(ids, mk) if k] for ids, mk in zip(rollout.response_ids.tolist(),
                                                                      rollout.response_mask.tolist())]
    with torch.no_grad():
        ref = _reference_ce(before, prompts, responses)
    assert m["loss"] == pytest.approx(float(ref), rel=1e-5, abs=1e-5)
    assert m["teacher/passes"] == 1 and m["teacher/engine_generate"] == 1


def test_vocab_mismatch_is_refused_with_one_line(model_dirs, tmp_path, tokenizer, capsys):
    import dataclasses

    from refit.learner.builtin.models import GEOMETRIES, build_model
    from refit.cli import main

    geom = dataclasses.replace(GEOMETRIES["tiny-gpt2"], vocab_size=400)
    student = build_model(geom, tmp_path / "wide", tokenizer=tokenizer)
    with pytest.raises(RefitError) as e:
        setup(_cfg(model_dirs, {"tiny-llama": "", "tiny-gpt2": ""}, tmp_path / "run", student_model_dir=str(student)),
              resume=False, **QUIET)
    msg = str(e.value)
    assert "\n" not in msg and "384" in msg and "400" in msg and "teacher" in msg and "student" in msg
    assert not (tmp_path / "run" / "teacher_engine").exists()  # refused before anything was exported
    capsys.readouterr()
    rc = main(["distill", "--teacher.model_dir", str(model_dirs["tiny-gpt2"]), "--student.model_dir", str(student),
               "-o", str(tmp_path / "cli")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "384" in err[0] and "400" in err[0], err


def test_probe_stops_a_run_whose_student_engine_got_wrong_weights(model_dirs, engine_dirs, tmp_path):
    run = setup(_cfg(model_dirs, engine_dirs, tmp_path, lmbda=0.0), resume=False, **QUIET)
    run.student_engine.update_weights = corrupting(run.student_engine.update_weights)
    with pytest.raises(RefitError, match="parity probe failed"):
        train_step(run, 1)


@pytest.mark.parametrize("arch", ["tiny-bart", pytest.param("tiny-marian", marks=pytest.mark.slow)])
@pytest.mark.parametrize("loss", ["topk_kl", "forward_kl"])
def test_bart_family_distill_kl_is_zero_when_student_is_teacher(model_dirs, engine_dirs, tmp_path, arch, loss):
    """Encoder-decoder distillation on BART / Marian: with the student equal to the teacher, the held-out
    KL at step 0 and the loss of an on-policy (student-engine) step are 0 within 1e-6, whether the teacher
    side comes from the teacher engine's top-k or from the PyTorch teacher; the pushed student engine
    agrees with the learner after the first update."""
    from refit.learner.distill.cycle import evaluate

    cfg = _cfg(model_dirs, engine_dirs, tmp_path, teacher_model_dir=str(model_dirs[arch]),
               student_model_dir=str(model_dirs[arch]), teacher_engine_dir=str(engine_dirs[arch]),
               student_engine_dir=str(engine_dirs[arch]), lmbda=1.0, loss=loss)
    run = setup(cfg, resume=False, **QUIET)
    assert run.is_seq2seq and abs(evaluate(run)["eval/kl_to_teacher"]) <= 1e-6
    m = train_step(run, 1)
    assert m["student/generated"] == 1 and abs(m[f"distill/{loss}"]) <= 1e-6, m
    assert m["probe/max_abs_logprob_diff"] < 1e-4


def test_config_refuses_incoherent_modes():
    with pytest.raises(RefitError, match="loss=ce is sequence-level KD"):
        DistillConfig.from_flat(loss="ce", seq_kd=False)
    assert DistillConfig.from_flat(loss="jsd", seq_kd=True, beta=0.5).seq_kd  # the generation pass's full scores
    with pytest.raises(RefitError, match="loss_temperature"):
        DistillConfig.from_flat(loss="topk_kl", seq_kd=True, lmbda=0.0, temperature=0.8, loss_temperature=1.0)
    with pytest.raises(RefitError, match="eval_every must be a multiple"):
        DistillConfig.from_flat(sync_every=2, eval_every=5, save_steps=10)


def test_resume_reproduces_uninterrupted_metrics(model_dirs, engine_dirs, tmp_path):
    kw = dict(lmbda=0.5, eval_every=2)
    full = run_distill(_cfg(model_dirs, engine_dirs, tmp_path / "full", **kw), **QUIET)
    part = tmp_path / "part"
    run_distill(_cfg(model_dirs, engine_dirs, part, max_steps_this_run=2, **kw), **QUIET)
    assert [r["step"] for r in read_metrics(part)] == [0, 1, 2]
    run_distill(_cfg(model_dirs, engine_dirs, part, **kw), resume=True, **QUIET)
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a[3:], b[3:]):
        assert set(ra) == set(rb), ra["step"]
        for k, v in ra.items():  # every field but wall-clock ones, the engine's weights_version included
            if not k.startswith("time/") and "tokens_per_s" not in k and v is not None:
                assert rb[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (ra["step"], k)
    assert [r.get("engine/weights_version") for r in b[1:]] == [1, 2, 3, 4]
    assert a[-1]["eval/kl_to_teacher"] is not None and json.loads((part / "summary.json").read_text())["steps"] == 4


def test_a_resumed_run_probes_the_batch_a_fresh_run_does(model_dirs, engine_dirs, tmp_path):
    """Issue 43 #6: the probe batch is the run's, made from the engine as exported (the model folder's weights)
    before a resumed run pushes its checkpoint, not greedy tokens of the checkpoint's weights, which made a resumed
    run's probe differences differ from the uninterrupted run's. Trained hard (lr 0.05) so the checkpoint's greedy
    tokens differ from the model folder's."""
    cfg = _cfg(model_dirs, engine_dirs, tmp_path / "r", max_steps_this_run=2, learning_rate=0.05, lmbda=0.0)
    run_distill(cfg, **QUIET)
    fresh = setup(_cfg(model_dirs, engine_dirs, tmp_path / "other", learning_rate=0.05, lmbda=0.0), False, **QUIET)
    resumed = setup(cfg, True, **QUIET)
    for k in ("prompt_ids", "response_ids", "response_mask"):
        assert torch.equal(getattr(resumed.sync.probe, k), getattr(fresh.sync.probe, k)), k
    later = resumed.student_engine.generate(resumed.prompt_ids[:4], resumed.sync.probe.sampling)
    assert not torch.equal(later.response_ids, fresh.sync.probe.response_ids)  # the checkpoint's own tokens differ


def _env():
    """The scripts run on this interpreter (``python3`` on PATH may be another one, without torch)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`refit distill` with no model folders (the embedded default), shortened by flags; in-process."""
    import contextlib
    import io

    from refit.cli import main

    out, buf = tmp_path_factory.mktemp("distill_default") / "d", io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["distill", "-o", str(out), "--teacher_sft_steps", "20", "--run.steps", "8", "--eval_every", "4",
                   "--ckpt.save_steps", "4", "--run.batch_size", "16", "--eval_size", "16", "--log.no_progress"])
    return rc, buf.getvalue(), out


def test_distill_default_end_to_end_short(default_run):
    rc, stdout, out = default_run
    assert rc == 0, stdout[-2000:]
    lines = stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert s["steps"] == 8 and s["kl_end"] < s["kl_start"] and s["max_teacher_passes"] == 1
    assert "held-out KL to teacher" in lines[-2] and str(out.resolve()) in lines[-2]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if r.get("eval/kl_to_teacher") is not None] == [0, 4, 8]
    for key in ("loss", "teacher/passes", "student/generated", "eval/accuracy", "tokens_per_s", "time/batch",
                "time/teacher", "time/update", "time/weight_push", "probe/max_abs_logprob_diff"):
        assert key in rows[-1], key
    assert (out / "curves.png").exists() and (out / "config.yaml").exists() and any((out / "tb").iterdir())
    assert (out / "checkpoints" / "step_000008" / "policy" / "config.json").exists()
    assert (out / "models" / "teacher_engine" / "manifest.json").exists()


@pytest.mark.slow  # CI's budget: a script's whole default run (the slow suite smoke-runs it); 89 s in CI
def test_distill_batch_script_smoke(default_run, tmp_path):
    """All five default configs, 2 steps each, on the default run's teacher/student and engines (no rebuild)."""
    out = tmp_path / "batch"
    assert "usage" in subprocess.run(["bash", "scripts/distill_batch.sh", "--help"], capture_output=True, text=True,
                                     cwd=ROOT, env=_env()).stdout.lower()
    r = subprocess.run(["bash", "scripts/distill_batch.sh", "--run.steps", "2", "--out", str(out), "--models",
                        str(default_run[2] / "models"), "--run.batch_size", "8", "--eval_size", "8",
                        "--eval_every", "2", "--ckpt.save_steps", "2", "--log.no_tensorboard", "--log.plots", "false"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    table = json.loads((out / "results.json").read_text())
    assert [row["name"] for row in table["runs"]] == ["supervised_kd", "seq_kd_ce", "gkd_lmbda0", "gkd_lmbda0.5",
                                                       "gkd_lmbda1"]
    for row in table["runs"]:
        assert row["steps"] == 2 and row["kl_end"] is not None and row["teacher_passes_per_batch"] == 1
    assert table["runs"][1]["seq_kd"] is True and table["runs"][4]["student_generated_frac"] == 1.0
    md = (out / "results.md").read_text()
    assert md.count("\n|") >= 6 and "held-out KL" in md and "gkd_lmbda0.5" in md
