"""The TRL scripts of tests/trl_scripts/ run on Refit with one line changed: their ``from trl... import`` becomes
``from refit import`` (:func:`on_refit`). Each script prints one JSON document last (its ``trainer.state``, what
its reward functions returned, what its callback saw); the checks read it, the same checks for both sides.

Where TRL 1.16's own environment exists (``.venv-trl``, made by ``refit bench grpo --vs trl``), the same scripts
also run unchanged under TRL (``slow``; skipped with the reason elsewhere), so they stay TRL scripts.

The models are the session's tiny chat GPT-2 (the student, the GRPO policy) and a tiny chat Llama (the teacher),
one tokenizer, built locally; Refit exports each run's engine itself, as a TRL script gives it none.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from refit.learner.builtin.models import build_chat_tokenizer, build_model
from refit.learner.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "trl_scripts"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_IMPORT = re.compile(r"^from trl(\.[\w.]+)? import ", re.M)


def on_refit(source: str) -> str:
    """The script with its one TRL import line pointed at Refit: the only change."""
    out, n = TRL_IMPORT.subn("from refit import ", source)
    assert n == 1, f"{n} TRL import lines (want exactly one)"
    return out


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def steps(d: dict) -> list[dict]:
    """The per-step rows of log_history (TRL's final train_runtime row left out)."""
    return [r for r in d["log_history"] if "train_runtime" not in r]


def mean(xs) -> float:
    return sum(xs) / len(xs)


# ------------------------------------------------------------------ the checks, one per script (both sides)


def check_common(d: dict, n: int, lr: float) -> None:
    rows = steps(d)
    assert d["global_step"] == n and [r["step"] for r in rows] == list(range(1, n + 1))
    assert rows[0]["learning_rate"] == pytest.approx(lr)  # the rate step 1 used (linear decay from lr)
    assert rows[-1]["learning_rate"] == pytest.approx(lr / n)
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] >= 0, r
    final = d["log_history"][-1]
    assert final["step"] == n and final["train_loss"] == pytest.approx(mean([r["loss"] for r in rows]), rel=1e-4)


def check_grpo(d: dict, out: Path) -> None:
    check_common(d, 2, 1e-3)
    got = d["returned"]
    assert len(got["correct"]) == len(got["short"]) == 2  # one call per generation
    for r, correct, short in zip(steps(d), got["correct"], got["short"]):
        assert len(correct) == len(short) == 8  # 2 prompts x 4 generations
        assert r["reward"] == pytest.approx(mean([c + 2.0 * s for c, s in zip(correct, short)]), rel=1e-5)
        assert r["rewards/short/mean"] == pytest.approx(mean(short), rel=1e-5)
        assert r["rewards/correct/mean"] == pytest.approx(mean(correct), abs=1e-6)
        assert r["kl"] >= -1e-6 and 1 <= r["completions/mean_length"] <= 8
    assert [r["epoch"] for r in steps(d)] == [0.125, 0.25]  # 2 of 16 prompts a step


def check_rloo(d: dict, out: Path) -> None:
    check_common(d, 2, 1e-3)
    assert len(d["returned"]) == 2
    for r, got in zip(steps(d), d["returned"]):
        assert r["reward"] == pytest.approx(mean(got), rel=1e-5) and "kl" in r  # beta 0.05: the KL is logged
        assert r["rewards/length/mean"] == pytest.approx(mean(got), rel=1e-5)


def check_distillation(d: dict, out: Path) -> None:
    check_common(d, 3, 1e-3)
    for r in steps(d):
        assert r["loss"] > 0 and 1 <= r["completions/mean_length"] <= 6


def check_gkd(d: dict, out: Path) -> None:
    check_common(d, 3, 1e-3)
    assert all(r["loss"] > 0 for r in steps(d))


def check_gkd_seq_kd(d: dict, out: Path) -> None:
    check_common(d, 3, 1e-3)
    assert all(r["loss"] > 0 for r in steps(d))


def check_gkd_tokens(d: dict, out: Path) -> None:
    """TRL 1.16's SFTTrainer steps: eos_token set on the tokenizer (in place) and the config, prepended to the
    generation_config's ids; the .jinja file the template; pad_token changes nothing under GKD's own collator."""
    check_common(d, 2, 1e-3)
    assert d["given"] == d["saved"] == ["<|im_end|>", "<pad>", True]
    assert d["config_eos"] == d["eos_id"] and d["generation_eos"] == [d["eos_id"], 1]
    assert all(r["loss"] > 0 for r in steps(d))


