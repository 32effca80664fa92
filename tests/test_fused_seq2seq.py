"""Fused encoder-decoder graphs (refit/export/fused_seq2seq.py) and their engine state
(refit/rollout/ort_fused.FusedSeq2SeqState): T5 (relative position bias), BART and Marian (absolute positions, per row).

Fused graph vs plain graph vs the PyTorch reference on the tiny T5, BART and Marian (encoder inputs of six lengths,
right-padded on the encoder's native side; decoder rows compact in the buffers, finished rows idle),
greedy and sampled, incremental decode and chunked score(); the eager wrapper (``refit::gqa`` with the
bias as ``attention_bias``) against HF's own forward, row by row; static slot batches; a weight push
(the KV buffer reused across batches: tests/test_fused.py, with the decoder-only engines). Tolerance: 1e-4 on log-probs (the export gate's fp32 tolerance).
The KL-at-step-0 tests of tests/test_ppo_cycle.py run on this engine (engine_dirs["tiny-t5"] is fused).
"""

from __future__ import annotations

import pytest
import torch

from conftest import same_rows
from refit.core.manifest import Manifest
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams

ARCH = "tiny-t5"
ARCHS = [ARCH] + [pytest.param(a, marks=pytest.mark.slow) for a in ("tiny-bart", "tiny-marian")]  # CI time: T5 here, BART in the cycles
TEXTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7", "1+1=", "sort 55 = "]
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t).input_ids for t in TEXTS]


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _same(a, b, tol=TOL):
    same_rows(a, b, tol)


def test_t5_export_is_fused_and_gated(engine_dirs):
    m = Manifest.read(engine_dirs[ARCH])
    assert m.attention == "fused" and m.parity.max_abs_logprob_diff < TOL
    print(f"\nT5 fused export parity gate: max|dlogprob| {m.parity.max_abs_logprob_diff:.2e}")
    assert (engine_dirs[ARCH] / "decoder.onnx").read_bytes().count(b"GroupQueryAttention") >= m.dims.n_layers
    assert b"GroupQueryAttention" not in (engine_dirs[ARCH] / "encoder.onnx").read_bytes()
    bias = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert [t.graph for t in m.weight_map[bias]] == ["decoder"]  # the bias weight is mapped: pushable
    assert {t.graph for t in m.weight_map["decoder.block.0.layer.1.EncDecAttention.k.weight"]} == {"encoder"}


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, greedy=True),
                                    SamplingParams(max_new_tokens=12, seed=3, temperature=0.9, top_k=50, top_p=0.95,
                                                   stop_ids=tuple(range(5, 60)))], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arch", ARCHS)
def test_seq2seq_fused_plain_torch_parity(engine_dirs, plain_engine_dirs, prompts, params, arch):
    fused = create_engine("onnxruntime", engine_dirs[arch])
    plain, ref = create_engine("onnxruntime", plain_engine_dirs[arch]), create_engine("torch", engine_dirs[arch])
    assert Manifest.read(engine_dirs[arch]).attention == "fused"
    assert Manifest.read(plain_engine_dirs[arch]).attention == "plain"
    a, p, r = fused.generate(prompts, params), plain.generate(prompts, params), ref.generate(prompts, params)
    assert a.prompt_mask.min() == 0 and len(set(a.prompt_mask.sum(1).tolist())) > 3, "encoder inputs are padded"
    print(f"\n{arch} {'greedy' if params.greedy else 'sampled'} max|dlogprob| fused-plain "
          f"{_max_diff(a.rollout_plain_logprobs, p.rollout_plain_logprobs):.2e} fused-torch "
          f"{_max_diff(a.rollout_plain_logprobs, r.rollout_plain_logprobs):.2e}")
    _same(a, p)
    _same(a, r)
    args = (a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask)
    t = 1.0 if params.greedy else params.temperature
    s_fused, s_ref = fused.score(*args, t, chunk_size=3), ref.score(*args, t)  # decoder start + chunks of 3
    print(f"{arch} score max|dlogprob| fused-torch {_max_diff(s_fused.logprobs, s_ref.logprobs):.2e}")
    torch.testing.assert_close(s_fused.logprobs, s_ref.logprobs, atol=TOL, rtol=0)
    torch.testing.assert_close(s_fused.logprobs, a.rollout_plain_logprobs, atol=TOL, rtol=0)


