"""Fault injection (issue 20): every bad value, damaged file, foreign folder and kill -9 ends in one line and
loses nothing. Each test names the issue's case(s) it pins (#1 ... #14).

Fast tests drive ``refit.cli.main`` in-process (stderr is the line the user sees) or the layer that
decides (claim, guard_engine, resume_latest); the kill -9 tests run ``refit ppo`` in a subprocess with
``REFIT_FAULT_POINT`` (refit.core.integrity.fault_point: os._exit at a named point) and are marked slow.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from refit.core.errors import RefitError
from refit import cli

GPT2 = "tiny-gpt2"


def refit(capsys, *argv) -> tuple[int, str]:
    """``refit ARGV`` in-process: (exit status, the last stderr line)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, (err[-1] if err else "")


def one_line(rc: int, line: str, *words: str) -> None:
    assert rc == 2, line
    assert line.startswith("refit ") and ": error: " in line and "Traceback" not in line, line
    for w in words:
        assert w in line, line


# --------------------------------------------------------------- #3, #6, #9, #13: bad values, before any work

BAD_VALUES = [  # (command argv, field named, allowed range named)
    (["ppo", "--top_p", "0"], "top_p = 0.0", "(0, 1]"),
    (["ppo", "--temperature", "0"], "temperature = 0.0", "> 0"),
    (["distill", "--temperature", "-1"], "temperature = -1.0", "> 0"),
    (["ppo", "--rollout.temperature", "-1"], "temperature = -1.0", "> 0"),  # the deprecated spelling, same rule
    (["ppo", "--optim.learning_rate", "nan"], "optim.learning_rate = nan", "finite"),
    (["ppo", "--response_length", "0"], "response_length = 0", ">= 1"),
    (["ppo", "--num_generations", "0"], "num_generations = 0", ">= 1"),
    (["ppo", "--top_k", "-1"], "top_k = -1", ">= 0"),
    (["ppo", "--run.device", "tpu"], "run.device = 'tpu'", "auto, cpu, cuda"),
    (["ppo", "--ckpt.save_steps", "0"], "ckpt.save_steps = 0", ">= 1"),
    (["ppo", "--ckpt.keep_checkpoints", "-1"], "ckpt.keep_checkpoints = -1", "0 keeps every checkpoint"),
    (["ppo", "--optim.max_grad_norm", "-1"], "optim.max_grad_norm = -1.0", "> 0"),
    (["ppo", "--reward_weights", "nan"], "reward_weights = nan", "finite"),
    (["ppo", "--cliprange", "-1"], "cliprange = -1.0", "> 0"),
    (["ppo", "--run.batch_size", "0"], "run.batch_size = 0", ">= 1"),
    (["ppo", "--rollout.probe_tol", "0"], "rollout.probe_tol = 0.0", "> 0"),
    (["ppo", "--num_mini_batches", "0"], "num_mini_batches = 0", ">= 1"),
    (["distill", "--lmbda", "2"], "lmbda = 2.0", "[0, 1]"),
    (["distill", "--loss_temperature", "0"], "loss_temperature = 0.0", "> 0"),
    (["distill", "--optim.learning_rate", "inf"], "optim.learning_rate = inf", "finite"),
    (["generate", "e", "--prompt", "x", "--top_p", "0"], "top_p = 0.0", "(0, 1]"),
    (["generate", "e", "--prompt", "x", "--temperature", "0"], "temperature = 0.0", "> 0"),
    (["generate", "e", "--prompt", "x", "--n", "0"], "n = 0", ">= 1"),
    (["export", "m", "-o", "e", "--max_batch", "0"], "max_batch = 0", ">= 1"),
    (["export", "m", "-o", "e", "--parity_tol", "-1"], "parity_tol = -1.0", "> 0"),
    (["bench", "generate", "--repeats", "0"], "repeats = 0", ">= 1"),
    (["bench", "inflight", "--stop_frac", "0"], "stop_frac = 0.0", "(0, 1]"),
    (["bench", "generate", "--batch_sizes", "0,x"], "batch_sizes = '0,x'", "a comma list of whole numbers >= 1"),
    (["bench", "generate", "--batch_sizes", "0"], "batch_sizes = '0'", "a comma list of whole numbers >= 1"),
]


@pytest.mark.parametrize("argv,field,allowed", BAD_VALUES, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in BAD_VALUES])
def test_bad_value_is_one_line_naming_field_value_and_range(capsys, tmp_path, argv, field, allowed):
    rc, line = refit(capsys, *argv, *(["--model.model_dir", "m"] if argv[0] == "ppo" else []),
                     *(["-o", tmp_path / "run"] if argv[0] in ("ppo", "distill") else []))
    one_line(rc, line, "config: " + field, "is out of range; allowed: ", allowed)
    assert not (tmp_path / "run").exists()  # refused before any work: nothing written


def test_keep_checkpoints_zero_keeps_all(tmp_path):
    """#3: 0 keeps every checkpoint (documented in refit.core.validate); N keeps the newest N."""
    import torch

    from refit.learner.run.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / "all", step, _Saveable(model), None, None, None, None, {}, keep=0)
        save_checkpoint(tmp_path / "two", step, _Saveable(model), None, None, None, None, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "all/checkpoints").iterdir()) == [f"step_00000{i}" for i in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "two/checkpoints").iterdir()) == ["step_000002", "step_000003"]


class _Saveable:
    """A torch module with HF's save_pretrained (safetensors), for checkpoint tests without a model."""

    def __init__(self, m):
        self.m = m

    def save_pretrained(self, path):
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.m.state_dict().items()}, str(Path(path) / "model.safetensors"))

    def load_state_dict(self, sd, strict=False):
        return self.m.load_state_dict(sd, strict=strict)


# ------------------------------------------------------------------------------- #12, #13: files, one line

def test_bad_files_are_one_line_naming_the_file_and_row(capsys, tmp_path, model_dirs):
    m = model_dirs[GPT2]
    (tmp_path / "five.yaml").write_text("run: 5\n")
    (tmp_path / "broken.yaml").write_text("run: {steps: [1\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "row.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": \n{"prompt": "2+2="}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 1+1=\n".encode("latin-1"))
    (tmp_path / "a_file").write_text("x")
    base = ["ppo", "--model.model_dir", m, "--model.engine_dir", tmp_path / "e", "-o", tmp_path / "run"]
    cases = [
        (["--config", tmp_path / "five.yaml"], ["five.yaml", "run is a section", "mapping"]),
        (["--config", tmp_path / "broken.yaml"], ["broken.yaml is not valid YAML at line 2"]),
        (["--data.dataset", tmp_path / "empty.jsonl"], ["empty.jsonl is empty"]),
        (["--data.dataset", tmp_path / "row.jsonl"], ["row.jsonl line 2 is not valid JSON"]),
        (["--prompts_file", tmp_path / "latin1.txt"], ["latin1.txt is not UTF-8", "byte 3"]),
        (["-o", tmp_path / "a_file"], ["run folder", "a_file holds a file"]),
    ]
    for extra, words in cases:
        one_line(*refit(capsys, *base, *extra), *words)


def test_cli_turns_every_exception_into_one_line_and_debug_reraises(capsys, monkeypatch):
    """#12: the disk, a read-only folder, a damaged graph; anything else: one line with the --debug hint."""
    from google.protobuf.message import DecodeError

    raised = {}
    mod = types.ModuleType("refit_fault_cmd")
    mod.main = lambda argv: (_ for _ in ()).throw(raised["e"])
    monkeypatch.setitem(sys.modules, "refit_fault_cmd", mod)
    monkeypatch.setitem(cli.COMMANDS, "boom", (mod.main, "test"))
    cases = [
        (OSError(errno.ENOSPC, "No space left on device", "run/checkpoints/x"), ["disk full", "run/checkpoints/x",
                                                                                 "then rerun it"]),
        (OSError(errno.EROFS, "Read-only file system", "/ro/run"), ["cannot write /ro/run", "read-only"]),
        (PermissionError(errno.EACCES, "Permission denied", "/root/x"), ["cannot write /root/x", "permission"]),
        (FileExistsError(errno.EEXIST, "File exists", "runs/x"), ["runs/x is in the way"]),
        (DecodeError("Error parsing message"), ["an .onnx graph is damaged", "re-export"]),
        (ValueError("something odd"), ["unexpected ValueError: something odd", "--debug"]),
    ]
    for e, words in cases:
        raised["e"] = e
        rc, line = refit(capsys, "boom")
        assert rc in (1, 2) and "Traceback" not in line, line
        for w in words:
            assert w in line, line
    raised["e"] = ValueError("with traceback")
    with pytest.raises(ValueError, match="with traceback"):
        cli.main(["boom", "--debug"])


