"""One validation pass for every command's config, before any work starts: the value ranges.

Every ``refit`` command (``generate``, ``export``, ``ppo``, ``distill``, ``bench``) parses its flags
and YAML into a frozen dataclass (:func:`refit.core.parsing.parse`), and :func:`validate` then walks
every leaf field and checks it against :data:`RULES`, the one table of ranges. A field is matched by
its dotted path first (``run.device``), else by its own name (``temperature``): the same name means
the same thing in every command, so ``--temperature 0`` is refused by ``generate`` exactly as
``--loss_temperature 0`` is by ``distill``. A refusal is one line naming the field, the value and the
allowed range::

    config: optim.learning_rate = nan is out of range; allowed: >= 0 (a finite number)

Fields the table does not name are not range-checked (strings, paths, bools, choices that tyro
already restricts with ``Literal``). A tuple field (``reward_weights``) has each element checked.
Cross-field rules (``save_steps`` a multiple of ``sync_every``, ...) stay in the configs'
``__post_init__`` (:func:`refit.learner.run.config.check`).

Decisions:

- ``ckpt.keep_checkpoints``: >= 0; **0 keeps every checkpoint**, N >= 1 keeps the newest N.
- ``optim.learning_rate``: finite and >= 0 (0 is a legitimate frozen run, e.g. to measure the KL floor).
- ``rollout.probe_tol``: > 0 (engine and learner never agree to the last bit; 0 would fail every push).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass

from refit.core.errors import RefitError


@dataclass(frozen=True)
class Rule:
    """An allowed range: ``lo`` / ``hi`` bounds (open or closed), finite numbers, or a pattern for strings."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    pattern: str | None = None  # a string field: a full match of this regular expression
    text: str = ""  # the allowed range in words (default: from the bounds)
    also: tuple = ()  # extra values allowed outside the range (worker_gpus -1, parity_tol None)

    def ok(self, v) -> bool:
        if v in self.also and not isinstance(v, bool):
            return True
        if self.pattern is not None:
            return isinstance(v, str) and re.fullmatch(self.pattern, v) is not None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def describe(self) -> str:
        if self.text:
            return self.text
        lo = f"{'>' if self.lo_open else '>='} {self.lo:g}" if self.lo is not None else ""
        hi = f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else ""
        if lo and hi:
            rng = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        else:
            rng = lo or hi
        return (f"{rng} (a finite number)" if rng else "a finite number") + (f", or {', '.join(map(str, self.also))}" if self.also else "")


POSITIVE = Rule(lo=0, lo_open=True)
NON_NEGATIVE = Rule(lo=0)
COUNT = Rule(lo=1, text=">= 1 (a whole number)")
COUNT0 = Rule(lo=0, text=">= 0 (a whole number)")
UNIT = Rule(lo=0, hi=1)
PROBABILITY = Rule(lo=0, hi=1, lo_open=True)
FINITE = Rule()

# path or field name -> its allowed range (a path wins over a name)
RULES: dict[str, Rule] = {
    # sampling (generate, ppo, distill, bench)
    "temperature": POSITIVE, "loss_temperature": POSITIVE,
    "top_p": PROBABILITY, "top_k": COUNT0, "min_p": UNIT, "repetition_penalty": POSITIVE,
    "max_new_tokens": COUNT, "response_length": COUNT, "new_tokens": COUNT, "prompt_len": COUNT,
    "n": COUNT, "num_generations": COUNT,
    # sizes and counts
    "batch_size": COUNT, "steps": COUNT, "max_steps_this_run": COUNT0, "num_ppo_epochs": COUNT,
    "num_mini_batches": COUNT, "gradient_accumulation_steps": COUNT, "sync_every": COUNT,
    "probe_size": COUNT, "probe_tokens": COUNT0, "engine_threads": COUNT0, "engine_shards": COUNT0, "shards": COUNT,
    "micro_batch_rows": COUNT0,
    "threads": COUNT0, "max_staleness": COUNT0,
    "num_prompts": COUNT, "max_operand": COUNT, "eval_size": COUNT, "eval_every": COUNT, "eval_steps": COUNT0,
    "eval_max_prompts": COUNT0, "teacher_sft_steps": COUNT0, "teacher_topk": COUNT, "warmup_steps": COUNT0,
    "max_batch": COUNT, "max_len": Rule(lo=2, text=">= 2 (a whole number)"), "repeats": COUNT, "rows": COUNT,
    "slots": COUNT, "workers": COUNT, "scale.workers": COUNT,
    "batch_sizes": Rule(pattern=r"[1-9]\d*(,[1-9]\d*)*", text="a comma list of whole numbers >= 1 (e.g. 1,8,32)"),
    # checkpoints
    "ckpt.save_steps": COUNT,
    "ckpt.keep_checkpoints": Rule(lo=0, text=">= 0 (0 keeps every checkpoint, N keeps the newest N)"),
    # optimizer
    "learning_rate": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "max_grad_norm": POSITIVE,
    "adam_epsilon": NON_NEGATIVE, "neftune_noise_alpha": NON_NEGATIVE,
    "ref_model_mixup_alpha": UNIT, "ref_model_sync_steps": COUNT, "num_generations_eval": COUNT0,
    # PPO
    "cliprange": POSITIVE, "cliprange_value": POSITIVE, "vf_coef": NON_NEGATIVE, "entropy_coef": FINITE,
    "entropy_target": Rule(also=(None,)), "entropy_coef_delta": NON_NEGATIVE, "entropy_coef_min": FINITE,
    "entropy_coef_max": FINITE, "router_aux_loss_coef": FINITE,
    "gamma": UNIT, "lam": UNIT, "kl_coef": NON_NEGATIVE, "target": POSITIVE, "horizon": POSITIVE,
    "tis_cap": POSITIVE, "tis_warn_below": NON_NEGATIVE, "seq_mask_threshold": POSITIVE,
    "reward_weights": FINITE,
    # distill
    "lmbda": UNIT, "beta": UNIT,
    # engines and probes
    "rollout.probe_tol": POSITIVE, "parity_tol": Rule(lo=0, lo_open=True, also=(None,)),
    "eval_fraction": Rule(lo=0, hi=1, hi_open=True), "stop_frac": PROBABILITY,
    "scale.worker_cpus": POSITIVE, "scale.worker_gpus": Rule(lo=0, also=(-1, -1.0)),
    # devices
    "run.device": Rule(pattern=r"auto|cpu|cuda(:\d+)?", text="auto, cpu, cuda or cuda:N"),
}


def _leaves(obj, prefix: str = ""):
    """(dotted path, spelled name, value) of every leaf field of a dataclass instance."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            flat = any(getattr(m, "name", None) == "" for m in typing.get_args(hints.get(f.name))[1:])
            yield from _leaves(v, prefix if flat else f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f.name, v


def problems(cfg) -> list[str]:
    """Every out-of-range field of ``cfg`` as one line each (empty: all fine)."""
    out = []
    for path, name, value in _leaves(cfg):
        rule = RULES.get(path) or RULES.get(name)
        if rule is None:
            continue
        for v in (value if isinstance(value, tuple) else (value,)):
            if not rule.ok(v):
                out.append(f"config: {path} = {v!r} is out of range; allowed: {rule.describe()}")
                break
    return out


def validate(cfg):
    """``cfg`` when every field is in range, else the first refusal as one RefitError line."""
    bad = problems(cfg)
    if bad:
        raise RefitError(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return cfg
