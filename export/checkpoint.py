"""Load and validate an HF checkpoint folder; every failure is one clear line (RefitError)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from export.errors import RefitError
from export.padding import DECODER_ONLY_SIDE, NATIVE_ENCODER_SIDE

# model_type -> kind. Decoder-only types share the wrapper (HF causal LM with a Cache).
SUPPORTED = {
    "gpt2": "decoder", "llama": "decoder", "qwen2": "decoder", "mistral": "decoder",
    "t5": "seq2seq",
}


@dataclass(frozen=True)
class ModelInfo:
    """What the exporter and engines need to know about a checkpoint."""

    path: Path
    model_type: str  # HF config.model_type
    kind: str  # "decoder" | "seq2seq"
    architecture: str  # config.architectures[0] or the class built from the config
    vocab_size: int  # rows of the input embedding
    n_layers: int  # decoder layers (KV cache entries = 2 * n_layers)
    n_kv_heads: int
    head_dim: int
    max_positions: int | None  # learned-position limit, None for relative/rotary-only limits
    pad_id: int
    eos_id: int
    decoder_start_id: int | None  # seq2seq only
    padding_side: str  # prompt / encoder padding side


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise RefitError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise RefitError(f"{path} is not a folder (expected an HF checkpoint folder)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise RefitError(f"{path} is not an HF checkpoint: no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise RefitError(f"{cfg_file} is not valid JSON: {e}") from None
    if not any((path / f).exists() for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        raise RefitError(f"{path} is not an HF checkpoint: no model.safetensors or pytorch_model.bin")
    return cfg


def model_info(path: str | Path) -> ModelInfo:
    cfg = read_config(path)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise RefitError(f"unsupported architecture {mt!r} in {path}; supported: {', '.join(sorted(SUPPORTED))}")
    kind = SUPPORTED[mt]
    g = lambda *keys, default=None: next((cfg[k] for k in keys if cfg.get(k) is not None), default)  # noqa: E731
    n_heads = g("n_head", "num_attention_heads", "num_heads")
    d_model = g("n_embd", "hidden_size", "d_model")
    eos = g("eos_token_id", default=0)
    return ModelInfo(
        path=Path(path), model_type=mt, kind=kind,
        architecture=(cfg.get("architectures") or [mt])[0],
        vocab_size=cfg["vocab_size"],
        n_layers=g("num_decoder_layers", "n_layer", "num_hidden_layers", "num_layers"),
        n_kv_heads=g("num_key_value_heads", "n_head", "num_attention_heads", "num_heads"),
        head_dim=g("d_kv", "head_dim", default=d_model // n_heads),
        max_positions=g("n_positions", "max_position_embeddings"),
        pad_id=g("pad_token_id", default=0),
        eos_id=eos[0] if isinstance(eos, list) else eos,
        decoder_start_id=g("decoder_start_token_id") if kind == "seq2seq" else None,
        padding_side=NATIVE_ENCODER_SIDE.get(mt, "right") if kind == "seq2seq" else DECODER_ONLY_SIDE,
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


def load_model(path: str | Path, info: ModelInfo | None = None, dtype=None, attn: str = "eager"):
    """The PyTorch model in eval mode (eager attention: what the exporter traces and matches)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    info = info or model_info(path)
    auto = AutoModelForSeq2SeqLM if info.kind == "seq2seq" else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(str(path), dtype=dtype or torch.float32, attn_implementation=attn)
    except Exception as e:  # noqa: BLE001
        raise RefitError(f"cannot load model weights from {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return model.eval()