def check_grpo_callback_model(d: dict, out: Path) -> None:
    check_common(d, 3, 1e-3)
    assert d["events"] == [["train_begin", 0], ["step_end", 1], ["log", 1], ["step_end", 2], ["log", 2],
                           ["step_end", 3], ["log", 3], ["log", 3], ["train_end", 3]]
    assert len(d["seconds"]) == 3 and all(t > 0 for t in d["seconds"]) and d["max_steps"] == 3
    assert d["weights_changed"]  # the model object given in holds the trained weights
    assert not any("kl" in r for r in steps(d))  # beta 0 (TRL's default): no reference, no KL logged


def check_grpo_peft(d: dict, out: Path) -> None:
    check_common(d, 2, 1e-3)
    assert all(r["reward"] < 0 for r in steps(d))  # -len/10 of every completion


def check_grpo_checkpoints(d: dict, out: Path) -> None:
    """save_steps 2, save_total_limit 2: checkpoint-2 and -4 after max_steps 4; the resumed trainer (max_steps 6)
    restores log_history 1..4 from checkpoint-4, adds 5 and 6, and leaves checkpoint-4 and -6."""
    first, second = d["runs"]
    assert (first["global_step"], first["checkpoints"]) == (4, ["checkpoint-2", "checkpoint-4"])
    assert (second["global_step"], second["checkpoints"]) == (6, ["checkpoint-4", "checkpoint-6"])
    assert [r["step"] for r in steps(first)] == [1, 2, 3, 4]
    rows = steps(second)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[:4] == steps(first)  # restored, not re-run
    # linear decay over 4 steps, then: step 5 uses the rate the restored optimizer holds (the first schedule's
    # end, 0), step 6 the schedule over 6 steps at 5 (transformers restores the optimizer and the scheduler's count)
    want = [1e-3 * (1 - k / 4) for k in range(4)] + [0.0, 1e-3 * (1 - 5 / 6)]
    assert [r["learning_rate"] for r in rows] == pytest.approx(want, abs=1e-12)
    for run, losses in ((first, steps(first)), (second, rows[4:])):  # train_loss: this call's steps
        final = run["log_history"][-1]
        assert final["train_loss"] == pytest.approx(mean([r["loss"] for r in losses]), rel=1e-4, abs=1e-9)
    trl_files = {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json",
                 "trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}
    assert trl_files <= set(d["newest_files"]), trl_files - set(d["newest_files"])
    assert d["newest_state"] == {"global_step": 6, "steps": [1, 2, 3, 4, 5, 6]}
    loaded = d["loaded"]  # save_model(dir): the trained model (= checkpoint-6's) and its chat tokenizer load
    assert loaded["same_as_newest_checkpoint"] and loaded["chat_template"] and loaded["vocab"] > 0


def check_grpo_optim(d: dict, out: Path) -> None:
    """The rate of every step is transformers' cosine_with_min_lr with the script's kwargs (the rate the step used,
    as TRL logs it); NEFTune's noise puts the policy off the (clean) reference at step 1, so its KL is > 0."""
    import torch
    from transformers import get_scheduler

    sched = get_scheduler("cosine_with_min_lr", torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3),
                          num_warmup_steps=1, num_training_steps=4, scheduler_specific_kwargs={"min_lr": 1e-4})
    rows = steps(d)
    assert d["global_step"] == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-3 * sched.lr_lambdas[0](k) for k in range(4)])
    assert rows[0]["kl"] > 1e-4 and all(math.isfinite(r["loss"]) for r in rows)


def check_grpo_dapo(d: dict, out: Path) -> None:
    """One generation (8 completions) replayed num_iterations=2 x steps_per_generation=2 = 4 optimizer steps. TRL logs
    a row per optimizer step, Refit one row for the generation's 4 (docs/trl-facade.md: Callbacks); the checks read
    what both log: the last step's row, the generation's reward and the share of truncated completions."""
    rows = steps(d)
    assert d["global_step"] == 4 and rows[-1]["step"] == 4
    assert rows[-1]["learning_rate"] == pytest.approx(1e-3 / 4)
    assert len(d["returned"]) == 1 and len(d["returned"][0]) == 8
    first = next(r for r in rows if "reward" in r)
    assert first["reward"] == pytest.approx(mean(d["returned"][0]), rel=1e-5)
    assert first["rewards/short/mean"] == pytest.approx(mean(d["returned"][0]), rel=1e-5)
    clipped = first["completions/clipped_ratio"]  # max_completion_length 6: most completions are truncated
    assert 0 <= clipped <= 1
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] >= 0, r
        if clipped == 1:  # every completion masked out of the loss: nothing to learn from
            assert r["loss"] == 0 and r["grad_norm"] == 0
    assert d["log_history"][-1]["train_loss"] == pytest.approx(mean([r["loss"] for r in rows]), abs=1e-6)


