"""int8 rollout engines (refit/export/quantize.py) against the quantize-dequantize PyTorch reference.

The reference is the fp32 HF model whose quantized Linear / Conv1D layers run ``int8_linear`` (the same int8
weights, the same per-row activation codes, exact integer products): the engine must match it to fp32 rounding,
before and after a push of perturbed fp32 tensors (re-quantized on the way in), and a push must change the output.
"""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.core.int8 import int8_linear, quantize_rows, quantize_weight
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

from conftest import quantized_reference

TOL = 2e-3  # engine vs reference log-probs: fp32 rounding may move one activation code by one step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def int8_dirs(tmp_path_factory, model_dirs):
    from conftest import BuiltOnce
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    root = tmp_path_factory.mktemp("int8")
    opts = ExportOptions(max_batch=16, max_len=128, quantize="int8")
    return BuiltOnce(lambda g: build(model_dirs[g], root / g, opts=opts, log=lambda *_: None))


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


@pytest.mark.parametrize("k", [7, 1024, 1500, 4864])
def test_int8_products_are_exact_integers(k):
    """The chunked fp32 product equals the integer product computed in int64 (the independent reference), at the
    worst case (every code +-127, sums far past fp32's 2^24) and on random codes, for K under, at and past a chunk."""
    from refit.core.int8 import exact_int_matmul

    g = torch.Generator().manual_seed(k)
    worst_x, worst_q = torch.full((2, k), 127.0), torch.full((k, 3), 127, dtype=torch.int8)
    worst_q[:, 1] = -127
    rand_x = torch.randint(-127, 128, (5, k), generator=g).float()
    rand_q = torch.randint(-127, 128, (k, 4), generator=g).to(torch.int8)
    for x, q in [(worst_x, worst_q), (rand_x, rand_q)]:
        want = x.long() @ q.long()
        got = exact_int_matmul(x, q)
        assert got.dtype == torch.float64 and torch.equal(got, want.double())
    assert exact_int_matmul(worst_x, worst_q)[0, 0] == k * 127 * 127


def test_int8_linear_weight_read_once_and_follows_its_buffers():
    """HF's T5 reads ``wo.weight`` twice per feed-forward per forward: the dequantized weight is made once and
    the same tensor returned, until the int8 weight or its scale changes (in place, by load_state_dict, or
    replaced): then the new value, checked against ``q * scale`` by hand."""
    from refit.core.int8 import Int8Linear

    def by_hand(q, scale):  # (K, N) int8 and (N,) -> the (N, K) weight a Linear holds
        return torch.tensor([[q[k][n] * scale[n] for k in range(len(q))] for n in range(len(scale))])

    lin = Int8Linear(torch.tensor([[1.0, -0.5], [-2.54, 0.25], [0.0, 0.0]]), None)  # (K=3, N=2)
    first = lin.weight
    assert lin.weight is first and lin.weight is first
    torch.testing.assert_close(first, by_hand(lin.q.tolist(), lin.scale.tolist()), rtol=0, atol=0)
    with torch.no_grad():
        lin.q[0, 0] = 7  # in place: the same tensor object, a new value
    torch.testing.assert_close(lin.weight, by_hand(lin.q.tolist(), lin.scale.tolist()), rtol=0, atol=0)
    with torch.no_grad():
        lin.scale.mul_(2)
    torch.testing.assert_close(lin.weight, by_hand(lin.q.tolist(), lin.scale.tolist()), rtol=0, atol=0)
    q2, s2 = quantize_weight(torch.tensor([[3.0, 1.0], [-1.0, 2.0], [0.5, -4.0]]))
    lin.load_state_dict({"q": q2, "scale": s2})
    torch.testing.assert_close(lin.weight, by_hand(q2.tolist(), s2.tolist()), rtol=0, atol=0)
    assert lin.weight is lin.weight
    lin.q = torch.zeros_like(q2)  # the buffer replaced
    assert float(lin.weight.abs().sum()) == 0.0
    with torch.inference_mode():  # inference tensors have no version counter: no cache, still the right value
        inf = Int8Linear(torch.tensor([[1.0, -0.5], [-2.54, 0.25], [0.0, 0.0]]), None)
        inf.q[0, 0] = 7
        torch.testing.assert_close(inf.weight, by_hand(inf.q.tolist(), inf.scale.tolist()), rtol=0, atol=0)


