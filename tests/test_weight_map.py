"""The weight map decides by provenance (export/weight_map.py): buffers are graph constants, an elementwise
affine transform of a weight is mapped, anything else the exporter derives from a weight is refused."""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest, WeightTarget
from refit.export.onnx_export import ExportOptions
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
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no temporary folder left
