"""int8 rollout engines (export/quantize.py) against the quantize-dequantize PyTorch reference.

The reference is the fp32 HF model whose quantized Linear / Conv1D layers run ``int8_linear`` (the same int8
weights, the same per-row activation codes, exact integer products): the engine must match it to fp32 rounding,
before and after a push of perturbed fp32 tensors (re-quantized on the way in), and a push must change the output.
"""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.quantize import int8_linear, quantize_rows, quantize_weight, reference_model
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

TOL = 2e-3  # engine vs reference log-probs: fp32 rounding may move one activation code by one step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def int8_dirs(tmp_path_factory, model_dirs):
    from conftest import BuiltOnce
    from refit.export.onnx_export import ExportOptions, export_onnx

    root = tmp_path_factory.mktemp("int8")
    return BuiltOnce(lambda g: export_onnx(model_dirs[g], root / g, ExportOptions(max_batch=16, max_len=128,
                                                                                  quantize="int8"), log=lambda *_: None))


def _reference(model_dir, manifest, pushed=None):
    """TorchEngine over the quantize-dequantize model of ``model_dir``'s weights (with ``pushed`` loaded first)."""
    from refit.core.checkpoint import load_model

    model = load_model(model_dir)
    if pushed:
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for n, t in pushed.items():
                params[n].copy_(t)
    return TorchEngine(reference_model(model, manifest)), model


def _score(eng, batch):
    return eng.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask).logprobs


def test_quantize_weight_by_hand():
    w = torch.tensor([[1.0, -0.5], [-2.54, 0.25], [0.0, 0.0]])  # (K=3, N=2)
    q, s = quantize_weight(w)
    torch.testing.assert_close(s, torch.tensor([2.54 / 127, 0.5 / 127]))
    assert q.dtype == torch.int8 and q.tolist() == [[50, -127], [-127, 64], [0, 0]]  # 0.25/(0.5/127) = 63.5 -> 64
    codes, t = quantize_rows(torch.tensor([[0.0, 0.0], [1.0, -0.5]]))
    assert codes.tolist() == [[0.0, 0.0], [127.0, -64.0]] and t[1, 0] == 1.0 / 127  # -63.5 -> -64 (half to even)
    x = torch.tensor([[1.0, -0.5, 0.25]])
    want = (codes_x := quantize_rows(x)[0]) @ q.float() * (x.abs().max() / 127) * s
    torch.testing.assert_close(int8_linear(x, q, s, None), want)
    assert codes_x.tolist() == [[127.0, -64.0, 32.0]]


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_int8_engine_matches_quantized_reference_and_push(int8_dirs, model_dirs, prompts, arch):
    """GPT-2: Conv1D weights, the tied lm_head (its fp32 twin kept for the embedding); Llama: transposed
    q/k/v/o and MLP weights sharing one row quantization per input, grouped-query attention."""
    m = Manifest.read(int8_dirs[arch])
    q = m.quantization
    assert q is not None and q.max_abs_logprob_diff <= q.tolerance_logprob and q.float_matmuls == 0
    assert q.gap_vs_fp32["max_abs_logprob"] > 10 * q.max_abs_logprob_diff  # int8 is not fp32 ...
    assert q.gap_vs_fp32["greedy_agreement"] > 0.5  # ... but close to it
    eng = OrtEngine(int8_dirs[arch])
    ref, model = _reference(model_dirs[arch], m)
    batch = ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
    before = _score(eng, batch)
    torch.testing.assert_close(before, _score(ref, batch), atol=TOL, rtol=0)
    fp32 = _score(TorchEngine(model), batch)
    assert (before - fp32).abs().max() > 10 * (before - _score(ref, batch)).abs().max()

    gen = torch.Generator().manual_seed(1)
    params = dict(model.named_parameters())
    pushed = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in params.items()}
    eng.update_weights(pushed)
    after = _score(eng, batch)
    assert (after - before).abs().max() > 1e-2, "a perturbed push must change the output"
    ref2, _ = _reference(model_dirs[arch], m, pushed)
    torch.testing.assert_close(after, _score(ref2, batch), atol=TOL, rtol=0)  # re-quantized exactly as the reference
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(eng.generate(prompts, greedy).response_ids, ref2.generate(prompts, greedy).response_ids)
    eng.update_weights({n: p.detach() for n, p in params.items()})  # restore
    torch.testing.assert_close(_score(eng, batch), before, atol=1e-6, rtol=0)


def test_int8_rows_are_independent(int8_dirs, prompts):
    """Per-row activation scales: a row's log-probs do not depend on the rows beside it."""
    eng = OrtEngine(int8_dirs["tiny-gpt2"])
    batch = eng.generate(prompts, SamplingParams(max_new_tokens=6, seed=3))
    full = _score(eng, batch)
    for i in range(len(prompts)):
        one = eng.score(batch.prompt_ids[i:i + 1], batch.prompt_mask[i:i + 1], batch.response_ids[i:i + 1],
                        batch.response_mask[i:i + 1]).logprobs
        m = batch.response_mask[i].bool()
        torch.testing.assert_close(one[0][m], full[i][m], atol=1e-5, rtol=0)


def test_bad_quantize_option_is_one_line(model_dirs, tmp_path):
    from refit.export.onnx_export import ExportOptions, export_onnx

    with pytest.raises(RefitError, match="fp8: TensorRT only"):
        export_onnx(model_dirs["tiny-gpt2"], tmp_path / "x", ExportOptions(quantize="fp8"))
    with pytest.raises(RefitError, match="starts from fp32"):
        export_onnx(model_dirs["tiny-gpt2"], tmp_path / "x", ExportOptions(quantize="int8", dtype="fp16"))
