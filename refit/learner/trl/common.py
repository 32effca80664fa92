"""What the four TRL configs and trainers share: the config object over the field tables
(:mod:`refit.learner.trl.field_tables`), the ``TrainingArguments`` fields every job maps the same way, the model and
tokenizer a trainer is given, and ``peft_config`` as Refit's ``lora`` section."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, ClassVar

from refit.core.errors import RefitError
from refit.core.hf_folder import download_hint
from refit.learner.demo import build_policy
from refit.learner.run.chat import as_pairs
from refit.learner.run.checkpoint import latest_checkpoint
from refit.learner.run.config import SCHEDULES
from refit.learner.run.optim import rates
from refit.learner.trl.best import settle
from refit.learner.trl.field_tables import REFUSED, TrlField
from refit.learner.trl.fields import check_values

DEMO_CHAT_MODEL = "refit/demo-chat"  # the embedded chat model: built locally by refit.learner.demo on first use
REPORTS = ("none", "tensorboard", "all")  # report_to values that keep everything on this machine


class TrlConfig:
    """TRL's config: every name of :attr:`FIELDS` as an attribute (TRL's default when not given); an unknown name
    or a refused value is one line. ``given`` holds what the script set, ``ignored`` the accepted names."""

    FIELDS: ClassVar[dict[str, TrlField]] = {}
    HINTS: ClassVar[dict[str, str]] = {}  # unknown name -> Refit's nearest (named in the refusal)

    def __init__(self, output_dir: str | None = None, **kw):
        if output_dir is not None:
            kw["output_dir"] = str(output_dir)
        name = type(self).__name__
        check_values(name, self.FIELDS, kw, self.HINTS)
        for k, f in self.FIELDS.items():
            setattr(self, k, copy.deepcopy(kw.get(k, f.default)))
        self.refit = dict(kw.get("refit") or {})
        self.given = dict(kw)
        self.ignored = {k: v for k, v in kw.items() if self.FIELDS[k].kind == "accepted"}  # taken, no effect
        if self.optim not in ("adamw_torch_fused", "adamw_torch"):
            raise RefitError(f"{name}: optim={self.optim!r}: Refit's optimizer is torch's AdamW ('adamw_torch_fused' "
                             "or 'adamw_torch')")
        settle(self)  # metric_for_best_model / greater_is_better defaults and checks (TrainingArguments')

    @property
    def on_cpu(self) -> bool:
        return bool(self.use_cpu or self.no_cuda)  # no_cuda: the older name (transformers 4)

    def to_dict(self) -> dict[str, Any]:
        """The config's names and values (as TRL's ``to_dict``), refused ones at their only value."""
        return {k: getattr(self, k) for k in self.FIELDS if self.FIELDS[k].kind != REFUSED or k in self.given}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.given.items())})"


def steps_of(name: str, value: float, total: int | None) -> int:
    """TRL's step count ``value``; a float in (0, 1) is that share of ``total`` (TRL's ratio form)."""
    if 0 < value < 1:
        if total is None:
            raise RefitError(f"{name}={value} is a share of max_steps: set max_steps")
        return math.ceil(value * total)
    return int(value)


def shared_values(a: TrlConfig, steps: int, per: int) -> dict[str, Any]:
    """The dotted Refit values of the ``TrainingArguments`` fields every job maps alike; ``steps``: Refit's steps,
    ``per``: optimizer steps per Refit step (save_steps counts optimizer steps)."""
    report = [a.report_to] if isinstance(a.report_to, str) else list(a.report_to or [])
    remote = [r for r in report if r not in REPORTS]
    if remote:
        raise RefitError(f"report_to={a.report_to!r}: nothing leaves the machine; Refit writes metrics.jsonl and "
                         "TensorBoard events (report_to='tensorboard')")
    if a.save_strategy not in ("steps", "no"):
        raise RefitError(f"save_strategy={a.save_strategy!r}: Refit saves by steps ('steps', save_steps) or only at "
                         "the last step ('no')")
    if a.logging_strategy not in ("steps", "no"):
        raise RefitError(f"logging_strategy={a.logging_strategy!r}: Refit logs by steps ('steps') or not ('no')")
    if a.lr_scheduler_type not in SCHEDULES:
        raise RefitError(f"lr_scheduler_type={a.lr_scheduler_type!r}: Refit runs transformers' {', '.join(SCHEDULES)} "
                         "(reduce_lr_on_plateau and greedy need an evaluation metric each step)")
    save = steps_of("save_steps", a.save_steps, steps * per) if a.save_strategy == "steps" else 0
    values = {
        "run.output_dir": a.output_dir, "run.seed": a.seed, "run.device": "cpu" if a.on_cpu else "auto",
        "run.bf16": True if a.bf16 is None else bool(a.bf16), "log.progress": not a.disable_tqdm,
        **({"run.precision": "bf16"} if a.bf16 else {}),  # TRL's mixed precision, asked for: run.precision bf16
        "log.tensorboard": bool({"tensorboard", "all"} & set(report)),
        # not capped at steps (the last step always saves): a resumed run with a larger max_steps keeps its value
        "ckpt.save_steps": math.ceil(save / per) if save > 0 else steps,
        "optim.learning_rate": a.learning_rate, "optim.lr_scheduler_type": a.lr_scheduler_type,
        "optim.warmup_steps": a.warmup_steps or math.ceil(a.warmup_ratio * steps * per),
        "optim.weight_decay": a.weight_decay, "optim.max_grad_norm": a.max_grad_norm,
        "optim.gradient_accumulation_steps": a.gradient_accumulation_steps,
        "optim.adam_beta1": a.adam_beta1, "optim.adam_beta2": a.adam_beta2, "optim.adam_epsilon": a.adam_epsilon,
        "optim.lr_scheduler_kwargs": scheduler_kwargs_of(a.lr_scheduler_kwargs),
        "optim.neftune_noise_alpha": float(a.neftune_noise_alpha or 0.0),
    }
    # TRL keeps every checkpoint-N when save_total_limit is None or <= 0: Refit's keep_checkpoints 0
    values["ckpt.keep_checkpoints"] = max(0, a.save_total_limit or 0)
    return values


def scheduler_kwargs_of(v: Any) -> tuple[str, ...]:
    """TRL's ``lr_scheduler_kwargs`` (a dict, or its JSON string as transformers takes it from a command line) as
    Refit's NAME=VALUE strings (VALUE in JSON, which the job reads back as YAML)."""
    import json

    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except ValueError:
            raise RefitError(f"lr_scheduler_kwargs={v!r}: a dict, or its JSON string") from None
    if not isinstance(v, dict | type(None)):
        raise RefitError(f"lr_scheduler_kwargs={v!r}: a dict, or its JSON string")
    return tuple(f"{k}={json.dumps(x)}" for k, x in (v or {}).items())


SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # generation_kwargs -> sampling.*


def generation_values(a: TrlConfig, length_key: str, length: int) -> dict[str, Any]:
    """TRL's sampling fields as Refit's ``sampling`` values (and ``length`` new tokens at ``length_key``), with
    ``generation_kwargs`` over them as TRL updates its ``GenerationConfig``: its temperature, top_k, top_p, min_p,
    repetition_penalty and max_new_tokens replace the fields', do_sample=True is taken; any other key is one line
    naming it. ``chat_template_kwargs`` becomes ``data.chat_template_kwargs``."""
    name = type(a).__name__
    gen = {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p,
           "repetition_penalty": a.repetition_penalty, length_key: length}
    for k, v in dict(a.generation_kwargs or {}).items():
        if k in SAMPLER_KEYS:
            gen[k] = v
        elif k == "max_new_tokens":
            gen[length_key] = int(v)
        elif k != "do_sample" or v is not True:
            what = "do_sample=False: the engine samples (greedy rollouts give a group one completion)" if (
                k == "do_sample") else f"{k!r} is not supported"
            raise RefitError(f"{name}: generation_kwargs {what}; Refit's engine sampler takes "
                             f"{', '.join(SAMPLER_KEYS)}, max_new_tokens (and do_sample=True)")
    gen["top_k"] = gen["top_k"] or 0  # None: no top-k
    gen["min_p"] = gen["min_p"] or 0.0  # None: no min-p
    gen["repetition_penalty"] = 1.0 if gen["repetition_penalty"] is None else gen["repetition_penalty"]
    return {**gen, "data.chat_template_kwargs": as_pairs(a.chat_template_kwargs, f"{name}: chat_template_kwargs")}


def eval_every(a: TrlConfig, steps: int, per: int) -> int:
    """Refit steps between held-out evaluations: ``eval_steps`` optimizer steps (None: ``logging_steps``, as
    TRL) with ``eval_strategy='steps'``; with 'no', only the last step (for ``evaluate()``)."""
    if a.eval_strategy not in ("no", "steps"):
        raise RefitError(f"eval_strategy={a.eval_strategy!r}: Refit evaluates by steps ('steps', eval_steps) or at "
                         "the last step only ('no', for evaluate())")
    if a.eval_strategy == "no":
        return steps
    n = steps_of("eval_steps", a.logging_steps if a.eval_steps is None else a.eval_steps, steps * per)
    return max(1, math.ceil(n / per))


