"""Rewards: Python functions in TRL's signature, or an HF sequence-classification folder; several, weighted.

A reward function is called as TRL's ``GRPOTrainer`` calls it::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

``columns`` are the dataset's other columns for exactly those rows (``answer=[...]``, ...). For a text
prompt the completion is the decoded text; for a chat prompt (a list of messages) it is
``[{"role": "assistant", "content": text}]``, as in TRL. A function without ``**kwargs`` gets only the
keywords it names; an older ``fn(prompts, responses)`` (no ``completions`` parameter) is called
positionally. ``None`` means "not applicable to this row": it is left out of the weighted sum (TRL's
``nansum``) and of that function's logged mean (``nanmean``).

Specs (``reward`` / ``reward_funcs``):
- ``"exact_match"``: the embedded tasks' exact-match reward (:mod:`refit.learner.builtin.tasks`);
- ``"package.module:function"``, or a file ``"path/to/rewards.py:function"``;
- a folder path: an HF sequence-classification checkpoint; the reward is the logit of ``label_index``;
- in Python (``refit.learner.api.run_ppo(cfg, reward_funcs=[...])``, ``GRPOTrainer``): the callable itself.

TRL 1.x also passes three keywords, which a function gets when it names them or takes ``**kwargs``
(:class:`RewardLog`): ``trainer_state`` (:class:`TrainerState`: ``global_step`` in optimizer steps,
``max_steps``, ``epoch``), ``log_metric(name, value)`` (the mean of the values logged in a step goes into
metrics.jsonl / TensorBoard as ``name``; ``eval/name`` during the held-out evaluation) and
``log_extra(column, values)`` (one value per completion; the step's prompts, completions and these
columns are appended to ``completions.jsonl`` in the run folder). An ``async def`` function is awaited.

A function that raises, returns the wrong number of values, or returns NaN / inf / a non-number (a
string such as ``"1"`` too: no conversion) stops the run with one line naming it, before anything of that
step is applied or saved. When every function returns None for every row of a batch, the run stops too
(there is nothing to learn from, and a silent 0.0 would be trained on); rows where only some functions
return None are summed over the others (TRL's nansum), and a row where all do scores 0.0 as in TRL.
A ``reward`` folder must be a sequence-classification checkpoint: a causal-LM folder (no score head)
is refused.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from refit.core.errors import RefitError
from refit.learner.builtin.tasks import exact_match_reward

RewardFn = Callable[..., list]


class ClassifierReward:
    """Score ``prompt + completion`` with an HF ``AutoModelForSequenceClassification`` folder.

    The reward is the logit of ``label_index``. Chat prompts are rendered with the classifier tokenizer's chat
    template (prompt messages + the assistant turn) when it has one, else their contents are joined. Texts are
    padded in batches of ``batch_size`` and cut to the model's position limit (from the left, so the response is
    kept); the model pools the last non-padding token as HF's sequence classifiers do.
    """

    def __init__(self, path: str, label_index: int = 0, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from transformers import AutoConfig

        try:
            arch = (AutoConfig.from_pretrained(path).architectures or [""])[0]
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"cannot load reward model {path}: {str(e).splitlines()[0]}") from None
        if arch and not arch.endswith("ForSequenceClassification"):
            raise RefitError(f"reward model {path} is a {arch} checkpoint, not a sequence classifier: it has no score "
                             "head (a reward folder must be an AutoModelForSequenceClassification checkpoint)")
        try:
            self.tok = AutoTokenizer.from_pretrained(path)
            self.model, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
            self.model.eval()
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"cannot load reward model {path}: {str(e).splitlines()[0]}") from None
        if info.get("missing_keys"):
            raise RefitError(f"reward model {path} lacks weights of its classifier ({sorted(info['missing_keys'])[0]}, "
                             "...): they would be random; save a trained sequence-classification checkpoint")
        if self.tok.pad_token_id is None or self.model.config.pad_token_id is None:
            raise RefitError(f"reward model {path}: the tokenizer and config need a pad token to score batches")
        if not 0 <= label_index < self.model.config.num_labels:
            raise RefitError(f"reward model {path} has {self.model.config.num_labels} labels; label_index "
                             f"{label_index} is out of range")
        c = self.model.config
        self.max_length = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
        self.tok.truncation_side = "left"
        self.label_index, self.batch_size = label_index, batch_size
        self.__name__ = Path(path).name

    def _text(self, prompt, completion) -> str:
        if isinstance(prompt, str):
            return prompt + completion
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(prompt + completion, tokenize=False)
        return "\n".join(str(m["content"]) for m in prompt + completion)

    @torch.no_grad()
    def __call__(self, prompts: list, responses: list) -> list[float]:
        texts = [self._text(p, r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                           truncation=self.max_length is not None, max_length=self.max_length)
            out += self.model(**enc).logits[:, self.label_index].float().tolist()
        return out


def _import_function(spec: str) -> RewardFn:
    """``module:function`` or ``path/to/file.py:function``."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.exists():
            raise RefitError(f"reward {spec!r}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"refit_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: one line
            raise RefitError(f"reward {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RefitError(f"cannot import reward {spec!r}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RefitError(f"reward {spec!r}: {where} has no function {name!r}")
    return fn


def load_reward(spec: str) -> RewardFn:
    if spec == "exact_match":
        return exact_match_reward
    if Path(spec).is_dir():
        return ClassifierReward(spec)
    if ":" in spec:
        return _import_function(spec)
    raise RefitError(f"reward {spec!r} is not 'exact_match', 'module:function', 'file.py:function' or a classifier "
                     "folder")


@dataclass
class NamedReward:
    name: str  # logged as reward/<name>/mean
    fn: RewardFn
    weight: float = 1.0


def spec_of(fn) -> str:
    """How a reward is written in the saved config: a spec string as is, a callable as ``module:name``."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise RefitError(f"reward function {fn!r} is neither a spec string ('path.py:function', 'module:function', "
                         "a classifier folder) nor a callable")
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


def load_rewards(specs: list, weights: list[float]) -> list[NamedReward]:
    """The reward functions of ``specs`` (spec strings or callables) with ``weights`` (empty: 1.0 each); names
    made unique."""
    if weights and len(weights) != len(specs):
        raise RefitError(f"reward_weights has {len(weights)} values for {len(specs)} reward functions")
    out: list[NamedReward] = []
    for i, spec in enumerate(specs):
        spec_of(spec)  # a string or a callable, else one line
        fn = load_reward(spec) if isinstance(spec, str) else spec
        name = getattr(fn, "__name__", None) or f"reward{i}"
        name = name if name not in {r.name for r in out} else f"{name}_{i}"
        out.append(NamedReward(name=name, fn=fn, weight=float(weights[i]) if weights else 1.0))
    return out


def _call(fn: RewardFn, prompts: list, completions: list, extra: dict[str, Any]) -> Any:
    """TRL's keyword call; a function that does not take everything gets what it names (see the module doc)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins, some callables: give it all
        return fn(prompts=prompts, completions=completions, **extra)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(prompts=prompts, completions=completions, **extra)
    named = {k: v for k, v in extra.items() if k in params}
    if "completions" in params:
        return fn(**({"prompts": prompts} if "prompts" in params else {}), completions=completions, **named)
    return fn(prompts, completions, **named)  # an older (prompts, responses) function


def _await(out: Any) -> Any:
    """An ``async def`` reward's result (TRL awaits them)."""
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def call_reward(r: NamedReward, prompts: list, completions: list, extra: dict[str, Any]) -> torch.Tensor:
    """(B,) float32 values of one reward function, NaN where it returned None; one line when it misbehaves."""
    n = len(completions)
    try:
        out = _await(_call(r.fn, prompts, completions, extra))
    except RefitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function: one line, nothing of the step applied
        raise RefitError(f"reward function {r.name!r} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         ) from None
    if not hasattr(out, "__len__") or len(out) != n:
        got = len(out) if hasattr(out, "__len__") else type(out).__name__
        raise RefitError(f"reward function {r.name!r} returned {got} values for {n} completions")
    vals = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(math.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):  # "1" is not a number: float() would take it
                raise TypeError
            f = float(v)
        except (TypeError, ValueError):
            raise RefitError(f"reward function {r.name!r} returned {type(v).__name__} {str(v)[:40]!r} for row {i}; "
                             "expected a number or None") from None
        if not math.isfinite(f):
            raise RefitError(f"reward function {r.name!r} returned {f} for row {i}; use None for 'not applicable'")
        vals.append(f)
    return torch.tensor(vals, dtype=torch.float32)


def score_rewards(rewards: list[NamedReward], prompts: list, completions: list, extra: dict[str, Any],
                  prefix: str = "reward", per_func: list | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum (B,) over functions, None rows left out (TRL ``nansum``), and each function's mean
    (``nanmean``; None when it applied to no row) as ``{prefix}/{name}/mean``. ``per_func``: a list that gets the
    (B, F) values (NaN for None) and the (F,) weights appended (for GRPO's normalize_then_sum)."""
    per = torch.stack([call_reward(r, prompts, completions, extra) for r in rewards], 1)  # (B, F)
    if len(per) and per.isnan().all():
        raise RefitError(f"every reward function ({', '.join(r.name for r in rewards)}) returned None for every one "
                         f"of the {len(per)} completions: nothing to learn from; return a number for the rows a "
                         "function applies to")
    w = torch.tensor([r.weight for r in rewards], dtype=torch.float32)
    total = torch.nansum(per * w, dim=1)
    if per_func is not None:
        per_func += [per, w]
    stats = {}
    for j, r in enumerate(rewards):
        col = per[:, j]
        stats[f"{prefix}/{r.name}/mean"] = float(col.nanmean()) if (~col.isnan()).any() else None
    return total, stats


def as_rewards(obj) -> list[NamedReward]:
    """A list of NamedReward as is; a bare callable (tests, library use) as one reward of weight 1."""
    if isinstance(obj, list):
        return obj
    return [NamedReward(name=getattr(obj, "__name__", "reward") or "reward", fn=obj)]


@dataclass
class TrainerState:
    """What a TRL reward function reads from ``trainer_state`` (the fields of ``transformers.TrainerState`` that
    Refit has), at the rollout of step ``step``."""

    global_step: int  # optimizer steps taken before this rollout (TRL's count)
    max_steps: int  # optimizer steps of the whole run
    epoch: float  # passes over the training prompts so far (prompts drawn / prompts in the split)
    num_train_epochs: float  # passes over the training prompts the run makes
    step: int = 0  # Refit's rollout step (1-based; 0: the evaluation before training)
    is_world_process_zero: bool = True  # rewards run on rank 0 only
    is_local_process_zero: bool = True


class RewardLog:
    """``log_metric`` / ``log_extra`` for TRL reward functions: gathered during one scoring, then flushed."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        try:
            self.metrics[str(name)].append(float(value))
        except (TypeError, ValueError):
            raise RefitError(f"log_metric({name!r}, ...): {type(value).__name__} {str(value)[:40]!r} is not a "
                             "number") from None

    def log_extra(self, column: str, values: list) -> None:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise RefitError(f"log_extra({column!r}, ...): expected a list with one value per completion, got "
                             f"{type(values).__name__}")
        self.extra[str(column)].extend(list(values))

    def kwargs(self, state: TrainerState) -> dict[str, Any]:
        """The keywords TRL adds to every reward call."""
        return {"trainer_state": state, "log_metric": self.log_metric, "log_extra": self.log_extra}

    def flush(self, prefix: str = "") -> tuple[dict[str, float], dict[str, list]]:
        """(each logged metric's mean as ``{prefix}{name}``, the extra columns); both cleared."""
        means = {f"{prefix}{k}": sum(v) / len(v) for k, v in self.metrics.items() if v}
        extra = dict(self.extra)
        self.metrics.clear()
        self.extra.clear()
        return means, extra


def write_extras(path, step: int, prompts: list, completions: list, extra: dict[str, list]) -> None:
    """Append one step's ``log_extra`` columns, with the prompts and completions they belong to, to ``path``
    (JSON lines); a column whose length is not the number of completions is refused in one line."""
    if not extra:
        return
    for column, values in extra.items():
        if len(values) != len(completions):
            raise RefitError(f"log_extra({column!r}, ...) got {len(values)} values at step {step} for "
                             f"{len(completions)} completions")
    row = {"step": step, "prompt": prompts, "completion": completions, **extra}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
