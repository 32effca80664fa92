"""Job configs: one frozen dataclass per job, parsed from YAML and flags by HfArgumentParser.

Field names follow TRL's ``PPOConfig`` where TRL has a name (``learning_rate``, ``num_ppo_epochs``,
``num_mini_batches``, ``gradient_accumulation_steps``, ``cliprange``, ``cliprange_value``,
``vf_coef``, ``gamma``, ``lam``, ``kl_coef``, ``kl_estimator``, ``whiten_rewards``,
``response_length``, ``temperature``, ``adap_kl_ctrl``/``target``/``horizon`` from TRL < 0.12).
Precedence: defaults < YAML file (``--config``) < command-line flags. The resolved config is
printed and saved with the run (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path

import yaml

from export.errors import RefitError


def _f(default, help_: str, **kw):
    return field(default=default, metadata={"help": help_, **kw})


def parse_config(cls, argv: list[str] | None, prog: str):
    """``--config FILE.yaml`` plus flags -> a frozen ``cls``; unknown YAML keys are an error."""
    import argparse

    from transformers import HfArgumentParser

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(cls, prog=prog, description=cls.__doc__)
    parser.add_argument("--config", default=None, help="YAML file with any of the fields below; flags override it")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    if known.config:
        path = Path(known.config)
        if not path.exists():
            raise RefitError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        values = _flatten_sections(values, names)
        unknown = sorted(set(values) - names)
        if unknown:
            raise RefitError(f"config file {path}: unknown fields {unknown}")
        parser.set_defaults(**values)
    # -> (cfg, namespace of the non-dataclass flags, remaining strings)
    outs = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    cfg, extra = outs[0], outs[-1]
    if extra:
        raise RefitError(f"unknown arguments: {' '.join(extra)}")
    resume = any(getattr(o, "resume", False) for o in outs[1:-1])
    return cfg, resume


def _flatten_sections(values: dict, names: set[str]) -> dict:
    """``rollout: {workers: 2, ray_address: auto}`` -> ``rollout_workers: 2, ray_address: auto``.

    A YAML mapping under a key that is not a field is a section: each ``key: value`` in it becomes the
    field ``SECTION_key`` if there is one, else ``key``; anything else stays as it is (and is reported
    as unknown). Flags stay flat (``--rollout_workers 2``).
    """
    out = {}
    for k, v in values.items():
        if isinstance(v, dict) and k not in names:
            for sub, x in v.items():
                flat = f"{k}_{sub}" if f"{k}_{sub}" in names else sub if sub in names else f"{k}.{sub}"
                out[flat] = x
        else:
            out[k] = v
    return out


def save_config(cfg, path: Path) -> str:
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    path.write_text(text)
    return text