def staged_dataset(train: Any, held: Any, run_dir: Path) -> str:
    """``train`` and ``held`` (``datasets.Dataset`` objects) as one ``save_to_disk`` DatasetDict with the splits
    'train' and 'eval', staged as ``run_dir/train_dataset`` (the folder ``refit.learner.api`` stages a dataset
    in); its path."""
    import shutil

    import datasets

    for what, d in (("train_dataset", train), ("eval_dataset", held)):
        if not isinstance(d, datasets.Dataset):
            raise RefitError(f"{what} must be a datasets.Dataset with an eval_dataset, got {type(d).__name__}")
    out = run_dir / "train_dataset"
    if out.exists():
        shutil.rmtree(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    datasets.DatasetDict({"train": train, "eval": held}).save_to_disk(str(out))
    return str(out)


def lr_schedule(optim, total: int):
    """optimizer steps taken -> the learning rate of the next one, from the schedule the jobs build
    (:func:`refit.learner.run.optim.schedule` with ``optim``'s settings over ``total`` optimizer steps); TRL logs the
    rate of the step just taken, ``lr_schedule(...)(global_step - 1)``."""
    return rates(optim, total)


# ------------------------------------------------------------------ models and tokenizers


def resolve_model(model: Any, processing_class: Any, folder: Path, role: str = "model") -> str:
    """A local checkpoint folder for ``model``: a folder, :data:`DEMO_CHAT_MODEL`, or a ``PreTrainedModel``
    saved to ``folder`` with its tokenizer (``processing_class``, else the one of ``model.name_or_path`` as TRL
    loads it)."""
    if model == DEMO_CHAT_MODEL:
        return str(demo_chat_model())
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise RefitError(f"{role} {str(model)!r} is not a local checkpoint folder (no config.json): "
                             f"{download_hint(model)}; or {DEMO_CHAT_MODEL!r}")
        if processing_class is not None:
            _same_tokenizer(processing_class, path)
        return str(path)
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        tok = processing_class if processing_class is not None else tokenizer_of(model, role)
        model.save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        return str(folder)
    raise RefitError(f"{role} must be a checkpoint folder, a PreTrainedModel or {DEMO_CHAT_MODEL!r}; got "
                     f"{type(model).__name__}")


def tokenizer_of(model: Any, role: str = "model"):
    """TRL's default ``processing_class``: the tokenizer saved with ``model.name_or_path`` (a local folder)."""
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not name or not (Path(name) / "config.json").is_file():
        raise RefitError(f"{role} object has no local name_or_path ({name!r}) to load its tokenizer from: pass "
                         "processing_class (Refit downloads nothing)")
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _same_tokenizer(tok, folder: Path) -> None:
    """The run uses the folder's tokenizer: a different ``processing_class`` is refused, not silently dropped."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(folder))
    if saved.get_vocab() != tok.get_vocab() or getattr(saved, "chat_template", None) != getattr(
            tok, "chat_template", None):
        raise RefitError(f"processing_class differs from the tokenizer saved in {folder} (vocabulary or chat "
                         "template); save it there (processing_class.save_pretrained(model_folder))")


def demo_chat_model() -> Path:
    """The embedded chat model (a small GPT-2 with a chat template, warmed up on addition), built once under
    ``$REFIT_DEMO_MODELS`` (default ``runs/chat-model``, where ``refit demo --policy_only --chat -o
    runs/chat-model`` puts it) and reused."""
    import os

    root = Path(os.environ.get("REFIT_DEMO_MODELS", "runs/chat-model"))
    if not (root / "policy" / "config.json").is_file():
        print(f"refit: building the embedded chat model under {root} (once)")
        build_policy(root, sft_steps=150, max_operand=9, seed=0, chat=True)
    return root / "policy"


def trained_model(run_dir: Path, final_dir: Path | None, given: Any):
    """The trained policy after ``train()``: OUTPUT_DIR/final (else the last checkpoint) loaded; a model object the
    script passed in gets those weights, in place, as TRL trains it."""
    from transformers import AutoModelForCausalLM

    folder = final_dir
    if folder is None:
        last = latest_checkpoint(run_dir)
        folder = last / "policy" if last is not None else None
    if folder is None:
        return given
    trained = AutoModelForCausalLM.from_pretrained(str(folder))
    if given is not None and hasattr(given, "load_state_dict"):
        given.load_state_dict(trained.state_dict())
        return given
    return trained


# ------------------------------------------------------------------ peft_config -> the lora section

# LoraConfig attributes the mapping reads, and those that change nothing in the run
_MAPPED = ("r", "lora_alpha", "lora_dropout", "target_modules", "init_lora_weights")
_BENIGN = ("task_type", "inference_mode", "base_model_name_or_path", "revision", "peft_type", "peft_version",
           "auto_mapping", "_custom_modules")
_LORA_NOTES = {"use_dora": "DoRA is not supported (plain LoRA)", "use_rslora": "rsLoRA is not supported: the "
               "adapter is scaled by alpha / r", "bias": "only bias='none': the adapter trains no biases",
               "modules_to_save": "not supported: only the adapters train", "layers_to_transform": "not supported: "
               "every matching layer gets an adapter"}


def base_dtype_values(model_init_kwargs: dict | None, peft_config: Any, name: str) -> dict[str, Any]:
    """``model_init_kwargs``' dtype as Refit's ``lora.base_dtype``: bfloat16 with a ``peft_config`` holds the LoRA
    base in bf16 on the learner, as TRL's model is then loaded; float32 with a ``peft_config``: the base in fp32 (an
    explicit value wins over Refit's auto); "auto" or none: {} (lora.base_dtype auto: bf16 where the hardware has bf16
    units, refit.learner.run.precision). bfloat16 without LoRA and any other dtype are one line. Other keys change
    nothing (the folder is loaded as saved)."""
    kw = dict(model_init_kwargs or {})
    dtype = kw.get("dtype", kw.get("torch_dtype"))
    spelled = str(dtype).removeprefix("torch.") if dtype is not None else None
    if spelled in (None, "auto") or (spelled == "float32" and peft_config is None):
        return {}
    if spelled == "float32":
        return {"lora.base_dtype": "fp32"}
    if spelled == "bfloat16" and peft_config is not None:
        return {"lora.base_dtype": "bf16"}
    if spelled == "bfloat16":
        raise RefitError(f"{name}: model_init_kwargs dtype bfloat16 without peft_config: Refit holds a model in bf16 "
                         "only as a LoRA base (lora.base_dtype bf16); full fine-tuning trains in fp32")
    raise RefitError(f"{name}: model_init_kwargs dtype {spelled}: Refit takes bfloat16 (with peft_config: the LoRA "
                     "base in bf16) or float32")


def lora_values(peft_config: Any, model_dir: str) -> dict[str, Any]:
    """``peft.LoraConfig`` as Refit's ``lora.*`` values (r, lora_alpha -> alpha, lora_dropout -> dropout,
    target_modules, init_lora_weights True -> 'default', 'gaussian'); an option Refit cannot honour is one line."""
    if peft_config is None:
        return {}
    import peft

    if not isinstance(peft_config, peft.LoraConfig):
        raise RefitError(f"peft_config: a peft.LoraConfig, got {type(peft_config).__name__} (Refit trains LoRA "
                         "adapters only)")
    plain = peft.LoraConfig()
    for k, v in vars(peft_config).items():
        if k in _MAPPED or k in _BENIGN or v == getattr(plain, k, v) or (not v and not getattr(plain, k, None)):
            continue
        raise RefitError(f"peft_config: {k}={v!r}: {_LORA_NOTES.get(k, 'not supported by Refit LoRA')}")
    init = peft_config.init_lora_weights
    if init is not True and init != "gaussian":
        raise RefitError(f"peft_config: init_lora_weights={init!r}: Refit takes True ('default') or 'gaussian', "
                         "which leave the policy equal to the base at step 0 (KL(0) = 0)")
    targets = peft_config.target_modules
    if targets is None:  # PEFT's own default for the architecture
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
        from transformers import AutoConfig

        kind = AutoConfig.from_pretrained(model_dir).model_type
        if kind not in DEFAULTS:
            raise RefitError(f"peft_config: target_modules=None and PEFT has no default for model type {kind!r}: "
                             "name them ('all-linear' or module names)")
        targets = DEFAULTS[kind]
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return {"lora.r": int(peft_config.r), "lora.alpha": float(peft_config.lora_alpha),
            "lora.dropout": float(peft_config.lora_dropout), "lora.target_modules": targets,
            "lora.init": "default" if init is True else "gaussian"}