def check_grpo_sampling(d: dict, out: Path) -> None:
    check_common(d, 2, 1e-3)
    assert len(d["lengths"]) == 2 and all(len(c) == 8 for c in d["lengths"])  # 2 prompts x 4 generations a call
    assert all(1 <= n <= 6 for c in d["lengths"] for n in c)  # generation_kwargs' max_new_tokens, not 16
    for r, got in zip(steps(d), d["lengths"]):
        assert r["reward"] == pytest.approx(mean([1.0 / (1.0 + n) for n in got]), rel=1e-5)


def check_grpo_entropy(d: dict, out: Path) -> None:
    """The adaptive controller with a target above any entropy here: the coefficient rises by delta every optimizer
    step (0.01 + 0.002 k); step 1 applies no bonus (the controller starts from an infinite entropy), so its loss is
    its policy loss, later steps subtract coef x entropy; checkpoint-2 holds the controller, and the resumed trainer
    continues from it (0.016 at step 3, not 0.012 again)."""
    first, second = d["runs"]
    assert (first["global_step"], second["global_step"]) == (2, 4)
    rows = steps(second)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.012, 0.014, 0.016, 0.018], abs=1e-9)
    assert d["ctrl_at_2"]["entropy_coef"] == pytest.approx(0.014, abs=1e-9)
    assert 0 < d["ctrl_at_2"]["last_world_entropy"] <= 100
    assert rows[0]["loss"] == pytest.approx(rows[0]["policy_loss"], abs=2e-4)  # TRL rounds the loss to 4 places
    for r in rows[1:]:
        assert r["loss"] < r["policy_loss"] - 1e-3 and r["entropy"] > 0, r

def check_grpo_best(d: dict, out: Path) -> None:
    """The evaluation peaks at step 2: checkpoint-2 is best_model_checkpoint, the only view left (save_total_limit 1),
    and the returned and saved models hold its weights; the callback rebuilt from checkpoint-2 with
    restore_callback_states_from_checkpoint starts at 2 steps seen, the one without it as given (at 0)."""
    b = d["best"]
    assert max(b["evals"], key=b["evals"].get) == "2" and b["best_metric"] == pytest.approx(b["evals"]["2"])
    assert (b["best_model_checkpoint"], b["best_global_step"]) == ("checkpoint-2", 2)
    assert b["checkpoints"] == ["checkpoint-2"]
    assert b["saved_is_best"] and b["model_is_best"]
    s = d["states"]
    assert s["stored"] == {"args": {"every": 3}, "attributes": {"seen": 2}}
    assert s["runs"] == [{"given": True, "every": 3, "at_begin": 0, "seen": 2},
                         {"given": False, "every": 3, "at_begin": 2, "seen": 3},
                         {"given": True, "every": 1, "at_begin": 0, "seen": 1}]

CHECKS = {"grpo": check_grpo, "grpo_dapo": check_grpo_dapo, "rloo": check_rloo, "distillation": check_distillation,
          "gkd": check_gkd, "gkd_seq_kd": check_gkd_seq_kd, "gkd_tokens": check_gkd_tokens,
          "grpo_callback_model": check_grpo_callback_model, "grpo_peft": check_grpo_peft,
          "grpo_checkpoints": check_grpo_checkpoints, "grpo_optim": check_grpo_optim, "grpo_sampling": check_grpo_sampling,
          "grpo_entropy": check_grpo_entropy, "grpo_best": check_grpo_best}
TEACHER = ("distillation", "gkd", "gkd_seq_kd", "gkd_tokens")  # the scripts that take STUDENT TEACHER OUT
SLOW = {"rloo", "distillation", "gkd", "gkd_seq_kd", "gkd_tokens", "grpo_peft", "grpo_checkpoints", "grpo_optim",
        "grpo_dapo", "grpo_sampling", "grpo_entropy", "grpo_best"}
