"""``TorchEngine``: the reference backend, the HF model in PyTorch with its own KV-cache loop.

No ``model.generate``: ``prefill`` and ``extend`` below drive the HF model with a
``DynamicCache`` (decoder-only: explicit ``position_ids`` from the mask, so left padding is
invisible) or run the encoder once and the decoder with an ``EncoderDecoderCache``. The
decode loop, stop handling and sampling are the shared ones in :mod:`refit.rollout.engine` and
:mod:`refit.rollout.sampling`, so every other backend is compared with this one on logits alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refit.core.hf_folder import load_model
from refit.core.errors import RefitError
from refit.core.hf_compat import cache_kw
from refit.core.manifest import MANIFEST, Manifest
from refit.core.padding import position_ids_from_mask
from refit.export.capabilities import decoder_start_id
from refit.export.weight_map import canonical_params
from refit.rollout.engine import LoopEngine, ModelSpec, next_version, resolve_names


def prefill(model, cache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Decoder-only: (B, Tp) left-padded prompt into an empty cache -> (B, V) last-position logits."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=True, logits_to_keep=1, **cache_kw(cache))
    return out.logits[:, -1].float()


def extend(model, cache, ids: torch.Tensor, full_mask: torch.Tensor) -> torch.Tensor:
    """Decoder-only: (B, c) new tokens; ``full_mask`` (B, past + c) -> (B, c, V) logits."""
    pos = position_ids_from_mask(full_mask)[:, -ids.shape[1]:]
    return model(input_ids=ids, attention_mask=full_mask, position_ids=pos, use_cache=True, **cache_kw(cache)).logits.float()


class _DecoderState:
    """KV cache and running attention mask of one decoder-only batch."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model, self.cache, self.mask = model, DynamicCache(config=model.config), None

    def prefill(self, ids, mask):
        self.mask = mask
        return prefill(self.model, self.cache, ids, mask)

    def extend(self, ids, mask):
        self.mask = torch.cat([self.mask, mask], 1)
        return extend(self.model, self.cache, ids, self.mask)


class _Seq2SeqState:
    """Encoder output (computed once) and the decoder's self-attention cache of one encoder-decoder batch."""

    def __init__(self, model, start_id: int):
        from transformers import DynamicCache, EncoderDecoderCache

        cfg = model.config
        self.model, self.start_id = model, start_id
        self.cache = EncoderDecoderCache(DynamicCache(config=cfg), DynamicCache(config=cfg))
        self.enc = self.enc_mask = None

    def prefill(self, ids, mask):
        self.enc, self.enc_mask = self.model.get_encoder()(input_ids=ids, attention_mask=mask), mask
        start = torch.full((ids.shape[0], 1), self.start_id, dtype=torch.int64)
        return self.extend(start, None)[:, -1]

    def extend(self, ids, mask):  # no decoder mask: finished rows' outputs are ignored, never attended
        return self.model(encoder_outputs=self.enc, attention_mask=self.enc_mask, decoder_input_ids=ids,
                          use_cache=True, **cache_kw(self.cache)).logits.float()


def _load(source, dtype):
    """(model, engine max_len or None) from an nn.Module, an HF model folder or an engine folder."""
    if isinstance(source, torch.nn.Module):
        return source.eval(), None
    path = Path(source)
    if (path / MANIFEST).exists():
        m = Manifest.read(path)
        src = Path(m.source_model)
        if not src.exists():
            raise RefitError(f"engine {path} was exported from {src}, which is not here; pass the HF model folder")
        return load_model(src, dtype=dtype), m.dims.max_len
    return load_model(path, dtype=dtype), None


class TorchEngine(LoopEngine):
    """Reference engine over an HF model (an ``nn.Module``, an HF folder, or an engine folder's source)."""

    def __init__(self, source, max_len: int | None = None, dtype: torch.dtype | None = None,
                 threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        self.model, engine_max_len = _load(source, dtype)
        self.spec = ModelSpec.from_config(self.model.config, max_len=max_len or engine_max_len,
                                          decoder_start=decoder_start_id(self.model))
        self._version = 0

    def _new_state(self, capacity: int = 0):
        """A fresh StepState (generate/score come from LoopEngine); the HF caches grow, ``capacity`` is unused."""
        if self.spec.kind == "seq2seq":
            return _Seq2SeqState(self.model, self.spec.decoder_start_id)
        return _DecoderState(self.model)

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Copy HF state_dict tensors (canonical or tied alias names) into the model; version += 1."""
        params, tied = canonical_params(self.model)
        named_tensors = resolve_names(named_tensors, set(params), tied)
        for name, t in named_tensors.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise RefitError(f"update_weights: {name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(params[name].shape)}")
        for name, t in named_tensors.items():
            params[name].copy_(t.detach())
        self._version = next_version(self._version, version)

    def close(self) -> None:
        self.model = None