# ------------------------------------------------------------------ #1, #5, #14: run folder ownership, resume

def _fake_run(run_dir: Path, cfg, steps=(2, 4)):
    from refit.learner.run.folder import claim, write_record

    write_record(run_dir, claim(run_dir, cfg, resume=False, overwrite=False, log=lambda *_: None))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps[-1] + 1)))
    for s in steps:
        (run_dir / f"checkpoints/step_{s:06d}").mkdir(parents=True)


def _ppo(tmp_path, model, **kw):
    from refit.learner.ppo.config import PPOConfig

    return PPOConfig.from_flat(model_dir=str(model), engine_dir=str(tmp_path / "e"), output_dir=str(tmp_path / "run"),
                               **kw)


def test_a_second_run_never_mixes_with_the_first(tmp_path, model_dirs):
    """#1: a fresh run into a run folder is refused; --overwrite deletes the old run, saying so."""
    from refit.learner.run.folder import claim

    cfg = _ppo(tmp_path, model_dirs[GPT2], steps=8)
    _fake_run(tmp_path / "run", cfg, steps=(6, 8))
    new = _ppo(tmp_path, model_dirs[GPT2], steps=4)
    with pytest.raises(RefitError, match=r"already holds run \w+ \(last checkpoint step_000008\); continue it with "
                                         r"--resume, replace it with --overwrite"):
        claim(tmp_path / "run", new, resume=False, overwrite=False)
    assert (tmp_path / "run/checkpoints/step_000008").is_dir()  # nothing touched
    said = []
    claim(tmp_path / "run", new, resume=False, overwrite=True, log=said.append)
    assert "--overwrite: deleting run" in said[0] and "metrics.jsonl" in said[0]
    assert not (tmp_path / "run/metrics.jsonl").exists() and not (tmp_path / "run/checkpoints").exists()


def test_resume_refuses_a_changed_config_or_model_and_applies_allowed_changes(tmp_path, model_dirs):
    """#5: --resume --optim.learning_rate 1e6 is refused (not ignored), so is another model folder or changed
    weights in the same one; run.steps may change (applied and logged)."""
    from refit.learner.run.folder import claim

    model = tmp_path / "model"
    shutil.copytree(model_dirs[GPT2], model)
    cfg = _ppo(tmp_path, model, steps=4)
    _fake_run(tmp_path / "run", cfg)
    with pytest.raises(RefitError, match=r"--resume: optim.learning_rate changed \(5e-05 -> 1000000.0\)"):
        claim(tmp_path / "run", _ppo(tmp_path, model, steps=4, learning_rate=1e6), resume=True, overwrite=False)
    with pytest.raises(RefitError, match=r"--resume: model.model_dir changed"):
        claim(tmp_path / "run", _ppo(tmp_path, model_dirs["tiny-llama"], steps=4), resume=True, overwrite=False)
    said = []
    rec = claim(tmp_path / "run", _ppo(tmp_path, model, steps=8), resume=True, overwrite=False, log=said.append)
    assert said == ["refit: --resume: applying changed run.steps 4 -> 8"] and rec["config"]["run.steps"] == 8
    cfg_json = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg_json, "initializer_range": 0.5}))
    with pytest.raises(RefitError, match=r"--resume: the weights in .*model \(model.model_dir\) changed since the run"):
        claim(tmp_path / "run", _ppo(tmp_path, model, steps=4), resume=True, overwrite=False)


def test_leftover_temp_folders_of_dead_processes_are_removed(tmp_path, model_dirs):
    """#14: .step_N.tmp-PID of a killed run goes on the next start; a live PID's folder stays."""
    from refit.learner.run.folder import claim

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cfg = _ppo(tmp_path, model_dirs[GPT2])
    _fake_run(tmp_path / "run", cfg)
    ck = tmp_path / "run/checkpoints"
    (ck / f".step_000004.tmp-{dead.pid}/policy").mkdir(parents=True)
    (ck / f".step_000006.tmp-{os.getpid()}").mkdir()
    said = []
    claim(tmp_path / "run", cfg, resume=True, overwrite=False, log=said.append)
    assert any(f"removed 1 leftover temporary folder of killed runs" in s for s in said), said
    assert not (ck / f".step_000004.tmp-{dead.pid}").exists() and (ck / f".step_000006.tmp-{os.getpid()}").exists()


# ------------------------------------------------------------------- #11: damaged checkpoints, torn metrics

def test_damaged_newest_checkpoint_falls_back_in_one_line(tmp_path):
    import torch

    from refit.learner.run.checkpoint import resume_latest, save_checkpoint

    model = torch.nn.Linear(3, 3)
    for step in (2, 4):
        with torch.no_grad():
            model.weight.fill_(step)
        save_checkpoint(tmp_path, step, _Saveable(model), None, None, None, None, {"kl_coef": 0.1}, keep=0)
    for damage in ("truncate", "state", "trainer"):
        shutil.rmtree(tmp_path / "bad", ignore_errors=True)
        shutil.copytree(tmp_path / "checkpoints", tmp_path / "bad/checkpoints")
        newest = tmp_path / "bad/checkpoints/step_000004"
        f = {"truncate": newest / "policy/model.safetensors", "state": newest / "state.json",
             "trainer": newest / "trainer.pt"}[damage]
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        said = []
        ck, state = resume_latest(tmp_path / "bad", _Saveable(model), None, None, None, log=said.append)
        assert ck.name == "step_000002" and state["step"] == 2 and float(model.weight[0, 0].detach()) == 2.0
        assert len(said) == 1 and "checkpoint step_000004 is damaged" in said[0] and "resuming from step_000002" in \
            said[0], said


def test_torn_last_metrics_line_is_dropped_in_one_line(tmp_path):
    from refit.learner.run.metrics import MetricsLog, read_metrics

    rows = "".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 4, "x"')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    said = []
    MetricsLog(tmp_path, tensorboard=False, resume_step=2, log=said.append).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert len(said) == 1 and "dropped the torn last line" in said[0] and "line 4" in said[0]
    (tmp_path / "metrics.jsonl").write_text(rows.replace('"x": 2', '"x": 2,,') + rows)
    with pytest.raises(RefitError, match=r"metrics.jsonl line 2 is damaged"):
        MetricsLog(tmp_path, tensorboard=False, resume_step=2)


# ------------------------------------------------------------------------------- #7: bad reward outputs

def test_bad_reward_outputs_stop_in_one_line(model_dirs):
    from refit.learner.ppo.rewards import ClassifierReward, NamedReward, score_rewards

    def run(fn):
        return score_rewards([NamedReward("r", fn)], ["p", "q"], ["a", "b"], {})

    with pytest.raises(RefitError, match=r"reward function 'r' returned str '1' for row 0; expected a number or None"):
        run(lambda prompts, completions: ["1", 1.0])
    with pytest.raises(RefitError, match=r"every reward function \(r\) returned None for every one of the 2"):
        run(lambda prompts, completions: [None, None])
    total, stats = run(lambda prompts, completions: [None, 2.0])  # some rows: TRL's nansum
    assert total.tolist() == [0.0, 2.0] and stats["reward/r/mean"] == 2.0
    with pytest.raises(RefitError, match=r"is a GPT2LMHeadModel checkpoint, not a sequence classifier: it has no "
                                         r"score head"):
        ClassifierReward(str(model_dirs[GPT2]))