def test_t5_reference_op_matches_hf(model_dirs):
    """The wrapper run eagerly (refit::gqa with the bias as attention_bias, cross-attention over given K/V)
    equals HF's own forward of each row alone: a prefill of rows of 3, 2 and 1 tokens, then cached steps
    where the shorter rows finish and idle (query length 0)."""
    from refit.core.hf_folder import load_model, model_info
    from refit.export.fused_seq2seq import FusedSeq2SeqDecoder

    info = model_info(model_dirs[ARCH])
    ref, wrapped = load_model(model_dirs[ARCH], info), FusedSeq2SeqDecoder(load_model(model_dirs[ARCH], info))
    cfg, g = ref.config, torch.Generator().manual_seed(0)
    L, H, D, b, se, cap = cfg.num_decoder_layers, cfg.num_heads, cfg.d_kv, 3, 6, 9
    enc_ids, emask = torch.randint(4, 200, (b, se), generator=g), torch.ones(b, se, dtype=torch.long)
    emask[1, 4:], emask[2, 2:] = 0, 0
    lens = [6, 3, 5]
    rows = [torch.cat([torch.tensor([cfg.decoder_start_token_id]), torch.randint(4, 200, (n - 1,), generator=g)])
            for n in lens]
    with torch.no_grad():
        hidden = ref.get_encoder()(input_ids=enc_ids, attention_mask=emask).last_hidden_state
        cross = [f(hidden).view(b, se, H, D).transpose(1, 2) for blk in ref.get_decoder().block
                 for f in (blk.layer[1].EncDecAttention.k, blk.layer[1].EncDecAttention.v)]
        past, n = [torch.zeros(b, H, cap, D) for _ in range(2 * L)], torch.zeros(b, dtype=torch.int32)
        new = torch.tensor([3, 2, 1], dtype=torch.int32)
        ids = torch.zeros(b, 3, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :new[i]] = r[:new[i]]
        worst = 0.0
        for step in range(5):
            pos = n.long()[:, None] + torch.arange(ids.shape[1])
            out = wrapped(ids, pos, n + new - 1, new, torch.tensor(cap, dtype=torch.int32),
                          (new - 1).clamp(min=0).long()[:, None], emask, *cross, *past)
            past, n = list(out[1:]), n + new
            for i in torch.nonzero(new).flatten().tolist():
                want = ref(input_ids=enc_ids[i:i + 1], attention_mask=emask[i:i + 1],
                           decoder_input_ids=rows[i][None, :n[i]]).logits[0, -1]
                worst = max(worst, _max_diff(out[0][i, 0], want))
            new = torch.tensor([int(n[i] < lens[i]) for i in range(b)], dtype=torch.int32)
            ids = torch.stack([rows[i][n[i]:n[i] + 1] if new[i] else torch.zeros(1, dtype=torch.long) for i in range(b)])
    assert n.tolist() == lens, "every row decoded to its end, the shorter ones idling meanwhile"
    assert worst < 1e-5, worst
    assert int((past[0][:, :, max(lens):] != 0).sum()) == 0, "nothing written past the longest row"


def test_t5_static_slot_batches_give_the_same_rows(engine_dirs, prompts):
    """No in-flight slots for seq2seq (one encoder run's cross K/V per batch): slots=4 runs static batches
    of 4 over the reused buffers, rows identical to one batch."""
    from refit.rollout.decode import supports_slots

    params = SamplingParams(max_new_tokens=8, seed=5, n=2, stop_ids=tuple(range(5, 60)))
    one = create_engine("onnxruntime", engine_dirs[ARCH])
    four = create_engine("onnxruntime", engine_dirs[ARCH], slots=4)
    assert not supports_slots(four._new_state(16))
    _same(one.generate(prompts, params), four.generate(prompts, params), tol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_seq2seq_weight_push_into_fused_engine(engine_dirs, model_dirs, prompts, arch):
    """Perturbed weights (T5: the relative-bias table first, alone) change the fused engine's output and match
    the reference holding them; restored weights give the original output."""
    from refit.rollout.torch_backend import TorchEngine

    eng, ref = create_engine("onnxruntime", engine_dirs[arch]), TorchEngine(model_dirs[arch])
    probe = ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
    args = (probe.prompt_ids, probe.prompt_mask, probe.response_ids, probe.response_mask)
    before = eng.score(*args).logprobs
    params = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    g = torch.Generator().manual_seed(0)  # random per bucket and head (a constant shift is softmax-invariant)
    if arch == ARCH:
        bias = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        eng.update_weights({bias: params[bias] + torch.randn(params[bias].shape, generator=g)})
        assert _max_diff(eng.score(*args).logprobs, before) > 1e-3, "the decoder bias table is a live engine weight"
    new = {n: p + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    eng.update_weights(new)
    ref.update_weights(new)
    after = eng.score(*args).logprobs
    assert _max_diff(after, before) > 1e-2, "the push changed the output"
    print(f"\n{arch} pushed weights max|dlogprob| fused-torch {_max_diff(after, ref.score(*args).logprobs):.2e}")
    torch.testing.assert_close(after, ref.score(*args).logprobs, atol=TOL, rtol=0)
    eng.update_weights(params)
    torch.testing.assert_close(eng.score(*args).logprobs, before, atol=1e-6, rtol=0)
