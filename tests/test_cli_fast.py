"""The front door answers a mistake before the heavy imports, names a Hub id's way out, lists every bench, and keeps
the libraries' notes off the terminal unless --verbose (issue 43, items 8-11)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from refit import cli
from refit.bench.cli import BENCHES, HELP, main as bench_main
from refit.core.errors import RefitError
from refit.core.hf_folder import download_hint, read_config
from refit.learner.demo import DemoConfig
from refit.learner.distill.config import DistillConfig
from refit.learner.ppo.config import PPOConfig
from refit.rollout.config import ExportConfig, GenerateConfig

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "onnxruntime", "peft")

# Each command line is run by refit.cli.main in one child process; what it prints, and which heavy modules were
# loaded by the time it answered. The answer must come from the torch-free parse step.
_CHILD = """
import contextlib, io, json, sys
from refit.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out.append([rc, err.getvalue().strip().splitlines()[-1], sorted(m for m in %r if m in sys.modules)])
print(json.dumps(out))
""" % (HEAVY,)


def _run(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str, list[str]]]:
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_parse_path_imports_no_torch():
    code = ("import sys, refit.cli\n"
            "from refit.learner.ppo.config import parse_ppo\nfrom refit.learner.distill.config import parse_distill\n"
            "from refit.rollout.config import parse_export, parse_generate\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-1000:])


def test_mistakes_are_answered_before_the_heavy_imports(tmp_path):
    (tmp_path / "bad.yaml").write_text("run:\n  steps: 3\n  batch_size: [4\n")
    cases = [  # (argv, words of the one line)
        (["ppo", "--run.step", "3"], ["unknown arguments: --run.step (did you mean run.steps?)"]),
        (["ppo", "--model.model_dir", "nope"], ["model folder nope does not exist"]),
        (["ppo", "--config", "bad.yaml"], ["config file bad.yaml is not valid YAML at line 4"]),
        (["ppo", "--model.model_dir", "Qwen/Qwen2.5-0.5B"], ["Refit downloads nothing", "hf download"]),
        (["export", "Qwen/Qwen2.5-0.5B"], ["Refit downloads nothing",
                                           "hf download Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B"]),
        (["export", "nope", "-o", "e"], ["model folder nope does not exist"]),
        (["generate", "nope", "--prompt", "1+1="], ["engine folder nope does not exist"]),
        (["distill", "--teacher.model_dir", "org/teacher"], ["Refit downloads nothing"]),
        (["distill", "--lmbda", "2"], ["lmbda = 2.0"]),
    ]
    results = _run([a for a, _ in cases], tmp_path)
    for (argv, words), (rc, line, heavy) in zip(cases, results):
        assert rc == 2 and line.startswith(f"refit {argv[0]}: error: "), (argv, line)
        assert all(w in line for w in words), (argv, line)
        assert heavy == [], (argv, heavy)  # answered by the parse step, before any of them was imported
    assert list(tmp_path.iterdir()) == [tmp_path / "bad.yaml"]  # no run folder made for a refused line


def test_a_hub_id_is_told_refit_downloads_nothing_and_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RefitError) as e:
        read_config("Qwen/Qwen2.5-0.5B")
    assert str(e.value) == ("model folder Qwen/Qwen2.5-0.5B does not exist (a Hugging Face Hub id?): Refit downloads "
                            "nothing; give a save_pretrained folder (config.json, weights, tokenizer); on a connected "
                            "machine `hf download Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B` fetches one "
                            "(huggingface_hub)")
    (tmp_path / "models").mkdir()  # models/tiny under an existing folder is a path not built yet, not a Hub id
    with pytest.raises(RefitError, match=r"^model folder models/tiny does not exist$"):
        read_config("models/tiny")
    from refit.learner.trl.common import resolve_model  # the TRL facade says the same, from the same helper
    with pytest.raises(RefitError) as e:
        resolve_model("Qwen/Qwen2.5-0.5B", None, tmp_path / "x")
    assert download_hint("Qwen/Qwen2.5-0.5B") in str(e.value) and "hf download" in str(e.value)


def test_every_bench_is_listed_and_named_by_refit_help(capsys):
    assert list(HELP) == [*BENCHES, "lora"]
    assert bench_main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.splitlines()[0] == "usage: refit bench {generate,refit,ppo,grpo,workers,inflight,lora} [options]"
    assert all(f"  {name:<10} {help_}" in usage for name, help_ in HELP.items())
    with pytest.raises(RefitError, match="unknown bench 'lroa'; one of generate, refit, ppo, grpo, workers, "
                                         "inflight, lora$"):
        bench_main(["lroa"])
    assert ", ".join(HELP) in cli.COMMANDS["bench"][1]  # refit --help's line for bench


def _helps(cls, seen=()) -> list[tuple[str, str]]:
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        tp = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
        out.append((f"{cls.__name__}.{f.name}", f.metadata.get("help", "")))
        if dataclasses.is_dataclass(tp):
            out += _helps(tp)
    return out


@pytest.mark.parametrize("cls", [PPOConfig, DistillConfig, ExportConfig, GenerateConfig, DemoConfig, *BENCHES.values()],
                         ids=lambda c: c.__name__)
def test_no_help_text_says_its_default_twice(cls):
    """tyro adds "(default: ...)" to every field with a default: a help text that says one too prints two."""
    assert [name for name, h in _helps(cls) if "(default:" in h] == []


def test_quiet_keeps_the_libraries_notes_off_the_terminal_and_verbose_lets_them_through():
    code = """
import json, logging, os, sys
from refit.core.noise import quiet, verbose
quiet(sys.argv[1] == "verbose")
from transformers.utils import logging as tl
import warnings
with warnings.catch_warnings(record=True) as shown:  # the filters quiet() set, kept; what passes them, recorded
    warnings.warn_explicit("peft's note", UserWarning, "layer.py", 1, module="peft.tuners.lora.layer")
    warnings.warn_explicit("a deprecation", FutureWarning, "m.py", 1, module="transformers.modeling_utils")
    warnings.warn_explicit("Refit's own", UserWarning, "lora.py", 1, module="refit.learner.run.lora")
print(json.dumps([verbose(), tl.get_verbosity(), tl.is_progress_bar_enabled(),
                  logging.getLogger("torch.onnx._internal.exporter._registration").getEffectiveLevel(),
                  [str(w.message) for w in shown]]))
"""
    got = {}
    for mode in ("quiet", "verbose"):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr[-1000:]
        got[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["quiet"] == [False, logging.ERROR, False, logging.ERROR, ["Refit's own"]]
    assert got["verbose"][:3] == [True, logging.WARNING, True] and got["verbose"][3] < logging.ERROR
    assert got["verbose"][4] == ["peft's note", "a deprecation", "Refit's own"]