# ------------------------------------------------------------- #2, #4, #8, #10, #13: engines, foreign folders

def _damaged(engine: Path, tmp_path: Path, how: str) -> Path:
    out = tmp_path / f"e_{how}"
    shutil.copytree(engine, out)
    if how == "scaled":  # same size, other values: the corrupt-reference case
        f = out / "decoder.onnx.data"
        b = bytearray(f.read_bytes())
        b[4096:8192] = bytes((x * 3) % 256 for x in b[4096:8192])
        f.write_bytes(bytes(b))
    elif how == "truncated_graph":
        f = out / "decoder.onnx"
        f.write_bytes(f.read_bytes()[:1000])
    elif how == "missing_data":
        (out / "decoder.onnx.data").unlink()
    elif how in ("vocab", "positions"):
        m = json.loads((out / "manifest.json").read_text())
        m["dims"]["vocab_size" if how == "vocab" else "max_positions"] += 64
        (out / "manifest.json").write_text(json.dumps(m))
    elif how == "manifest":
        (out / "manifest.json").write_text('{"dims": ')
    return out


@pytest.mark.parametrize("how,words", [
    ("scaled", "decoder.onnx.data does not match its manifest"),
    ("truncated_graph", "decoder.onnx does not match its manifest"),
    ("missing_data", "decoder.onnx.data is missing"),
    ("vocab", "manifest vocab_size"),
    ("positions", "manifest max_positions"),
    ("manifest", "manifest is unusable"),
])
def test_damaged_engine_is_never_used(capsys, tmp_path, model_dirs, default_engine_dirs, how, words):
    """#4, #10, #13: generate refuses it in one line; a training run exports it again, saying so; a foreign or
    unreadable one is refused without --overwrite."""
    from refit.export.guard import guard_engine

    e = _damaged(default_engine_dirs[GPT2], tmp_path, how)
    if how == "manifest":  # not an engine any more: the manifest reader's own line
        one_line(*refit(capsys, "generate", e, "--prompt", "12+34="), f"{e}/manifest.json is corrupt")
    else:
        one_line(*refit(capsys, "generate", e, "--prompt", "12+34="), f"engine folder {e} is damaged", words,
                 "--overwrite")
    said = []
    if how == "manifest":
        with pytest.raises(RefitError, match="has an unusable manifest"):
            guard_engine(model_dirs[GPT2], e)
        guard_engine(model_dirs[GPT2], e, overwrite=True, log=said.append)
    else:
        guard_engine(model_dirs[GPT2], e, log=said.append)
        assert f"engine folder {e} is damaged ({words}" in said[0] and "exporting it again" in said[0], said
    assert not e.exists()  # removed: the build exports it afresh


def test_foreign_folders_are_never_written_over(capsys, tmp_path, model_dirs, default_engine_dirs):
    """#2: another model's engine (training and export), a model folder, a run folder; build-model too; #13: a
    model folder without a tokenizer is not exported."""
    from refit.export.guard import guard_engine

    other = default_engine_dirs[GPT2]
    with pytest.raises(RefitError, match=r"holds an engine of other weights .* pass --overwrite to replace it"):
        guard_engine(model_dirs["tiny-llama"], other)
    one_line(*refit(capsys, "export", model_dirs["tiny-llama"], "-o", other), "holds an engine of other weights")
    one_line(*refit(capsys, "export", model_dirs["tiny-llama"], "-o", model_dirs[GPT2]),
             "holds an HF model checkpoint, not an engine")
    one_line(*refit(capsys, "build-model", "tiny-gpt2", "-o", other), f"{other} holds an engine folder")
    one_line(*refit(capsys, "build-model", "tiny-gpt2", "-o", model_dirs[GPT2]), "holds an HF model checkpoint",
             "--overwrite")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(model_dirs[GPT2] / f, bare / f)
    one_line(*refit(capsys, "export", bare, "-o", tmp_path / "e"), "has no tokenizer files")
    copy = tmp_path / "copy"
    shutil.copytree(other, copy)
    said = []
    guard_engine(model_dirs["tiny-llama"], copy, overwrite=True, log=said.append)
    assert not copy.exists() and "--overwrite: removing engine folder" in said[0]


def test_generate_torch_refuses_a_changed_source(capsys, tmp_path, model_dirs, default_engine_dirs):
    """#8: --backend torch runs the engine's source folder; weights changed since the export: one line."""
    src, e = tmp_path / "src", tmp_path / "e"
    shutil.copytree(model_dirs[GPT2], src)
    shutil.copytree(default_engine_dirs[GPT2], e)
    m = json.loads((e / "manifest.json").read_text())
    (e / "manifest.json").write_text(json.dumps({**m, "source_model": str(src)}))
    rc, line = refit(capsys, "generate", e, "--prompt", "12+34=", "--backend", "torch", "--max_new_tokens", "2",
                     "--seed", "0")
    assert rc == 0, line
    with open(src / "model.safetensors", "r+b") as f:  # same size, other weights
        f.seek(-64, 2)
        f.write(b"\x01" * 64)
    one_line(*refit(capsys, "generate", e, "--prompt", "12+34=", "--backend", "torch"),
             f"runs the source model {src}, whose weights changed since", "--backend onnxruntime")


# --------------------------------------------------------- one real run: #1, #5, #11 end to end through the CLI