def test_lazy_int8_linear_holds_no_twin_and_computes_the_same():
    """``lazy`` (a reference sharing the model's weights): no int8 buffer held, the weight quantized at each forward,
    the same output and the same dequantized weight as the held twin's, and it follows the weight in place."""
    from refit.core.int8 import Int8Linear

    w = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))  # (K, N)
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    held, lazy = Int8Linear(w.clone(), None), Int8Linear(w, None, lazy=True)
    assert lazy.q is None and lazy.scale is None and list(lazy.buffers()) == []
    assert torch.equal(lazy(x), held(x)) and torch.equal(lazy.weight, held.weight)
    w.mul_(3)  # the shared weight changes: the lazy layer follows, the held twin does not
    assert torch.equal(lazy(x), Int8Linear(w.clone(), None)(x)) and not torch.equal(lazy(x), held(x))


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama", pytest.param("tiny-t5", marks=pytest.mark.slow)])  # T5: 29 s
def test_int8_engine_matches_quantized_reference_and_push(int8_dirs, model_dirs, prompts, arch):
    """GPT-2: Conv1D weights, the tied lm_head (its fp32 twin kept for the embedding); Llama: transposed
    q/k/v/o and MLP weights sharing one row quantization per input, grouped-query attention; T5: an
    encoder-decoder engine (two graphs pushed), whose HF code reads ``wo.weight.dtype`` of the substituted layer."""
    m = Manifest.read(int8_dirs[arch])
    q = m.quantization
    assert q is not None and q.max_abs_logprob_diff <= q.tolerance_logprob and q.float_matmuls == 0
    assert q.mean_abs_logprob_diff <= q.tolerance_mean and q.rounding_floor["max_abs_logprob"] >= 0
    assert q.gap_vs_fp32["max_abs_logprob"] > 10 * q.max_abs_logprob_diff  # int8 is not fp32 ...
    assert q.gap_vs_fp32["greedy_agreement"] > 0.5  # ... but close to it
    eng = OrtEngine(int8_dirs[arch])
    ref, model = quantized_reference(model_dirs[arch], m)
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
    ref2, _ = quantized_reference(model_dirs[arch], m, pushed)
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
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    for backend in ("onnx", "tensorrt"):  # fp8 needs calibrated activation scales: refused on both, in one line
        with pytest.raises(RefitError, match="fp8 is not built: .*calibrat"):
            build(model_dirs["tiny-gpt2"], tmp_path / "x", opts=ExportOptions(quantize="fp8", backend=backend))
    assert not (tmp_path / "x").exists()
    with pytest.raises(RefitError, match="starts from fp32"):
        build(model_dirs["tiny-gpt2"], tmp_path / "x", opts=ExportOptions(quantize="int8", dtype="fp16"))


def _ppo_cfg(model_dirs, engine_dir, out, **kw):
    from refit.learner.ppo.config import PPOConfig

    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dir), output_dir=str(out), steps=2,
                batch_size=4, num_generations=2, advantage_estimator="gae", num_mini_batches=2, num_ppo_epochs=1,
                response_length=4, save_steps=2,
                probe_size=4, progress=False, tensorboard=False, plots=False, max_operand=9, num_prompts=32,
                learning_rate=1e-3, warmup_steps=0, export_final=False, quantize="int8")
    return PPOConfig.from_flat(**{**base, **kw})


@pytest.mark.parametrize("ref_backend", ["auto", "onnxruntime"])
def test_kl_is_zero_at_step_zero_with_int8_policy_engine(int8_dirs, model_dirs, tmp_path, ref_backend):
    """The rollout runs in int8, the reference and the KL in fp32 (PyTorch, or an fp32 engine beside the int8 one):
    every KL estimator is 0 within 1e-6 at step 0, the mismatch is named 'precision', TIS is on by default."""
    from refit.learner.ppo.cycle import setup
    from refit.learner.ppo.route import experience
    from refit.learner.ppo.mismatch import name_mismatch

    cfg = _ppo_cfg(model_dirs, int8_dirs["tiny-gpt2"], tmp_path / "run", batch_size=8, ref_backend=ref_backend)
    assert cfg.correction == "tis"
    run = setup(cfg, resume=False, log=lambda *_: None)
    assert run.engine.manifest.quantization is not None and run.sync.contract.int8_manifest is not None
    if ref_backend == "auto":
        assert run.ref_engine is None  # PyTorch
    else:
        assert run.ref_engine.manifest.quantization is None and run.ref_engine.manifest.dtype == "fp32"
    rollout = run.engine.generate(run.prompt_ids[:8], SamplingParams(max_new_tokens=6, seed=3))
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(stats[f"kl/{k}"]) <= 1e-6, (k, stats[f"kl/{k}"])
    assert stats["mismatch/max_abs_diff"] > 1e-3  # the engine is int8, the learner fp32
    assert name_mismatch(stats, quantized=True) == "precision"
    assert "mismatch/tis_grad_scale" in stats and stats["mismatch/tis_grad_scale"] != 1.0