# 20-40 s each on a loaded 2-core box (each run exports its engines and its final engine; gkd_seq_kd: 2.5 min here;
# grpo_checkpoints trains twice: 2.2 min here); grpo and grpo_callback_model stay in the default run


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny chat Llama with the student's tokenizer (GKD's collator needs the chat template)."""
    return build_model("tiny-llama", tmp_path_factory.mktemp("teacher") / "tiny-llama-chat", seed=1,
                       tokenizer=build_chat_tokenizer())


VARIANTS = {"gkd_seq_kd": ("gkd", ["seq_kd"])}  # a check that runs another check's script with more arguments


def script_of(name: str) -> Path:
    return SCRIPTS / f"{VARIANTS.get(name, (name, []))[0]}.py"


def argv(name: str, student, teacher, out: Path) -> list[str]:
    more = VARIANTS.get(name, (name, []))[1]
    return [str(student), str(teacher), str(out), *more] if name in TEACHER else [str(student), str(out), *more]


def _param(name):
    return pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [], id=name)


def test_every_script_imports_from_trl_once_and_is_checked():
    names = sorted(p.stem for p in SCRIPTS.glob("*.py"))
    assert names == sorted(set(CHECKS) - set(VARIANTS))
    for p in SCRIPTS.glob("*.py"):
        src = p.read_text()
        moved = on_refit(src)
        changed = [(a, b) for a, b in zip(src.splitlines(), moved.splitlines()) if a != b]
        assert len(changed) == 1 and changed[0][1].startswith("from refit import "), p.name


@pytest.mark.parametrize("name", [_param(n) for n in CHECKS])
def test_trl_script_runs_on_refit(name, chat_model_dir, teacher_dir, tmp_path, monkeypatch, capsys):
    script = tmp_path / f"{name}.py"
    script.write_text(on_refit(script_of(name).read_text()))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [str(script), *argv(name, chat_model_dir, teacher_dir, out)])
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    CHECKS[name](last_json(printed), out)
    _show("refit", name, printed, capsys)
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file()  # a Refit run folder
    if name == "grpo_peft":
        assert "r: 4" in (out / "config.yaml").read_text()  # peft_config -> the lora section
    if name == "gkd_seq_kd":  # each step's batch from the student engine or (seq_kd) the teacher engine, whose
        rows = [r for r in read_metrics(out) if r["step"] > 0]  # generation pass is the one teacher pass
        assert [r["student/generated"] + r["batch/from_teacher"] for r in rows] == [1, 1, 1]
        assert all(r["teacher/passes"] == 1 for r in rows)
        assert all(r["teacher/engine_generate"] == 1 for r in rows if r["batch/from_teacher"])


@pytest.mark.slow  # TRL's own run: 8-15 s a script here, plus its imports
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason=f"no TRL environment at {TRL_PYTHON} (made by "
                                                     "`refit bench grpo --vs trl`)")
@pytest.mark.parametrize("name", list(CHECKS))
def test_trl_script_runs_under_trl(name, chat_model_dir, teacher_dir, tmp_path, capsys):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
    done = subprocess.run([str(TRL_PYTHON), str(script_of(name)), *argv(name, chat_model_dir, teacher_dir, out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    CHECKS[name](last_json(done.stdout), out)
    _show("trl 1.16", name, done.stdout, capsys)


def _show(side: str, name: str, printed: str, capsys) -> None:
    """The script's last line (its JSON, cut to 300 characters) on the terminal under ``pytest -s``: the record of a
    run on each side."""
    with capsys.disabled():
        print(f"\n[{side}] {name}: {printed.strip().splitlines()[-1][:300]}")


def test_the_long_grpo_example_differs_from_its_trl_original_in_the_import_line():
    """examples/trl_chat/grpo_long.py is grpo_long_trl.py (TRL's) with one line changed: the import."""
    trl = (ROOT / "examples" / "trl_chat" / "grpo_long_trl.py").read_text()
    ours = (ROOT / "examples" / "trl_chat" / "grpo_long.py").read_text()
    assert on_refit(trl) == ours
    assert [a for a, b in zip(trl.splitlines(), ours.splitlines()) if a != b] == [
        "from trl import GRPOConfig, GRPOTrainer"]


DUMP_FIELDS = """
import dataclasses, json
from trl import DistillationConfig, GRPOConfig, RLOOConfig
from trl.experimental.gkd import GKDConfig
def default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None
print(json.dumps({c.__name__: {f.name: repr(default(f)) for f in dataclasses.fields(c) if f.init}
                  for c in (GRPOConfig, RLOOConfig, DistillationConfig, GKDConfig)}))
"""


@pytest.mark.slow  # TRL's import: ~10 s
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason=f"no TRL environment at {TRL_PYTHON}")
def test_the_field_tables_hold_every_field_of_trls_configs_with_trls_defaults():
    """refit/learner/trl/field_tables.py against TRL 1.16 itself: every field of its four configs is in the tables (the
    counts of docs/trl-facade.md are of these), nothing else but NOT_IN_TRL_116, each at TRL's default."""
    from refit.learner.trl.field_tables import CONFIG_FIELDS, NOT_IN_TRL_116

    done = subprocess.run([str(TRL_PYTHON), "-c", DUMP_FIELDS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    trl = last_json(done.stdout)
    resolved = {"output_dir": "None", "disable_tqdm": "None"}  # TRL's None, resolved in __post_init__ as ours is
    for name, table in CONFIG_FIELDS.items():
        assert set(table) - NOT_IN_TRL_116[name] == set(trl[name]), name
        wrong = {k: (repr(f.default), trl[name][k]) for k, f in table.items()
                 if k in trl[name] and repr(f.default) != trl[name][k] and resolved.get(k) != trl[name][k]}
        assert not wrong, (name, wrong)
