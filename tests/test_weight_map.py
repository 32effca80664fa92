"""The weight map decides by provenance (refit/export/weight_map.py): buffers are graph constants, an elementwise
affine transform of a weight is mapped, anything else the exporter derives from a weight is refused."""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.manifest_sections import WeightTarget
from refit.export.options import ExportOptions
from refit.export.weight_map import apply_transform
from refit.rollout.build import build


def test_affine_transform_is_exact_in_the_stored_dtype():
    w = torch.randn(64)
    t = WeightTarget(engine="x", graph="decoder", transform="affine", scale=1.0, shift=1.0)
    assert torch.equal(apply_transform(w, t), w + 1.0)
    bf = WeightTarget(engine="x", graph="decoder", transform="affine", scale=2.0, shift=0.0, stored_dtype="fp32")
    assert apply_transform(w.bfloat16(), bf).dtype == torch.float32


def test_rotary_buffer_is_a_constant_not_a_weight(engine_dirs):
    m = Manifest.read(engine_dirs["tiny-llama"])
    consts = {name: what for g in (m.constants or {}).values() for name, what in g.items()}
    assert any("inv_freq" in what for what in consts.values()), consts
    assert not any("inv_freq" in name for name in m.weight_map)


def test_a_weight_the_graph_uses_only_through_exp_is_refused_in_one_line(model_dirs, tmp_path, monkeypatch):
    """A norm computing x * exp(w): constant folding stores exp(w), which no copy, transpose or scale/shift of
    w gives; a push would leave it stale, so the export refuses before anything is written."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.exp() * h).to(hidden_states.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    out = tmp_path / "engine"
    with pytest.raises(RefitError, match="cannot express") as e:
        build(model_dirs["tiny-llama"], out, opts=ExportOptions(max_batch=4, max_len=64, attention="plain"),
              log=lambda *_: None)
    assert "\n" not in str(e.value) and "stale" in str(e.value)
    # nothing written, no temporary folder left: only the engine folder's lock file (refit/core/integrity.py
    # engine_lock)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [f".{out.name}.lock"]


def test_lazy_engine_weight_views_are_the_engine_weights(engine_dirs, model_dirs):
    """What the exporter writes through (engine_weight_views: one tensor made when read) is exactly what a push maps
    (engine_weights), transposed and tied weights included; looking a name up makes nothing."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import DTYPES, canonical_params, engine_weight_views, engine_weights

    for arch in ("tiny-llama", "tiny-gpt2"):
        m = Manifest.read(engine_dirs[arch])
        params, _ = canonical_params(load_model(model_dirs[arch]))
        eager = engine_weights(params, m.weight_map, DTYPES[m.dtype])
        lazy = engine_weight_views(params, m.weight_map, DTYPES[m.dtype])
        assert set(lazy) == set(eager)
        for g, view in lazy.items():
            assert set(view) == set(eager[g]) and len(view) == len(eager[g]) and "no such weight" not in view
            for name in view:
                assert torch.equal(view[name], eager[g][name]) and view[name].is_contiguous()
    with pytest.raises(RefitError, match="not in the engine's weight map"):
        engine_weight_views({"nope": torch.zeros(1)}, m.weight_map, torch.float32)


def test_digests_read_buffers_in_place_and_equal_the_bytes_digest():
    """The map's content digests hash a tensor's or array's memory where it lies; the value is the digest of its bytes."""
    import hashlib

    import numpy as np

    from refit.export.weight_map import _digest, _np_digest, byte_view, tensor_bytes

    old = lambda raw, shape: hashlib.sha1(raw + str(tuple(shape)).encode()).hexdigest()  # noqa: E731
    t = torch.randn(5, 7)
    for x in (t, t.t(), t.bfloat16(), t.half()[1:3]):
        assert _digest(byte_view(x), x.shape) == old(tensor_bytes(x), x.shape)
    a = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for arr in (a, a.T, np.float32(3.0), np.zeros((0, 3), np.float32)):
        arr = np.asarray(arr)
        assert _np_digest(arr) == old(np.ascontiguousarray(arr).tobytes(), arr.shape)
    assert np.shares_memory(byte_view(t), t.numpy())