def test_int8_ppo_run_pushes_and_probes_against_the_quantized_learner(int8_dirs, model_dirs, tmp_path):
    """Three steps end to end: each push is probed against the learner's weights quantized as the engine does
    (an fp32 comparison would fail: the gap is the engine's precision); the log names 'precision' once."""
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    lines: list[str] = []
    run_dir = run_ppo(_ppo_cfg(model_dirs, int8_dirs["tiny-gpt2"], tmp_path / "run", steps=3, save_steps=3,
                               probe_on_rollout=False), log=lines.append)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "reward/mean" in r and "kl/exact" in r]
    assert abs(train[0]["kl/exact"]) < 1e-6
    assert all(r["probe/max_abs_logprob_diff"] < 1e-3 for r in train)
    assert all(r["mismatch/max_abs_diff"] > 1e-3 for r in train)
    told = [ln for ln in lines if "mismatch (precision)" in ln]
    assert len(told) == 1 and "correction: tis" in told[0], lines


def test_int8_push_not_taken_is_caught_by_the_probe(int8_dirs, model_dirs, prompts, tmp_path):
    """The learner moved every weight by 1e-3 (AdamW's first step at lr 1e-3): an int8 engine that did not take
    the push fails the probe; once pushed, it passes (against the learner quantized as the engine is)."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params
    from refit.learner.run.sync import Contract, WeightSync

    m = Manifest.read(int8_dirs["tiny-gpt2"])
    eng = OrtEngine(int8_dirs["tiny-gpt2"])
    model = load_model(model_dirs["tiny-gpt2"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.sign(torch.randn(p.shape, generator=gen)))
    probe = eng.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True))
    sync = WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-3, int8_manifest=m), tmp_path)
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(model)
    eng.update_weights(canonical_params(model)[0])
    assert sync.check_now(model) <= 1e-3


def test_int8_rounding_floor_measured_once_and_again_when_a_push_needs_it(int8_dirs, model_dirs, prompts, tmp_path,
                                                                          monkeypatch):
    """With the tolerance below the int8 gap (probe_tol 0: every probe takes the floor's route), the rounding floor is
    measured at the first probe only; later probes within twice it reuse it; a stale engine (the learner moved, the
    engine not pushed) lands above it, so the floor is measured again before the probe fails, and the failure stands;
    after FLOOR_EVERY probes it is measured again even when pushes pass."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params
    from refit.learner.run import sync as sync_mod

    calls: list[float] = []
    real = sync_mod.rounding_floor

    def counted(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]

    monkeypatch.setattr(sync_mod, "rounding_floor", counted)
    eng = OrtEngine(int8_dirs["tiny-gpt2"])
    model = load_model(model_dirs["tiny-gpt2"])
    probe = eng.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True))
    contract = sync_mod.Contract(temperature=1.0, probe_tol=0.0, int8_manifest=Manifest.read(int8_dirs["tiny-gpt2"]))
    sync = sync_mod.WeightSync(eng, probe, contract, tmp_path)
    first = sync.check_now(model)
    assert len(calls) == 1 and 0 < first <= 2 * calls[0]
    assert sync.check_now(model) == first and len(calls) == 1  # the same weights: the floor is not measured again
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.sign(torch.randn(p.shape, generator=gen)))
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(model)  # stale: above twice the floor, measured again for these weights, and still above
    assert len(calls) == 2
    eng.update_weights(canonical_params(model)[0])
    for _ in range(sync_mod.FLOOR_EVERY - 1):
        assert sync.check_now(model) <= 2 * calls[-1]
    assert len(calls) == 2  # within twice the floor measured for the stale probe: reused
    sync.check_now(model)
    assert len(calls) == 3  # the probes since that measurement reached FLOOR_EVERY


# ----------------------------------------------------------------------------- TensorRT's scheme: weight-only Q/DQ
# The graph TensorRT builds from (``--backend tensorrt --quantize int8``), run here by ONNX Runtime's CPU provider:
# the same ops, so the same numbers up to fp32 summation order. tests/test_tensorrt.py builds and refits it.

