"""Configs and the one parser: YAML sections vs flags, old flat names, unknown keys, --help, config.yaml round trip.

Cheap: nothing here builds a model or an engine.
"""

from __future__ import annotations

import dataclasses

import pytest

from refit.bench.cli import BENCHES
from refit.rollout.build import ExportConfig
from refit.core.errors import RefitError
from refit.core.parsing import flat_leaves, leaves, parse
from refit.cli import main as refit
from refit.learner.distill.config import DistillConfig
from refit.learner.demo import DemoConfig
from refit.learner.ppo.config import PPOConfig
from refit.learner.run.config import flat_names, parse_job, save_config
from refit.rollout.cli import GenerateConfig

COMMANDS = [(["ppo"], PPOConfig), (["distill"], DistillConfig), (["export"], ExportConfig),
            (["generate"], GenerateConfig), (["demo"], DemoConfig)] + [(["bench", n], c) for n, c in BENCHES.items()]


def _yaml(tmp_path, text: str):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    return str(f)


def test_yaml_sections_then_flags_precedence(tmp_path):
    f = _yaml(tmp_path, "run: {steps: 7, seed: 3}\noptim: {learning_rate: 1e-4, warmup_steps: 5}\nkl_coef: 0.2\n"
                        "scale: {workers: 2}\n")
    cfg, _ = parse_job(PPOConfig, ["--config", f, "--run.steps", "9", "--optim.warmup-steps", "6"], "refit ppo")
    assert (cfg.run.steps, cfg.run.seed) == (9, 3)  # flag over YAML; YAML over default
    assert (cfg.optim.learning_rate, cfg.optim.warmup_steps, cfg.kl_coef, cfg.scale.workers) == (1e-4, 6, 0.2, 2)
    assert cfg.run.output_dir == "runs/ppo" and cfg.scale.worker_cpus == 1.0  # PPO's defaults where YAML is silent
    d, _ = parse_job(DistillConfig, ["--config", _yaml(tmp_path, "teacher: {model_dir: t}\nlmbda: 0\n")],
                     "refit distill")
    assert (d.teacher.model_dir, d.lmbda, d.optim.learning_rate, d.scale.worker_cpus) == ("t", 0.0, 3e-3, 0.5)


def test_per_job_defaults_unchanged():
    p, d = PPOConfig(), DistillConfig()
    assert (p.run.output_dir, p.run.steps, p.optim.learning_rate, p.optim.warmup_steps, p.ckpt.save_steps,
            p.scale.worker_cpus, p.data.num_prompts, p.data.max_operand) == ("runs/ppo", 20, 5e-5, 0, 10, 1.0, 512, 30)
    assert (d.run.output_dir, d.run.steps, d.optim.learning_rate, d.optim.warmup_steps, d.ckpt.save_steps,
            d.scale.worker_cpus, d.data.num_prompts, d.data.max_operand) == ("runs/distill", 300, 3e-3, 10, 100, 0.5,
                                                                             1000, 9)


