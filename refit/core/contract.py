"""What the exporter, the engines and the learner must agree on, stated once for every floor.

- ``DTYPES``: the manifest's dtype names and the torch dtypes they mean.
- ``PARITY_TOL``: the export gate's max |engine - PyTorch log-prob| per dtype; the learner's probe of an fp16/bf16
  engine never asks for less (refit.learner.run.sync).
- :func:`canonical_params`: a model's weights by canonical HF name, what a weight push carries and what the
  weight map names (tied aliases apart).
- :func:`decoder_start_id`: an encoder-decoder's first decoder token, the one rule the exporter, the torch
  reference and the learner share.
- :func:`weights_hash`: the hash of a checkpoint folder's weights, the key an engine folder is matched by.
- :func:`lora_config`, :func:`peft_lora_model`: which layers carry a LoRA adapter, and how (PEFT's ``LoraConfig``): the learner's adapter and
  a LoRA-ready engine's adapter inputs are made from the same one.

The padding rule sits beside it, in refit.core.padding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refit.core.errors import RefitError
from refit.core.integrity import sha256_files

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # manifest dtype -> torch

# max |engine - PyTorch log-prob| the export's parity gate accepts, per engine dtype
ENGINE_BACKENDS = ("onnxruntime", "tensorrt")  # backends that run an exported engine folder

PARITY_TOL = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 1e-1}


def canonical_params(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Unique weight tensors by canonical HF name, and ``{alias: canonical}`` for tied ones.

    Weights are the parameters (trainable or frozen, e.g. Marian's sinusoidal table) plus the
    floating-point buffers saved in the checkpoint (BART/Marian ``final_logits_bias``): the graph
    holds them like weights, so the map must carry them or a push would leave them stale.
    Non-persistent buffers (rotary frequencies) are recomputed from the config and stay out.
    """
    canon: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[int, str] = {}
    saved = set(model.state_dict(keep_vars=True))
    buffers = [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in saved and b.is_floating_point()]
    for name, p in [*model.named_parameters(remove_duplicate=False), *buffers]:
        key = id(p)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            canon[name] = p
    return canon, tied


def decoder_start_id(model) -> int | None:
    """The first decoder token: ``config.decoder_start_token_id``, else the generation config's.

    The one rule the exporter, the torch reference and the learner share (Marian: the pad id)."""
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    return None if start is None else int(start)


def weights_hash(model_dir: Path) -> str:
    """sha256 over a checkpoint folder's weight files and config.json (sorted by name)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    return sha256_files(files)


def peft_lora_model(model, target_modules, r: int = 1, alpha: float = 1.0, dropout: float = 0.0,
                    init: str = "default"):
    """``peft.get_peft_model(model, lora_config(...))``; PEFT's refusal (target modules that match nothing, a layer
    it cannot adapt) as one RefitError line. The export's target resolution and the learner's policy both use it."""
    from peft import get_peft_model

    target_modules = _with_all_linear(model, target_modules)
    try:
        return get_peft_model(model, lora_config(target_modules, r, alpha, dropout, init))
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RefitError(f"lora: target_modules {list(target_modules)} cannot be used on this model: "
                         f"{first[:300]}") from None


def _with_all_linear(model, target_modules) -> tuple[str, ...]:
    """``target_modules`` with "all-linear" beside other names (``all-linear lm_head``: every linear layer and the
    output head, which PEFT's all-linear leaves out) spelled out as PEFT's own all-linear names plus the others;
    unchanged otherwise (PEFT takes "all-linear" only alone)."""
    tm = tuple(target_modules)
    if "all-linear" not in tm or len(tm) == 1:
        return tm
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers  # PEFT's meaning of all-linear, not ours

    extra = set(tm) - {"all-linear"}
    modules = [n for n, _ in model.named_modules()]
    unknown = sorted(x for x in extra if not any(n == x or n.endswith("." + x) for n in modules))  # PEFT's match
    if unknown:  # PEFT refuses only names that match nothing at all, and all-linear always matches
        raise RefitError(f"lora: target_modules {list(tm)}: {', '.join(unknown)} names no module of this model")
    names = _maybe_include_all_linear_layers(lora_config(("all-linear",)), model).target_modules
    return tuple(sorted(set(names) | extra))


def lora_config(target_modules, r: int = 1, alpha: float = 1.0, dropout: float = 0.0, init: str = "default"):
    """A ``peft.LoraConfig`` for ``target_modules`` (``("all-linear",)`` or module names / suffixes)."""
    from peft import LoraConfig  # optional until a LoRA run: peft imports transformers' PEFT integration

    tm = list(target_modules)
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules="all-linear" if tm == ["all-linear"] else tm,
                      init_lora_weights=True if init == "default" else init, bias="none")