QDQ_TOL = 1e-5  # ORT CPU vs the fp32 matmul by dequantized weights: measured ~2e-7 (export gate, tiny-gpt2/llama)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_qdq_graph_structure(qdq_engine_dirs, arch):
    """Every quantized weight: an int8 (K, N) external initializer -> DequantizeLinear(axis=1) with a float32 (N,)
    scale -> the B input of a MatMul / Gemm (transB=0); nothing of ONNX Runtime's int8 scheme; the gate's record."""
    import onnx

    from refit.core.int8 import QDQ
    from refit.rollout.tensorrt.check import check_engine_folder
    from refit.rollout.tensorrt.check_weights import check_qdq

    d = qdq_engine_dirs[arch]
    m = Manifest.read(d)
    q = m.quantization
    assert q.scheme == QDQ and q.float_matmuls == 0 and q.rounding_floor == {}
    assert q.max_abs_logprob_diff <= QDQ_TOL and q.tolerance_logprob == 1e-4  # measured, not just passed
    assert q.gap_vs_fp32["max_abs_logprob"] > 100 * q.max_abs_logprob_diff  # int8 weights are not fp32 ones
    proto = onnx.load(str(d / "decoder.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    ops = [n.op_type for n in proto.graph.node]
    assert "MatMulInteger" not in ops and "MatMulNBits" not in ops
    twins = q.weights["decoder"]
    refit_names = [n for tw in twins.values() for n in (tw.weight, tw.scale)]
    assert len(refit_names) == len(set(refit_names)), "each int8 weight and scale belongs to one fp32 weight"
    targets = [t.engine for ts in m.weight_map.values() for t in ts if t.graph == "decoder"]
    assert all(targets.count(w) == 1 for w in twins), "each quantized weight is fed by one weight-map entry"
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == len(twins) == q.quantized_matmuls
    for tw in twins.values():
        w, s = inits[tw.weight], inits[tw.scale]
        assert w.data_type == onnx.TensorProto.INT8 and s.data_type == onnx.TensorProto.FLOAT
        assert tuple(s.dims) == (w.dims[1],) and w.data_location == s.data_location == onnx.TensorProto.EXTERNAL
    for n in proto.graph.node:
        if n.op_type == "Gemm":
            assert all(a.i == 0 for a in n.attribute if a.name == "transB")
    assert check_qdq(m, d / "decoder.onnx") == [] and check_engine_folder(d) == []


def test_qdq_check_catches_planted_faults(qdq_engine_dirs, fresh_copy):
    """A DequantizeLinear on the wrong axis, and a twin the record does not list (a push would never write it)."""
    import dataclasses
    import onnx

    from refit.rollout.tensorrt.check_weights import check_qdq, check_weight_map

    d = fresh_copy(qdq_engine_dirs["tiny-llama"], "l")
    m = Manifest.read(d)
    proto = onnx.load(str(d / "decoder.onnx"), load_external_data=False)
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear")
    next(a for a in dq.attribute if a.name == "axis").i = 0
    onnx.save(proto, str(d / "decoder.onnx"))
    assert any("axis 1" in p for p in check_qdq(m, d / "decoder.onnx")), check_qdq(m, d / "decoder.onnx")
    fp32_name, tw = next((k, v) for k, v in m.quantization.weights["decoder"].items() if v.weight == dq.input[0])
    dropped = {g: {k: v for k, v in ws.items() if k != fp32_name} for g, ws in m.quantization.weights.items()}
    m2 = dataclasses.replace(m, quantization=dataclasses.replace(m.quantization, weights=dropped))
    assert any(f"reads {tw.weight}, which is no quantized weight" in p for p in check_qdq(m2, d / "decoder.onnx"))
    problems = check_weight_map(m2, d / "decoder.onnx")
    assert any(f"{tw.weight} is the target of 0" in p for p in problems), problems


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_qdq_engine_matches_reference_and_push_requantizes(qdq_engine_dirs, model_dirs, prompts, arch):
    """ORT CPU on TensorRT's Q/DQ graph = the fp32 forward by dequantized weights, to fp32 rounding; a push of
    perturbed fp32 tensors is re-quantized into the int8 twins and scales, changes the output, and matches the
    reference holding the same perturbed tensors; the real tensors bring the first output back."""
    m = Manifest.read(qdq_engine_dirs[arch])
    eng = OrtEngine(qdq_engine_dirs[arch])
    ref, model = quantized_reference(model_dirs[arch], m)
    batch = ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
    before = _score(eng, batch)
    torch.testing.assert_close(before, _score(ref, batch), atol=QDQ_TOL, rtol=0)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    pushed = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in params.items()}
    twin = next(iter(m.quantization.weights["decoder"].values()))
    held = eng.weights["decoder"][twin.weight].clone()
    eng.update_weights(pushed)
    assert not torch.equal(eng.weights["decoder"][twin.weight], held), "the int8 twin was not re-quantized"
    after = _score(eng, batch)
    assert (after - before).abs().max() > 1e-2, "a perturbed push must change the output"
    ref2, _ = quantized_reference(model_dirs[arch], m, pushed)
    torch.testing.assert_close(after, _score(ref2, batch), atol=QDQ_TOL, rtol=0)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(eng.generate(prompts, greedy).response_ids, ref2.generate(prompts, greedy).response_ids)
    eng.update_weights({n: p.detach() for n, p in params.items()})
    torch.testing.assert_close(_score(eng, batch), before, atol=1e-6, rtol=0)