def test_flat_names_give_the_same_config_and_one_deprecation_line(tmp_path, capsys):
    new = ["--scale.workers", "2", "--optim.learning_rate", "1e-3", "--log.no_progress", "--model.model_dir", "m",
           "--cliprange", "0.3"]
    old = ["--rollout_workers", "2", "--learning-rate", "1e-3", "--progress", "false", "--model_dir", "m",
           "--cliprange", "0.3"]
    want, _ = parse_job(PPOConfig, new, "refit ppo")
    assert capsys.readouterr().err == ""
    got, _ = parse_job(PPOConfig, old, "refit ppo")
    err = capsys.readouterr().err.strip().splitlines()
    assert got == want and len(err) == 1
    assert all(s in err[0] for s in ("--rollout_workers -> --scale.workers", "--progress -> --log.progress",
                                     "--learning-rate -> --optim.learning_rate", "--model_dir -> --model.model_dir"))
    # YAML: flat keys, and the section spelling of the release before (`rollout: {workers: N}`)
    f = _yaml(tmp_path, "rollout_workers: 2\nlearning_rate: 1.0e-3\nprogress: false\nmodel_dir: m\ncliprange: 0.3\n")
    assert parse_job(PPOConfig, ["--config", f], "refit ppo")[0] == want
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout_workers -> scale.workers" in err[0], err
    f = _yaml(tmp_path, "rollout: {workers: 2}\noptim: {learning_rate: 1.0e-3}\nlog: {progress: false}\n"
                        "model: {model_dir: m}\ncliprange: 0.3\n")
    assert parse_job(PPOConfig, ["--config", f], "refit ppo")[0] == want
    assert "rollout.workers -> scale.workers" in capsys.readouterr().err
    # distill's role-prefixed names and HfArgumentParser's `--no_X`
    d, _ = parse_job(DistillConfig, ["--student_model_dir", "s", "--no_tensorboard", "--seq_kd", "true",
                                     "--loss", "ce", "--lmbda", "0"], "refit distill")
    assert (d.student.model_dir, d.log.tensorboard, d.seq_kd) == ("s", False, True)
    assert DistillConfig.from_flat(student_model_dir="s", tensorboard=False, seq_kd=True, loss="ce", lmbda=0.0) == d


def test_from_flat_is_the_nested_config():
    cfg = PPOConfig.from_flat(model_dir="m", steps=3, rollout_workers=2, kl_coef=0.1)
    want = PPOConfig(run=dataclasses.replace(PPOConfig().run, steps=3), model=dataclasses.replace(PPOConfig().model,
                     model_dir="m"), scale=dataclasses.replace(PPOConfig().scale, workers=2), kl_coef=0.1)
    assert cfg == want
    assert set(flat_names(PPOConfig)) | {f.name for f in dataclasses.fields(PPOConfig)} >= {"rollout_workers", "seed"}


