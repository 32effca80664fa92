"""Load and validate an HF checkpoint folder; every failure is one clear line (RefitError)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.padding import native_padding_side
from refit.core.records import read_json


@dataclass(frozen=True)
class ModelInfo:
    """What the config says about a checkpoint (no weights read). The exporter's probe adds the rest
    (:class:`refit.export.capabilities.Capabilities`: cache geometry, positions, padding verified)."""

    path: Path
    model_type: str  # HF config.model_type (recorded, never branched on)
    kind: str  # "decoder" (AutoModelForCausalLM) | "seq2seq" (AutoModelForSeq2SeqLM)
    architecture: str  # config.architectures[0] or the class built from the config
    vocab_size: int  # rows of the input embedding
    max_positions: int | None  # the config's position limit (max_position_embeddings), None when absent
    pad_id: int
    eos_id: int
    decoder_start_id: int | None  # seq2seq only
    padding_side: str  # prompt / encoder padding side: left (decoder-only) or the tokenizer's own


# owner/name as the Hub spells a repository id (Qwen/Qwen2.5-0.5B); a one-word id (gpt2) is told nothing more
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(name: str | Path) -> bool:
    """``owner/name`` that is not on disk, and whose owner is not a local folder either (``models/tiny``, not
    built yet, is a path)."""
    s = str(name)
    return bool(HUB_ID.fullmatch(s)) and not Path(s).exists() and not Path(s.partition("/")[0]).is_dir()


def download_hint(name: str | Path) -> str:
    """What to do with a model name that is not a local folder, said alike by the CLI and the TRL facade: Refit
    downloads nothing; a Hub id also gets the command that fetches it on a connected machine."""
    text = "Refit downloads nothing; give a save_pretrained folder (config.json, weights, tokenizer)"
    if looks_like_hub_id(name):
        local = f"models/{str(name).rpartition('/')[2]}"
        text += f"; on a connected machine `hf download {name} --local-dir {local}` fetches one (huggingface_hub)"
    return text


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        hub = f" (a Hugging Face Hub id?): {download_hint(path)}" if looks_like_hub_id(path) else ""
        raise RefitError(f"model folder {path} does not exist{hub}")
    if not path.is_dir():
        raise RefitError(f"{path} is not a folder (expected an HF checkpoint folder)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise RefitError(f"{path} is not an HF checkpoint: no config.json")
    cfg = read_json(cfg_file, "is not valid JSON")
    if not any((path / f).exists() for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        raise RefitError(f"{path} is not an HF checkpoint: no model.safetensors or pytorch_model.bin")
    return cfg


def load_config(path: str | Path):
    """The checkpoint's transformers config, checked to have an LM head class (causal or seq2seq)."""
    from transformers import AutoConfig

    raw = read_config(path)
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - an unknown model type or a bad field is one line
        raise RefitError(f"cannot read the config of {path} (model_type {raw.get('model_type')!r}): "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if _auto_class(cfg) is None:
        head = "AutoModelForSeq2SeqLM" if cfg.is_encoder_decoder else "AutoModelForCausalLM"
        raise RefitError(f"cannot export {path}: transformers has no {head} class for model_type "
                         f"{cfg.model_type!r}; missing capability: a language-model head")
    return cfg


def _auto_class(cfg):
    """AutoModelForSeq2SeqLM / AutoModelForCausalLM when it maps this config class, else None."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM
    return auto if type(cfg) in auto._model_mapping else None


def _first_id(x) -> int | None:
    return x[0] if isinstance(x, list) else x


def model_info(path: str | Path) -> ModelInfo:
    cfg = load_config(path)
    seq2seq = bool(cfg.is_encoder_decoder)
    text = cfg.get_text_config()
    start = _first_id(getattr(cfg, "decoder_start_token_id", None))
    return ModelInfo(
        path=Path(path), model_type=cfg.model_type, kind="seq2seq" if seq2seq else "decoder",
        architecture=(cfg.architectures or [_auto_class(cfg)._model_mapping[type(cfg)].__name__])[0],
        vocab_size=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
        pad_id=_first_id(getattr(cfg, "pad_token_id", None)) or 0,
        eos_id=_first_id(getattr(cfg, "eos_token_id", None)) or 0,
        decoder_start_id=start if seq2seq else None,
        padding_side=native_padding_side(seq2seq, path),
    )


def load_tokenizer(path: str | Path, info: ModelInfo):
    """The checkpoint's tokenizer, checked against the model's embedding size."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any load failure is one user-facing line
        raise RefitError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    check_tokenizer_matches(len(tok), info.vocab_size, str(path))
    return tok


def check_tokenizer_matches(n_tokens: int, vocab_size: int, where: str) -> None:
    if n_tokens > vocab_size:
        raise RefitError(
            f"tokenizer/vocab mismatch in {where}: tokenizer has {n_tokens} ids but the model embeds {vocab_size}"
        )


LEARNER_ATTN = "sdpa"  # the learner's attention: PyTorch's fused scaled-dot-product kernels (no T x T scores kept)


def load_model(path: str | Path, info: ModelInfo | None = None, dtype=None, attn: str = "eager"):
    """The PyTorch model in eval mode. ``attn``: eager (the default: what the exporter traces and matches) or
    ``LEARNER_ATTN`` (the learner's models: the same function, fused kernels that keep no (T, T) attention
    probabilities for the backward); a family transformers runs only eagerly loads eagerly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.utils import logging

    info = info or model_info(path)
    auto = AutoModelForSeq2SeqLM if info.kind == "seq2seq" else AutoModelForCausalLM
    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # a "Loading weights" bar on stderr would break one-line errors after it
    try:
        try:
            model = auto.from_pretrained(str(path), dtype=dtype or torch.float32, attn_implementation=attn)
        except ValueError as e:  # "... does not support an attention implementation through ... sdpa ..."
            if attn == "eager" or "attention" not in str(e).lower():
                raise
            model = auto.from_pretrained(str(path), dtype=dtype or torch.float32, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001
        raise RefitError(f"cannot load model weights from {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    finally:
        if bar:
            logging.enable_progress_bar()
    check_finite_weights(model, path)
    return model.eval()


def check_finite_weights(model, path: str | Path) -> None:
    """One line naming the first parameter with NaN or infinite values (and how many), before any probe or gate
    blames something else for what such a weight does. Buffers are not checked: masks may hold -inf."""
    import torch

    bad = [(name, int((~torch.isfinite(p)).sum())) for name, p in model.named_parameters()
           if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        name, n = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise RefitError(f"model weights in {path} are not finite: {name} has {n} NaN or infinite values{more}; "
                         "the checkpoint is damaged: replace it (re-save the model)")


def text_config(path: str | Path):
    """The text (decoder) part of the checkpoint's transformers config; None when it cannot be read."""
    try:
        return load_config(path).get_text_config()
    except RefitError:
        return None


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` of the folder's generation_config.json (an id or a list), as ids: transformers'
    ``generate`` stops at each; () without the file or the key."""
    f = Path(path) / "generation_config.json"
    ids = (read_json(f, "is not valid JSON") or {}).get("eos_token_id") if f.is_file() else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    return tuple(int(i) for i in ids)