def test_ppo_run_folder_end_to_end(capsys, tmp_path, model_dirs, default_engine_dirs):
    run = tmp_path / "run"
    p = ["ppo", "--model.model_dir", model_dirs[GPT2], "--model.engine_dir", default_engine_dirs[GPT2], "-o", run,
         "--run.batch_size", "2", "--num_mini_batches", "1", "--num_ppo_epochs", "1", "--response_length", "3",
         "--rollout.probe_size", "2", "--log.no_progress", "--log.no_tensorboard", "--log.no_plots",
         "--no_export_final", "--data.num_prompts", "8", "--ckpt.save_steps", "1", "--ckpt.keep_checkpoints", "0"]
    assert refit(capsys, *p, "--run.steps", "2")[0] == 0
    one_line(*refit(capsys, *p, "--run.steps", "3"), "already holds run", "--resume", "--overwrite")
    one_line(*refit(capsys, *p, "--run.steps", "2", "--resume", "--optim.learning_rate", "1e6"),
             "--resume: optim.learning_rate changed")
    newest = run / "checkpoints/step_000002/policy/model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward')
    capsys.readouterr()
    assert cli.main([str(a) for a in (*p, "--run.steps", "3", "--resume")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step_000002 is damaged (policy/model.safetensors does not match" in out
    assert "resuming from step_000001" in out and "dropped the torn last line" in out
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# ------------------------------------------------------------------- #11, #14: kill -9 at chosen points (slow)

def _ppo_argv(model, engine, run, steps=4):
    return ["ppo", "--model.model_dir", str(model), "--model.engine_dir", str(engine), "-o", str(run),
            "--run.batch_size", "2", "--num_mini_batches", "1", "--num_ppo_epochs", "1", "--response_length", "3",
            "--rollout.probe_size", "2", "--log.no_progress", "--log.no_tensorboard", "--log.no_plots",
            "--no_export_final", "--data.num_prompts", "8", "--ckpt.save_steps", "2", "--run.steps", str(steps)]


def _refit_subprocess(argv, fault=None):
    env = {**os.environ, "REFIT_FAULT_POINT": fault} if fault else {
        k: v for k, v in os.environ.items() if k != "REFIT_FAULT_POINT"}
    return subprocess.run([sys.executable, "-m", "refit", *argv], env=env, capture_output=True, text=True,
                          timeout=600)


def _rows(run):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_dirs, default_engine_dirs):
    """The 4-step run never killed (a subprocess, as the killed ones)."""
    run = tmp_path_factory.mktemp("whole") / "run"
    whole = _refit_subprocess(_ppo_argv(model_dirs[GPT2], default_engine_dirs[GPT2], run))
    assert whole.returncode == 0, whole.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["checkpoint.before_rename:2", "metrics.torn:4", "step.end:3"])
def test_kill_9_then_resume_equals_the_uninterrupted_run(tmp_path, model_dirs, default_engine_dirs, fault,
                                                          uninterrupted):
    """#11, #14: killed (os._exit, no cleanup) inside a checkpoint write, mid metrics line, after a step; the
    next --resume removes the leftover temporary folder, drops the torn line and ends with the same metrics
    and the same final checkpoint as the run never killed."""
    from safetensors.torch import load_file

    m, e = model_dirs[GPT2], default_engine_dirs[GPT2]
    killed = _refit_subprocess(_ppo_argv(m, e, tmp_path / "run"), fault)
    assert killed.returncode == 137, killed.stderr[-2000:]
    resumed = _refit_subprocess(_ppo_argv(m, e, tmp_path / "run") + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    if fault.startswith("checkpoint"):
        assert "removed 1 leftover temporary folder of killed runs" in resumed.stdout
    if fault.startswith("metrics"):
        assert "dropped the torn last line" in resumed.stdout
    assert not list((tmp_path / "run/checkpoints").glob(".*"))
    a, b = _rows(uninterrupted), _rows(tmp_path / "run")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    wa = load_file(str(uninterrupted / "checkpoints/step_000004/policy/model.safetensors"))
    wb = load_file(str(tmp_path / "run/checkpoints/step_000004/policy/model.safetensors"))
    assert all((wa[k] == wb[k]).all() for k in wa)


# ======================================================================================= issue 32
# Nothing lost when runs collide or a user's folder is used. Each test names the case(s) (#1 ... #13).

_HOLDER = """
import sys, time
from refit.core.integrity import hold_folder
hold_folder(sys.argv[1], "folder")
print("held", flush=True)
time.sleep(600)
"""


def _hold_in_child(lock: Path) -> subprocess.Popen:
    """A second process holding ``lock`` (refit.core.integrity.hold_folder) until killed."""
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_run_folder_held_by_another_process_is_refused_and_a_dead_holder_is_taken_over(tmp_path, model_dirs):
    """#1: the run folder's OS lock names the live holder; the lock of a process killed -9 is taken over, saying
    so (the kernel released it; the pid it left in the file tells)."""
    from refit.core.integrity import RUN_LOCK
    from refit.learner.run.folder import claim

    run = tmp_path / "run"
    child = _hold_in_child(run / RUN_LOCK)
    cfg = _ppo(tmp_path, model_dirs[GPT2])
    with pytest.raises(RefitError, match=rf"run folder {run} is in use by another Refit process \(pid {child.pid}: "):
        claim(run, cfg, resume=False, overwrite=False)
    assert not (run / "run.json").exists()
    child.kill()
    child.wait()
    said = []
    claim(run, cfg, resume=False, overwrite=False, log=said.append)
    assert any(f"was held by pid {child.pid}" in s and "taking it over" in s for s in said), said


def test_an_engine_folder_held_by_another_process_is_refused(capsys, tmp_path, model_dirs):
    """#2: a second `refit export` to an engine folder being written is refused in one line, before any work."""
    from refit.core.integrity import engine_lock

    e = tmp_path / "e"
    child = _hold_in_child(engine_lock(e))
    try:
        one_line(*refit(capsys, "export", model_dirs[GPT2], "-o", e), f"engine folder {e} is in use by another "
                 f"Refit process (pid {child.pid}")
    finally:
        child.kill()
        child.wait()
    assert not e.exists()


def test_a_users_folder_is_never_written_into(capsys, tmp_path, model_dirs, monkeypatch):
    """#3: -o on a folder with the user's own config.yaml is refused (with --overwrite too: it would be
    replaced), a non-empty folder without a run needs --overwrite, and -o . is refused."""
    p = ["ppo", "--model.model_dir", model_dirs[GPT2], "--model.engine_dir", tmp_path / "e"]
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.yaml").write_text("mine: 1\n")
    for extra in ([], ["--overwrite"]):
        one_line(*refit(capsys, *p, "-o", proj, *extra), f"run folder {proj} holds files that are not a Refit run's",
                 "would replace config.yaml", "choose another run folder")
    assert (proj / "config.yaml").read_text() == "mine: 1\n" and sorted(os.listdir(proj)) == ["config.yaml"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    one_line(*refit(capsys, *p, "-o", notes), "is not empty and holds no Refit run", "--overwrite")
    monkeypatch.chdir(notes)
    one_line(*refit(capsys, *p, "-o", "."), "run folder . is the current folder", "-o runs/NAME")
    assert sorted(os.listdir(notes)) == ["todo.txt"]
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.run.folder import claim

    run = tmp_path / "own"  # what the run's own config puts in its folder (refit distill's RUN/models) is not foreign
    shutil.copytree(model_dirs[GPT2], run / "models/policy")
    claim(run, PPOConfig.from_flat(model_dir=str(run / "models/policy"), output_dir=str(run)), resume=False,
          overwrite=False)


def test_a_batch_over_the_users_engine_runs_within_it_and_a_short_engine_is_refused(capsys, tmp_path, model_dirs,
                                                                                    default_engine_dirs, monkeypatch):
    """#4: a batch over the user's engine's max_batch runs within it (calls of at most max_batch rows; the folder
    untouched); an engine too short for the run is refused in one line naming both limits, never re-exported; a
    run's own engine is exported again only when it cannot serve, never narrower than it was."""
    import refit.rollout.build as rb

    e = tmp_path / "e"
    shutil.copytree(default_engine_dirs[GPT2], e)  # max_batch 16, max_len 128
    before = {f.name: f.read_bytes() for f in e.iterdir() if f.is_file()}
    p = ["ppo", "--model.model_dir", model_dirs[GPT2], "--model.engine_dir", e, "--num_mini_batches", "1",
         "--log.no_progress", "--log.no_tensorboard", "--log.no_plots", "--no_export_final", "--run.steps", "1",
         "--rollout.probe_size", "2", "--data.num_prompts", "20"]
    capsys.readouterr()
    assert cli.main([str(a) for a in (*p, "-o", tmp_path / "run", "--run.batch_size", "17", "--response_length",
                                      "3")]) == 0
    assert f"refit: engine {e} takes 16 rows per call (max_batch): this run's 17 rows run in calls of at most 16" in \
        capsys.readouterr().out
    rc, line = refit(capsys, *p, "-o", tmp_path / "run2", "--run.batch_size", "2", "--response_length", "120")
    one_line(rc, line, rf"engine folder {e} (max_batch 16, max_len 128) cannot serve this run (2 rows of up to ",
             "its max_len is too short; export another engine (refit export", "--max_batch 16 --max_len 1",
             "(--model.engine_dir NEW_DIR)")
    assert {f.name: f.read_bytes() for f in e.iterdir() if f.is_file()} == before
    with pytest.raises(RefitError, match=rf"engine folder {e} \(max_batch 16, max_len 128\) cannot serve this run "
                                         r"\(4 rows of up to 140 tokens\): its max_len is too short"):
        rb.ensure_engine(model_dirs[GPT2], e, 4, 140)
    own = tmp_path / "run3/engine"  # the run's own engine (in a run folder): reused for a larger batch, exported
    shutil.copytree(default_engine_dirs[GPT2], own)  # again (never narrower) only when too short
    (tmp_path / "run3/run.json").write_text('{"format": "refit-run/1", "run_id": "a1"}')  # Refit's own run
    said = []
    assert rb.ensure_engine(model_dirs[GPT2], own, 70, 40, log=said.append) == own
    assert "reusing engine" in said[-1] and (own / "manifest.json").read_bytes() == before["manifest.json"]
    asked = []
    monkeypatch.setattr(rb, "build", lambda m, d, b, opts, **kw: asked.append(opts) or Path(d))
    rb.ensure_engine(model_dirs[GPT2], own, 8, 200, log=said.append)
    assert (asked[0].max_batch, asked[0].max_len) == (64, 200) and "cannot serve it (its max_len is too short): " \
        "exporting it again" in said[-1], said


def test_a_batch_that_cannot_fit_is_refused_before_any_work(capsys, tmp_path, model_dirs, default_engine_dirs,
                                                             monkeypatch):
    """#4: --run.batch_size 200000 (the run's own engine: its calls take the whole batch) is refused before the run
    folder, any export or any generation, with the estimate (KV cache, logits, the learner's micro-batch, the
    batch's tensors: refit.core.memory); a normal batch passes the same check, before and after the prompts'
    length is known; an engine call alone is checked too."""
    import refit.core.memory as mem
    import refit.learner.run.engines as re
    import refit.rollout.build as rb

    four = 4 * 2 ** 30
    for module in (mem, re, rb):
        monkeypatch.setattr(module, "available", lambda: four)
    run = tmp_path / "run"
    rc, line = refit(capsys, "ppo", "--model.model_dir", model_dirs[GPT2], "-o", run, "--run.batch_size", "200000",
                     "--log.no_progress")
    one_line(rc, line, f"a batch of 200000 rows (run.batch_size 200000) of up to 9 tokens of {model_dirs[GPT2]}, ",
             "rows a micro-batch in the update, needs about ", "(KV cache ", "engine logits ", "engine activations ",
             "batch tensors ",
             "more than the 4.0 GiB of memory available; lower run.batch_size")
    assert not run.exists()  # no run folder, no engine exported into it, nothing generated
    big, normal = (_ppo(tmp_path, model_dirs[GPT2], batch_size=b, num_mini_batches=1) for b in (20000, 2))
    re.check_batch_memory(big)  # one-token prompts: fits; the prompts' real length: does not
    with pytest.raises(RefitError, match=r"a batch of 20000 rows .* of up to 140 tokens .* needs about [\d.]+ GiB "
                                         r"\(KV cache [\d.]+ GiB, engine logits [\d.]+ MiB, engine activations "
                                         r"[\d.]+ GiB, engine weights [\d.]+ MiB, learner logits .*, "
                                         r"learner activations .*, weights [\d.]+ MiB, batch tensors [\d.]+ MiB\), "
                                         r"more than the 4.0 GiB"):
        re.check_batch_memory(big, max_len=140)
    re.check_batch_memory(normal)
    re.check_batch_memory(normal, max_len=140)
    e = tmp_path / "e"  # the user's engine of max_batch 16: the engine's calls take 16 rows; the batch fits
    shutil.copytree(default_engine_dirs[GPT2], e)
    re.check_batch_memory(big, max_len=140)
    with pytest.raises(RefitError, match=r"an engine call of 100000000 rows x 140 tokens of .* needs about [\d.]+ TiB "
                                         r"\(KV cache [\d.]+ TiB, engine logits [\d.]+ TiB, engine activations "
                                         r"[\d.]+ TiB, weights [\d.]+ MiB\), more than the 4.0 GiB"):
        rb.ensure_engine(model_dirs[GPT2], tmp_path / "e_huge", 100_000_000, 140)
    assert not (tmp_path / "e_huge").exists()


def test_full_fine_tuning_whose_weights_cannot_fit_is_pointed_to_lora(tmp_path, model_dirs, monkeypatch):
    """Where the weights with their gradient and Adam's moments alone exceed memory (Qwen2.5-1.5B here: 23.0 GiB
    of 22.7), lowering the batch cannot help: the line says to train a LoRA adapter; a LoRA run over the same memory
    gets the batch advice (its base is 4 bytes a parameter)."""
    from dataclasses import replace

    import refit.learner.run.engines as re
    from refit.core.hf_folder import load_model

    cfg = _ppo(tmp_path, model_dirs[GPT2], batch_size=2, num_mini_batches=1)
    weights = 16 * sum(p.numel() for p in load_model(model_dirs[GPT2]).parameters())
    monkeypatch.setattr(re, "available", lambda: weights // 2)
    with pytest.raises(RefitError, match=r"more than the .* of memory available; the weights alone do not fit: .*"
                                         r"train a LoRA adapter over the frozen base instead \(--lora.r 16"):
        re.check_batch_memory(cfg)
    monkeypatch.setattr(re, "available", lambda: weights // 40)
    with pytest.raises(RefitError, match=r"of memory available; lower run.batch_size"):
        re.check_batch_memory(replace(cfg, lora=replace(cfg.lora, r=4)))


def test_config_sections_are_strict_with_the_nearest_name(capsys, tmp_path, model_dirs):
    """#5, #13: a bare name under a wrong section is not an old flat name; unknown names get a suggestion."""
    p = ["ppo", "--model.model_dir", model_dirs[GPT2], "-o", tmp_path / "run"]
    for text, words in [("eval:\n  steps: 2\n", "unknown field eval.steps (did you mean eval_steps?)"),
                        ("optimm:\n  learning_rate: 1.0e-4\n", "unknown field optimm.learning_rate (did you mean "
                                                               "optim.learning_rate?)"),
                        ("optim:\n  learing_rate: 1.0e-4\n", "unknown field optim.learing_rate (did you mean "
                                                             "optim.learning_rate?)")]:
        (tmp_path / "c.yaml").write_text(text)
        one_line(*refit(capsys, *p, "--config", tmp_path / "c.yaml"), words)
    one_line(*refit(capsys, *p, "--learing_rate", "1e-4"), "unknown arguments: --learing_rate (did you mean "
                                                           "optim.learning_rate?)")
    assert not (tmp_path / "run").exists()


def test_resume_knows_the_run_folder_however_spelled_or_moved(tmp_path, model_dirs, monkeypatch):
    """#6: ./run/, an absolute path, another working folder, a moved run folder and another path to the same
    model are the same run; another model is still refused."""
    from refit.learner.run.folder import claim

    model = tmp_path / "model"
    shutil.copytree(model_dirs[GPT2], model)
    monkeypatch.chdir(tmp_path)
    rel = dict(model_dir="model", engine_dir="e", output_dir="run", steps=4)
    from refit.learner.ppo.config import PPOConfig

    _fake_run(tmp_path / "run", PPOConfig.from_flat(**rel))
    for spelled in (dict(output_dir="./run/"), dict(output_dir=str(tmp_path / "run"), model_dir=str(model))):
        said = []
        claim(tmp_path / "run", PPOConfig.from_flat(**{**rel, **spelled}), resume=True, overwrite=False,
              log=said.append)
        assert said == [], said
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    claim(Path("../run"), PPOConfig.from_flat(model_dir="../model", engine_dir="../e", output_dir="../run", steps=4),
          resume=True, overwrite=False)
    shutil.copytree(tmp_path / "run", tmp_path / "moved")
    shutil.copytree(model, tmp_path / "model2")
    said = []
    claim(tmp_path / "moved", PPOConfig.from_flat(model_dir="../model2", engine_dir="../e", output_dir="../moved",
                                                  steps=4), resume=True, overwrite=False, log=said.append)
    assert len(said) == 1 and "--resume: moved, run.output_dir" in said[0] and "(the same weights)" in said[0], said
    with pytest.raises(RefitError, match=r"--resume: model.model_dir changed"):
        claim(tmp_path / "moved", PPOConfig.from_flat(model_dir=str(model_dirs["tiny-llama"]), engine_dir="../e",
                                                      output_dir="../moved", steps=4), resume=True, overwrite=False)


def test_a_run_that_failed_before_its_first_checkpoint_names_overwrite(tmp_path, model_dirs):
    """#7: --resume and a plain rerun both name --overwrite; a run that recorded nothing starts afresh; the
    non-finite line without a checkpoint names --overwrite too; a killed run's .run.json.tmp-PID goes (#12)."""
    from refit.learner.run.folder import claim, write_record
    from refit.learner.run.loop import check_finite

    run, cfg = tmp_path / "run", _ppo(tmp_path, model_dirs[GPT2])
    write_record(run, claim(run, cfg, resume=False, overwrite=False, log=lambda *_: None))
    said = []
    write_record(run, claim(run, cfg, resume=False, overwrite=False, log=said.append))  # nothing recorded: no refusal
    assert "stopped before its first step (nothing recorded); starting afresh" in said[0], said
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RefitError, match=r"--resume: run \w+ in .*run stopped before its first checkpoint: nothing "
                                         r"to continue; start it again with --overwrite"):
        claim(run, cfg, resume=True, overwrite=False)
    with pytest.raises(RefitError, match=r"already holds run \w+, which stopped before its first checkpoint; start "
                                         r"it again with --overwrite"):
        claim(run, cfg, resume=False, overwrite=False)
    with pytest.raises(RefitError, match=r"non-finite loss \(loss=nan\); nothing from this step was saved, there is "
                                         r"no checkpoint yet: start again with --overwrite"):
        check_finite({"loss": float("nan")}, "loss", run)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / f".run.json.tmp-{dead.pid}").write_text("{")
    said = []
    claim(run, cfg, resume=False, overwrite=True, log=said.append)
    assert not (run / f".run.json.tmp-{dead.pid}").exists() and "removed 1 leftover" in said[0], said
    from refit.export.guard import guard_engine

    e = tmp_path / "e"  # an engine folder's manifest rewrite killed before its rename: gone on the next use
    e.mkdir()
    (e / f".manifest.json.tmp-{dead.pid}").write_text("{")
    guard_engine(model_dirs[GPT2], e, log=lambda *_: None)
    assert not (e / f".manifest.json.tmp-{dead.pid}").exists()


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_a_killed_record_write_leaves_a_temp_file_that_the_next_start_removes(tmp_path, model_dirs,
                                                                              default_engine_dirs):
    """#12: `refit ppo` killed (os._exit) between writing .run.json.tmp-PID and its rename leaves that file; the
    next start removes it, saying so."""
    from refit.learner.run.folder import claim

    run = tmp_path / "run"
    killed = _refit_subprocess(_ppo_argv(model_dirs[GPT2], default_engine_dirs[GPT2], run), "record.before_rename")
    assert killed.returncode == 137, killed.stderr[-2000:]
    left = [p.name for p in run.glob(".run.json.tmp-*")]
    assert len(left) == 1 and not (run / "run.json").exists(), sorted(os.listdir(run))
    said = []
    claim(run, _ppo(tmp_path, model_dirs[GPT2]), resume=False, overwrite=False, log=said.append)
    assert not list(run.glob(".run.json.tmp-*"))
    assert "which ended without releasing it; taking it over" in said[0], said  # its lock, left by the kill
    assert f"removed 1 leftover temporary file of killed runs in {run} ({left[0]})" in said[1], said


TEMPS = [  # (where, name): every temporary file or folder a killed write leaves, and who removes it on the next start
    ("run", ".run.json.tmp-{pid}"), ("run", ".final.tmp-{pid}/"), ("run", ".final_engine.tmp-{pid}/"),
    ("run", ".final_engine.old-{pid}/"), ("run/checkpoints", ".step_000004.tmp-{pid}/"),
    ("", ".e.tmp-{pid}/"), ("", ".e.old-{pid}/"), ("", ".e.push-k2j4.tmp-{pid}/"), ("e", ".manifest.json.tmp-{pid}"),
    ("", ".m.tmp-{pid}/"),
]


@pytest.mark.parametrize("where,name", TEMPS, ids=[n.split("-")[0].strip(".") or n for _, n in TEMPS])
def test_every_killed_writes_temp_is_removed_on_the_next_start_and_a_live_ones_kept(tmp_path, model_dirs,
                                                                                   default_engine_dirs, where, name):
    """#12: files (not only folders) of a dead process go on the next start: a run's claim, an engine's guard
    (refit ppo, refit export, refit generate), build-model; the same name of a live process stays."""
    from refit.export.guard import guard_engine
    from refit.learner.build_model import build_model_cli
    from refit.learner.run.folder import claim

    cfg = _ppo(tmp_path, model_dirs[GPT2])
    _fake_run(tmp_path / "run", cfg)
    shutil.copytree(default_engine_dirs[GPT2], tmp_path / "e")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # another process, writing
    paths = []
    for pid in (_dead_pid(), live.pid):
        p = tmp_path / where / name.format(pid=pid).rstrip("/")
        (p / "x").mkdir(parents=True) if name.endswith("/") else p.write_text("{")
        paths.append(p)
    said = []
    try:
        if where.startswith("run"):
            claim(tmp_path / "run", cfg, resume=True, overwrite=False, log=said.append)
        elif name.startswith(".m."):
            build_model_cli("tiny-gpt2", tmp_path / "m", 0, False, False)
        else:
            guard_engine(model_dirs[GPT2], tmp_path / "e", log=said.append)
        assert not paths[0].exists() and paths[1].exists()
    finally:
        live.kill()
        live.wait()
    kind = "folder" if name.endswith("/") else "file"
    assert name.startswith(".m.") or any(f"removed 1 leftover temporary {kind} of killed runs" in s for s in said), \
        said


def _edit_manifest(engine: Path, fn) -> None:
    m = json.loads((engine / "manifest.json").read_text())
    fn(m)
    (engine / "manifest.json").write_text(json.dumps(m))


def test_a_manifest_without_attention_or_with_a_damaged_tokenizer_is_refused(capsys, tmp_path, model_dirs,
                                                                           default_engine_dirs):
    """#8, #10: the fused engine's manifest without its attention key; the engine's tokenizer.json truncated
    (covered by the manifest's hashes; an older folder without them: it must parse). generate refuses in one
    line, a training run does not reuse it."""
    from refit.export.guard import engine_damage, guard_engine

    e = tmp_path / "e"
    shutil.copytree(default_engine_dirs[GPT2], e)
    _edit_manifest(e, lambda m: m.pop("attention"))
    one_line(*refit(capsys, "generate", e, "--prompt", "12+34="), "is inconsistent: attention is absent (read as "
             "plain) but the decoder graph is fused (query_seqlens, seqlens_k inputs)")
    with pytest.raises(RefitError, match="has an unusable manifest"):
        guard_engine(model_dirs[GPT2], e)
    t = tmp_path / "t"
    shutil.copytree(default_engine_dirs[GPT2], t)
    assert "tokenizer.json" in json.loads((t / "manifest.json").read_text())["hashes"]["tokenizer_sha256"]
    f = t / "tokenizer/tokenizer.json"
    f.write_bytes(f.read_bytes()[:200])
    one_line(*refit(capsys, "generate", t, "--prompt", "12+34="), f"engine folder {t} is damaged: "
             "tokenizer/tokenizer.json does not match its manifest", "--overwrite")
    _edit_manifest(t, lambda m: m["hashes"].pop("tokenizer_sha256"))
    assert engine_damage(t).startswith("tokenizer/tokenizer.json is damaged (not JSON")
    said = []
    guard_engine(model_dirs[GPT2], t, log=said.append)
    assert "is damaged (tokenizer/tokenizer.json" in said[0] and not t.exists()  # exported again, not reused


def test_non_finite_weights_are_named(capsys, tmp_path, model_dirs):
    """#9: export (and every job: core.hf_folder.load_model) names the tensor and the count, not padding."""
    import torch
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(model_dirs[GPT2], m)
    w = load_file(str(m / "model.safetensors"))
    name = sorted(k for k in w if k.endswith("mlp.c_fc.weight"))[0]
    w[name][0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
    save_file(w, str(m / "model.safetensors"), metadata={"format": "pt"})
    for argv in (["export", m, "-o", tmp_path / "e"],
                 ["ppo", "--model.model_dir", m, "--rollout.backend", "torch", "-o", tmp_path / "run"]):
        one_line(*refit(capsys, *argv), f"model weights in {m} are not finite: {name} has 3 NaN or infinite values",
                 "replace it")
    assert not (tmp_path / "e").exists()


def test_disk_full_names_the_commands_own_way_out(capsys, monkeypatch):
    """#12: export and build-model have no --resume: each line names its own way to recover."""
    raised = {}
    mod = types.ModuleType("refit_fault_disk")
    mod.main = lambda argv: (_ for _ in ()).throw(raised["e"])
    monkeypatch.setitem(sys.modules, "refit_fault_disk", mod)
    for name, words in [("ppo", "then rerun (with --resume once the run has a checkpoint"),
                        ("export", "then rerun the same refit export"),
                        ("build-model", "then rerun the same refit build-model")]:
        monkeypatch.setitem(cli.COMMANDS, name, (mod.main, "test"))
        raised["e"] = OSError(errno.ENOSPC, "No space left on device", "out/x")
        rc, line = refit(capsys, name)
        assert rc == 2 and f"refit {name}: error: disk full while writing out/x: free space, {words}" in line, line
        assert name == "ppo" or "--resume" not in line, line


_RACER = """
import os, sys, time
from refit import cli
ready, n = sys.argv[1], int(sys.argv[2])
open(os.path.join(ready, str(os.getpid())), "w").close()
while len(os.listdir(ready)) < n:  # the barrier: every racer imported and ready
    time.sleep(0.001)
sys.exit(cli.main(sys.argv[3:]))
"""


def _race(tmp: Path, *argvs) -> list[subprocess.CompletedProcess]:
    """Run ``refit ARGV`` for each of ``argvs`` at once: separate processes released together by a barrier."""
    ready = tmp / f"ready-{len(list(tmp.glob('ready-*')))}"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "REFIT_FAULT_POINT"}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(ready), str(len(argvs)), *map(str, a)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    out = []
    for p, a in zip(procs, argvs):
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(a, p.returncode, stdout, stderr))
    return out


# one round in the fast suite; the 20 (REFIT_RACE_ROUNDS: fewer or more) as a slow test
RACE_ROUNDS = [pytest.param(1, id="1-round"),
               pytest.param(int(os.environ.get("REFIT_RACE_ROUNDS", "20")), marks=pytest.mark.slow, id="rounds")]


@pytest.mark.parametrize("rounds", RACE_ROUNDS)
def test_two_runs_started_together_on_one_folder_never_both_run(tmp_path, model_dirs, default_engine_dirs, rounds):
    """#1: two `refit ppo` (seeds 0 and 1) released by a barrier on one -o: one runs, the other is refused in
    one line naming the holder; the folder holds exactly the winner's run (its seed, steps 1 and 2 once)."""
    for i in range(rounds):
        run = tmp_path / f"run{i}"
        argv = _ppo_argv(model_dirs[GPT2], default_engine_dirs[GPT2], run, steps=2)
        results = _race(tmp_path, argv + ["--run.seed", "0"], argv + ["--run.seed", "1"])
        won = [r for r in results if r.returncode == 0]
        lost = [r for r in results if r.returncode != 0]
        assert len(won) == 1 and len(lost) == 1, [(r.returncode, r.stderr[-500:]) for r in results]
        line = lost[0].stderr.strip().splitlines()[-1]
        assert line.startswith(f"refit ppo: error: run folder {run} is in use by another Refit process (pid "), line
        seed = int(won[0].args[-1])
        assert json.loads((run / "run.json").read_text())["config"]["run.seed"] == seed
        assert [r["step"] for r in _rows(run) if r["step"] > 0] == [1, 2]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
        assert not [p.name for p in run.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
        print(f"ppo round {i}: seed {seed} ran; the other: {line}")


@pytest.mark.parametrize("rounds", RACE_ROUNDS)
def test_two_exports_started_together_to_one_folder_never_both_write(tmp_path, model_dirs, rounds):
    """#2: two `refit export` of different models released by a barrier to one -o: one writes, the other is
    refused in one line; the folder holds exactly one complete engine, the winner's. The two are tiny GPT-2s of
    other weights (the same work before the lock, so either may win: a tiny Llama beside it lost every round)."""
    import torch
    from safetensors.torch import load_file, save_file

    from refit.export.guard import engine_damage
    from refit.export.onnx_export import weights_hash

    other = tmp_path / "gpt2-other"
    shutil.copytree(model_dirs[GPT2], other)
    w = load_file(str(other / "model.safetensors"))
    save_file({k: v + 1e-3 if v.is_floating_point() else v for k, v in w.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    models = [model_dirs[GPT2], other]
    for i in range(rounds):
        e = tmp_path / f"e{i}"
        results = _race(tmp_path, *(["export", m, "-o", e, "--max_batch", "4", "--max_len", "32"] for m in models))
        won = [r for r in results if r.returncode == 0]
        lost = [r for r in results if r.returncode != 0]
        assert len(won) == 1 and len(lost) == 1, [(r.returncode, r.stderr[-500:]) for r in results]
        line = lost[0].stderr.strip().splitlines()[-1]
        assert line.startswith(f"refit export: error: engine folder {e} is in use by another Refit process (pid "), \
            line
        manifest = json.loads((e / "manifest.json").read_text())
        assert manifest["hashes"]["hf_weights_sha256"] == weights_hash(Path(won[0].args[1]))
        assert engine_damage(e) is None
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".e{i}.")) == [f".e{i}.lock"]
        print(f"export round {i}: {Path(won[0].args[1]).name} written; the other: {line}")


# ------------------------------------------------- issue 43: a user's files, locks, a full disk, a stop by signal

def _tree(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``folder`` (lock files and Refit's own temp names included)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_users_files_named_like_a_runs_are_never_taken_for_one(capsys, tmp_path, model_dirs):
    """43 #1: another tool's metrics.jsonl beside the user's config.yaml, and a user's checkpoints/my_model.pt,
    are not a run: refused with and without --overwrite, every byte kept (the old rule called both a run,
    replaced the first with --overwrite and deleted the second with no flag at all)."""
    p = ["ppo", "--model.model_dir", model_dirs[GPT2], "--model.engine_dir", tmp_path / "e", "--run.steps", "1"]
    tool, ckpt = tmp_path / "tool", tmp_path / "ckpt"
    (ckpt / "checkpoints").mkdir(parents=True)
    tool.mkdir()
    (tool / "config.yaml").write_text("mine: 1\n")
    (tool / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    (ckpt / "checkpoints/my_model.pt").write_bytes(b"weights")
    for f in (tool, ckpt):
        (f / "README").write_text("mine\n")
    before = {f: _tree(f) for f in (tool, ckpt)}
    for extra in ([], ["--overwrite"]):
        one_line(*refit(capsys, *p, "-o", tool, *extra), f"run folder {tool} holds files that are not a Refit run's",
                 "would replace config.yaml, metrics.jsonl (never done, --overwrite included)")
        one_line(*refit(capsys, *p, "-o", ckpt, *extra), "would replace checkpoints")
    assert {f: _tree(f) for f in (tool, ckpt)} == before
    (tool / "run.json").write_text('{"epoch": 3}')  # another tool's run.json proves nothing either
    one_line(*refit(capsys, *p, "-o", tool, "--overwrite"), "would replace config.yaml, metrics.jsonl, run.json")
    (tool / "run.json").write_text('{"run_id": ')  # damaged: cannot tell; nothing written or deleted
    one_line(*refit(capsys, *p, "-o", tool, "--overwrite"), "run.json is damaged (not JSON)", "writes and deletes "
             "nothing there")
    assert _tree(tool) == {**before[tool], "run.json": b'{"run_id": '}


def test_overwrite_deletes_only_what_the_run_wrote(tmp_path, model_dirs):
    """43 #1: a run written beside the user's files (--overwrite into a folder of other files) records them as
    foreign; a later --overwrite deletes the run's own files only, and inside checkpoints/ only its step_N."""
    from refit.learner.run.folder import claim

    run, cfg = tmp_path / "run", _ppo(tmp_path, model_dirs[GPT2])
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    said = []
    record = claim(run, cfg, resume=False, overwrite=True, log=said.append)
    assert record["foreign"] == ["notes.txt"] and record["format"] == "refit-run/1"
    from refit.learner.run.folder import write_record

    write_record(run, record)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints/step_000001").mkdir(parents=True)
    (run / "checkpoints/mine.pt").write_bytes(b"x")  # a user's file dropped in later
    claim(run, cfg, resume=False, overwrite=True, log=said.append)
    assert "--overwrite: deleting run" in said[-2] and "keeping notes.txt (not the run's)" in said[-2], said
    assert "kept 1 file(s) in" in said[-1] and "mine.pt" in said[-1], said
    assert (run / "notes.txt").read_text() == "mine" and (run / "checkpoints/mine.pt").read_bytes() == b"x"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints/step_000001").exists()


def test_a_finished_commands_lock_is_not_an_abandoned_one(tmp_path):
    """43 #3: an export that exits normally shares its engine folder's lock, leaving no pid in it; the next
    process takes the lock without "ended without releasing it". A holder killed mid-write is still named."""
    from refit.core.integrity import hold_folder

    done, killed = tmp_path / ".done.lock", tmp_path / ".killed.lock"
    code = ("import sys, os; from refit.core.integrity import hold_folder, share_folder; hold_folder(sys.argv[1], 'x'); "
            "share_folder(sys.argv[1]) if sys.argv[2] == 'share' else os._exit(137)")
    for lock, how in ((done, "share"), (killed, "kill")):
        subprocess.run([sys.executable, "-c", code, str(lock), how], check=how == "share")
    assert done.read_text() == "" and killed.read_text().startswith("pid ")
    said = []
    hold_folder(done, "engine folder done", said.append)
    hold_folder(killed, "engine folder killed", said.append)
    assert len(said) == 1 and "engine folder killed was held by pid" in said[0], said


def test_an_extended_runs_final_engine_is_replaced_as_its_own(tmp_path, model_dirs, default_engine_dirs):
    """43 #2: --resume with more steps ends again; the final_engine of the earlier end (other weights) is the run's
    own and is replaced, where the old rule refused it as "another process exported into it" and pointed at
    --overwrite (which deletes the run). One the run found there is never touched."""
    from refit.learner.run.final import _clear_own_engine
    from refit.learner.run.folder import claim, write_record

    run, cfg = tmp_path / "run", _ppo(tmp_path, model_dirs[GPT2])
    write_record(run, claim(run, cfg, resume=False, overwrite=False, log=lambda *_: None))
    shutil.copytree(default_engine_dirs[GPT2], run / "final_engine")  # the earlier end's (the GPT-2's weights)
    said = []
    _clear_own_engine(run, model_dirs["tiny-llama"], said.append)  # this end's final/: other weights
    assert not (run / "final_engine").exists() and "replacing" in said[0], said
    shutil.copytree(default_engine_dirs[GPT2], run / "final_engine")
    _clear_own_engine(run, model_dirs[GPT2], said.append)  # the same weights: kept (the export reuses it)
    assert (run / "final_engine/manifest.json").is_file()
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "foreign": ["final_engine"]}))
    with pytest.raises(RefitError, match="holds an engine folder that this run did not write"):
        _clear_own_engine(run, model_dirs["tiny-llama"], said.append)
    assert (run / "final_engine/manifest.json").is_file()


def _tinyfs(tmp_path: Path, size: str) -> Path:
    """A tmpfs of ``size`` mounted at tmp_path/fs (unmounted at the end of the test); skipped where mounting is not
    allowed (not root, a container without CAP_SYS_ADMIN)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(fs)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.decode().strip()[:80]})")
    return fs


def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_keeps_the_last(tmp_path):
    """43 #4: torch.save on a full disk says only "[enforce fail at inline_container.cc] unexpected pos"; the
    atomic write names it as a full disk and the folder, the previous checkpoint stays whole, no temp is left;
    the run loop turns it into one line naming the run's last intact checkpoint and --resume."""
    import torch

    from refit.core.integrity import atomic_folder
    from refit.learner.run.loop import Job, run_job

    fs = _tinyfs(tmp_path, "256k")
    try:
        (fs / "step_1").mkdir()
        (fs / "step_1/state.json").write_text("{}")
        with pytest.raises(OSError) as e:
            with atomic_folder(fs / "step_2") as tmp:
                tmp.mkdir()
                torch.save({"w": torch.zeros(200_000)}, tmp / "trainer.pt")
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(fs / "step_2")
        assert sorted(os.listdir(fs)) == ["step_1"] and (fs / "step_1/state.json").read_text() == "{}"
    finally:  # lazily: a file torch's failed writer still holds open would keep a plain umount busy
        import gc

        gc.collect()
        subprocess.run(["umount", "-l", str(fs)], check=False)
    cfg = types.SimpleNamespace(run=types.SimpleNamespace(output_dir=str(tmp_path / "r")))
    (tmp_path / "r/checkpoints/step_000002").mkdir(parents=True)
    (tmp_path / "r/checkpoints/step_000002/state.json").write_text("{}")

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r/checkpoints/step_000004"))

    import refit.learner.run.loop as loop

    job = Job("ppo", setup=full, step=full, save=full, engines=lambda s: [], postfix=dict)
    orig = loop._run_job
    loop._run_job = lambda job, cfg, *a: job.setup(cfg)
    try:
        with pytest.raises(RefitError, match=r"disk full while writing .*step_000004: free space; .*r keeps checkpoint "
                                             r"step_000002: continue with the same command and --resume"):
            run_job(job, cfg)
    finally:
        loop._run_job = orig


def test_sigterm_stops_a_run_in_one_line_saying_what_it_kept(tmp_path, model_dirs, default_engine_dirs):
    """43 #12: SIGTERM (a scheduler's stop) unwinds the run as Ctrl-C does: exit 143, one line naming the last
    checkpoint and --resume, the folder's lock released (no pid left), no temporary folder left; --resume goes on."""
    import signal
    import time

    run = tmp_path / "run"
    argv = _ppo_argv(model_dirs[GPT2], default_engine_dirs[GPT2], run, steps=5000)
    argv[argv.index("--ckpt.save_steps") + 1] = "1"
    p = subprocess.Popen([sys.executable, "-m", "refit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={k: v for k, v in os.environ.items() if k != "REFIT_FAULT_POINT"})
    deadline = time.time() + 300
    # any checkpoint: the run keeps only its newest few, so step_000001 may be gone before a poll sees it
    while not list((run / "checkpoints").glob("step_*")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be stopped: give it more steps"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("refit ppo: stopped by SIGTERM; ") and "keeps checkpoint step_0000" in line and \
        "continue with the same command and --resume" in line, line
    assert (run / ".refit.lock").read_text() == "" and not list(run.rglob("*.tmp-*"))


def test_an_engine_folder_with_a_users_file_is_never_replaced(capsys, tmp_path, model_dirs, default_engine_dirs):
    """43 (engine folders): a file an export did not write inside an engine folder stops any replacement of that
    folder (--overwrite of another model's engine, a re-export with other options), in one line naming it; a
    manifest.json of another tool's is not an engine folder."""
    from refit.export.guard import guard_engine

    e = tmp_path / "e"
    shutil.copytree(default_engine_dirs[GPT2], e)
    (e / "notes.txt").write_text("mine")
    before = _tree(e)
    with pytest.raises(RefitError, match=r"engine folder .*e also holds notes.txt, which no export wrote"):
        guard_engine(model_dirs["tiny-llama"], e, overwrite=True, log=lambda *_: None)
    one_line(*refit(capsys, "export", model_dirs[GPT2], "-o", e, "--max_len", "96"), "also holds notes.txt")
    assert _tree(e) == before
    web = tmp_path / "web"
    web.mkdir()
    (web / "manifest.json").write_text('{"name": "my app", "icons": []}')
    one_line(*refit(capsys, "export", model_dirs[GPT2], "-o", web, "--overwrite"), "holds other files, not an engine")
    assert _tree(web) == {"manifest.json": b'{"name": "my app", "icons": []}'}