def test_unknown_key_or_flag_is_one_line(tmp_path, capsys):
    with pytest.raises(RefitError, match=r"unknown field rollout\.nope") as e:
        parse_job(PPOConfig, ["--config", _yaml(tmp_path, "rollout: {nope: 1, backend: torch}\n")], "refit ppo")
    assert "\n" not in str(e.value)
    with pytest.raises(RefitError, match=r"rollout\.backend: 'nope' is not one of"):
        parse_job(PPOConfig, ["--config", _yaml(tmp_path, "rollout: {backend: nope}\n")], "refit ppo")
    assert refit(["ppo", "--model.model_dir", "m", "--bogus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bogus" in err[0], err


@pytest.mark.parametrize("argv,cls", COMMANDS, ids=[" ".join(a) for a, _ in COMMANDS])
def test_help_lists_every_field_with_its_help(argv, cls, capsys):
    with pytest.raises(SystemExit) as e:
        refit([*argv, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    flat = {path: name for name, path in flat_leaves(cls).items()}  # FLAT sections (bench, sampling): no prefix
    for path in leaves(cls):
        flag = flat.get(path, path)
        field = _field(cls, path)
        assert f"--{flag}" in text or field.name in ("model_dir", "engine_dir") and "DIR" in text, path
        assert " ".join(field.metadata["help"].split()) in text, path
    assert "--config" in text


def _field(cls, path: str) -> dataclasses.Field:
    *sections, leaf = path.split(".")
    for s in sections:
        cls = next(f for f in dataclasses.fields(cls) if f.name == s).default_factory().__class__
    return next(f for f in dataclasses.fields(cls) if f.name == leaf)


@pytest.mark.parametrize("cls,kw", [
    (PPOConfig, dict(model_dir="m", steps=4, learning_rate=1e-4, rollout_workers=2, top_k=5, progress=False,
                     mismatch_correction="tis", backend="torch")),
    (DistillConfig, dict(student_model_dir="s", teacher_engine_dir="te", loss="ce", seq_kd=True, lmbda=0.0,
                         warmup_steps=0, rollout_worker_gpus=0.5, temperature=0.7, loss_temperature=0.7)),
])
def test_saved_config_yaml_loads_back_equal(cls, kw, tmp_path, capsys):
    cfg = cls.from_flat(**kw)
    text = save_config(cfg, tmp_path / "config.yaml")
    assert "optim:\n" in text and "scale:\n" in text  # the sectioned layout
    back, _ = parse_job(cls, ["--config", str(tmp_path / "config.yaml")], "refit")
    assert back == cfg and capsys.readouterr().err == ""  # no deprecation: the saved layout is the new one


def test_flat_sampling_section_keeps_its_spellings(tmp_path, capsys):
    """top_k/top_p live in the shared Sampling section (a FLAT one): flags, YAML keys, from_flat and the saved
    config.yaml spell them as before, unprefixed and with no deprecation line."""
    want = PPOConfig.from_flat(top_k=5, top_p=0.9)
    assert (want.sampling.top_k, want.sampling.top_p) == (5, 0.9)
    assert parse_job(PPOConfig, ["--top_k", "5", "--top-p", "0.9"], "refit ppo")[0] == want
    assert parse_job(PPOConfig, ["--config", _yaml(tmp_path, "top_k: 5\ntop_p: 0.9\n")], "refit ppo")[0] == want
    text = save_config(want, tmp_path / "config.yaml")
    assert "\ntop_k: 5\ntop_p: 0.9\n" in text and "\nsampling:" not in text  # (importance_sampling_level is a PPO field)
    g, _ = parse(GenerateConfig, ["e", "--top_k", "3", "--config", _yaml(tmp_path, "top_p: 0.5\n")], "refit generate")
    assert (g.sampling.top_k, g.sampling.top_p) == (3, 0.5)
    assert capsys.readouterr().err == ""


def test_one_sampling_section_for_every_job_and_the_engine(tmp_path, capsys):
    """temperature, top_k and top_p are one section (refit.rollout.config.Sampling) in ppo, distill and generate,
    spelled the same in each, and SamplingParams is made from it in one place (Sampling.params)."""
    from refit.rollout.config import Sampling
    from refit.rollout.types import SamplingParams

    flags = ["--temperature", "0.7", "--top_k", "5", "--top_p", "0.9"]
    want = Sampling(temperature=0.7, top_k=5, top_p=0.9)
    assert parse_job(PPOConfig, flags, "refit ppo")[0].sampling == want
    assert parse_job(DistillConfig, flags, "refit distill")[0].sampling == want
    assert parse(GenerateConfig, ["e", *flags], "refit generate")[0].sampling == want
    for cls in (PPOConfig, DistillConfig, GenerateConfig):
        assert {"temperature", "top_k", "top_p"} <= set(flat_leaves(cls))
        assert not any(p.endswith(".temperature") and not p.startswith("sampling.") for p in leaves(cls))
    assert capsys.readouterr().err == ""
    # every Sampling field is a SamplingParams field of the same meaning; params() keeps the call's own fields
    assert {f.name for f in dataclasses.fields(Sampling)} <= {f.name for f in dataclasses.fields(SamplingParams)}
    assert want.params(12, n=2, seed=4, stop_ids=(3,)) == SamplingParams(
        max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9, n=2, seed=4, stop_ids=(3,))
    # rollout.temperature, where PPO and distill kept it before: read, with one deprecation line naming the new name
    old, _ = parse_job(PPOConfig, ["--rollout.temperature", "0.7", "--top_k", "5", "--top_p", "0.9"], "refit ppo")
    assert old.sampling == want and "--rollout.temperature -> --temperature" in capsys.readouterr().err
    f = _yaml(tmp_path, "rollout: {temperature: 0.7, backend: torch}\n")
    d, _ = parse_job(DistillConfig, ["--config", f], "refit distill")
    assert (d.sampling.temperature, d.rollout.backend) == (0.7, "torch")
    assert "rollout.temperature -> temperature" in capsys.readouterr().err
    assert PPOConfig.from_flat(temperature=0.7).sampling.temperature == 0.7
