"""Rollout engines: ONNX Runtime against the PyTorch reference, on all three geometries.

Parity is a matrix (STYLE.md): backend x padding (alone vs inside a padded batch) x decoding
(greedy, seeded sampling with truncation) x cache (incremental decode vs score()'s chunked
forward vs one uncached HF forward). Tolerances: log-probs 1e-4 across backends (the export
parity gate's fp32 tolerance), 1e-5 for padding invariance within one backend.
"""

from __future__ import annotations

import json

import pytest
import torch

from export.errors import RefitError
from export.padding import position_ids_from_mask
from rollout.engine import Engine, backends, check_version, create_engine, register_backend
from rollout.types import SamplingParams

ARCHS = ["tiny-gpt2", "tiny-llama", "tiny-t5"]
TEXTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7"]
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(engine_dirs):
    """{arch: (torch reference engine, onnxruntime engine)} on the session's engine folders."""
    out = {a: (create_engine("torch", engine_dirs[a]), create_engine("onnxruntime", engine_dirs[a])) for a in ARCHS}
    yield out
    for ref, ort in out.values():
        ref.close()
        ort.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t).input_ids for t in TEXTS]


def _assert_same_rollout(a, b, tol=TOL):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=tol, rtol=0)
    torch.testing.assert_close(a.rollout_plain_logprobs, b.rollout_plain_logprobs, atol=tol, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, greedy=True),
                                    SamplingParams(max_new_tokens=10, seed=3, temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_ort_matches_torch_on_padded_batch(engines, prompts, arch, params):
    ref, ort = engines[arch]
    a, b = ref.generate(prompts, params), ort.generate(prompts, params)
    assert len({len(p) for p in prompts}) > 1 and a.prompt_mask.min() == 0, "the batch really is padded"
    _assert_same_rollout(a, b)
    if params.greedy:
        assert (b.rollout_logprobs == 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_invariance(engines, prompts, arch):
    params = SamplingParams(max_new_tokens=8, greedy=True)
    for eng in engines[arch]:
        batch = eng.generate(prompts, params)
        for i in (0, 2, 3):
            alone = eng.generate([prompts[i]], params)
            tr = alone.response_ids.shape[1]
            assert torch.equal(batch.response_ids[i, :tr], alone.response_ids[0])
            torch.testing.assert_close(batch.rollout_plain_logprobs[i, :tr], alone.rollout_plain_logprobs[0],
                                       atol=1e-5, rtol=0)


def test_seed_reproducibility(engines, prompts):
    _, ort = engines["tiny-llama"]
    p = SamplingParams(max_new_tokens=8, seed=7)
    a, b = ort.generate(prompts, p), ort.generate(prompts, p)
    c = ort.generate(prompts, SamplingParams(max_new_tokens=8, seed=8))
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_n_samples_prompt_major(engines, prompts, arch):
    _, ort = engines[arch]
    batch = ort.generate(prompts[:3], SamplingParams(max_new_tokens=6, n=3, seed=0))
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in range(batch.num_rows):
        real = batch.prompt_ids[r][batch.prompt_mask[r] > 0].tolist()
        assert real == prompts[int(batch.prompt_index[r])]
    for p in range(3):
        rows = batch.response_ids[3 * p:3 * p + 3]
        assert not (torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])), "samples differ"


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_uneven_stops(engines, prompts, arch):
    """A stop id emitted at step 2 by one row: that row's mask ends there (stop included), others run on."""
    _, ort = engines[arch]
    base = SamplingParams(max_new_tokens=8, seed=11)
    free = ort.generate(prompts, base)
    eos = ort.spec.eos_id
    cand = [int(free.response_ids[r, 2]) for r in range(free.num_rows)
            if int(free.response_ids[r, 2]) not in free.response_ids[r, :2].tolist() + [eos]
            and free.response_mask[r, 2] == 1]
    assert cand, "no usable stop candidate in the free run"
    stop = cand[0]
    batch = ort.generate(prompts, SamplingParams(max_new_tokens=8, seed=11, stop_ids=(stop,)))
    lengths = []
    for r in range(batch.num_rows):
        toks = free.response_ids[r].tolist()
        hits = [i for i, t in enumerate(toks) if t in (stop, eos) and free.response_mask[r, i] == 1]
        n = hits[0] + 1 if hits else int(free.response_mask[r].sum())
        lengths.append(n)
        assert batch.response_mask[r, :n].eq(1).all() and batch.response_mask[r, n:].eq(0).all()
        assert batch.response_ids[r, :n].tolist() == toks[:n]
        assert batch.response_ids[r, n:].eq(ort.spec.pad_id).all()
        assert batch.rollout_logprobs[r, n:].eq(0).all() and batch.rollout_plain_logprobs[r, n:].eq(0).all()
    assert 3 in lengths and len(set(lengths)) > 1, f"stops are uneven: {lengths}"
    assert batch.response_ids.shape[1] == max(lengths), "generation ends when every row has stopped"


def test_processed_vs_plain_logprobs(engines, prompts):
    _, ort = engines["tiny-gpt2"]
    plain = ort.generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
    torch.testing.assert_close(plain.rollout_logprobs, plain.rollout_plain_logprobs, atol=1e-6, rtol=0)
    k = 5
    top = ort.generate(prompts, SamplingParams(max_new_tokens=8, seed=1, top_k=k, temperature=1.5, return_topk=k))
    m = top.response_mask > 0
    assert (top.rollout_logprobs[m] >= top.rollout_plain_logprobs[m] - 1e-6).all()
    assert (top.rollout_logprobs[m] > top.rollout_plain_logprobs[m]).any()
    inside = (top.topk_ids == top.response_ids[..., None]).any(-1)
    assert inside[m].all(), "every sampled token is one of the top-k"


@pytest.mark.parametrize("arch", ARCHS)
def test_score_reproduces_rollout_plain_logprobs(engines, prompts, arch):
    ref, ort = engines[arch]
    params = SamplingParams(max_new_tokens=9, seed=5, temperature=0.7, top_p=0.95)
    batch = ref.generate(prompts, params)
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    for eng in (ort, ref):
        s = eng.score(*args, temperature=0.7, chunk_size=3)
        torch.testing.assert_close(s.logprobs, batch.rollout_plain_logprobs, atol=TOL, rtol=0)
    whole = ort.score(*args, temperature=0.7, chunk_size=64)
    torch.testing.assert_close(whole.logprobs, batch.rollout_plain_logprobs, atol=TOL, rtol=0)


@torch.no_grad()
def _hf_full_logits(model, batch, start_id):
    """Uncached HF forward over prompt + response: (B, Tr, V) logits predicting each response token."""
    tr = batch.response_ids.shape[1]
    if batch.is_seq2seq:
        start = torch.full((batch.num_rows, 1), start_id, dtype=torch.long)
        dec = torch.cat([start, batch.response_ids[:, :-1]], 1)
        return model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, decoder_input_ids=dec).logits
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return logits[:, batch.prompt_ids.shape[1] - 1:-1][:, :tr]


@pytest.mark.parametrize("arch", ARCHS)
def test_teacher_topk_matches_full_vocab_reference(engines, prompts, model_dirs, arch):
    from export.checkpoint import load_model

    ref, ort = engines[arch]
    k, temp = 6, 1.3
    batch = ort.generate(prompts, SamplingParams(max_new_tokens=7, seed=2, return_topk=k, temperature=temp))
    s = ort.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                  temperature=temp, topk=k, chunk_size=2)
    logits = _hf_full_logits(load_model(model_dirs[arch]), batch, ort.spec.decoder_start_id)
    want_lp, want_ids = torch.topk(torch.log_softmax(logits.float() / temp, -1), k, dim=-1)
    m = batch.response_mask > 0
    for got_lp, got_ids in ((s.topk_logprobs, s.topk_ids), (batch.topk_logprobs, batch.topk_ids)):
        torch.testing.assert_close(got_lp[m], want_lp[m], atol=TOL, rtol=0)
        gaps = (want_lp[..., :-1] - want_lp[..., 1:]).min(-1).values > 1e-4  # ids only where no near-tie
        assert torch.equal(got_ids[m & gaps], want_ids[m & gaps])
    assert (s.topk_logprobs[~m] == 0).all() and (s.topk_ids[~m] == ort.spec.pad_id).all()


@pytest.mark.parametrize("backend", [0, 1], ids=["torch", "onnxruntime"])
def test_bad_input_is_one_line_refit_error(engines, prompts, backend):
    eng = engines["tiny-gpt2"][backend]
    p = SamplingParams(max_new_tokens=8)
    cases = {"no prompts": [], "is empty": [prompts[0], []], "max_len": [[5] * 125], "outside": [[5, 100000]]}
    for needle, bad in cases.items():
        with pytest.raises(RefitError) as e:
            eng.generate(bad, p)
        assert needle in str(e.value) and "\n" not in str(e.value)
    eng.generate([[5] * 120], p)  # exactly max_len (128) is fine


def test_score_rejects_bad_padding(engines, prompts):
    _, ort = engines["tiny-gpt2"]
    batch = ort.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    args = [batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask]
    holey = batch.response_mask.clone()
    holey[0, 0] = 0.0  # padding before a real response token
    assert batch.prompt_mask[:, 0].eq(0).any(), "some prompt is left-padded"
    for i, bad in ((1, batch.prompt_mask.flip(-1)), (3, holey)):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(RefitError, match="padding rule"):
            ort.score(*wrong)
    empty = ort.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids[:, :0], batch.response_mask[:, :0])
    assert empty.logprobs.shape == (len(prompts), 0)


def test_registry_and_protocol(engines, engine_dirs):
    assert {"torch", "onnxruntime", "tensorrt"} <= set(backends())
    for eng in engines["tiny-gpt2"]:
        assert isinstance(eng, Engine)
    with pytest.raises(RefitError, match="unknown backend"):
        create_engine("vllm", engine_dirs["tiny-gpt2"])
    register_backend("test-missing", "rollout.no_such_backend_module:Nope")
    with pytest.raises(RefitError, match="not available"):
        create_engine("test-missing", engine_dirs["tiny-gpt2"])
    with pytest.raises(ValueError):
        register_backend("bad", "no-colon")


def test_batch_tensors_work_with_autograd(engines, prompts):
    """Generation runs under no_grad, not inference_mode: the learner multiplies these into its graph."""
    _, ort = engines["tiny-gpt2"]
    batch = ort.generate(prompts, SamplingParams(max_new_tokens=3, seed=0))
    w = torch.ones_like(batch.rollout_logprobs, requires_grad=True)
    ((w * batch.response_mask) * batch.rollout_logprobs).sum().backward()
    assert w.grad is not None


def test_check_version(engines, prompts):
    _, ort = engines["tiny-gpt2"]
    batch = ort.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    check_version(batch, ort.weights_version)
    with pytest.raises(RefitError, match="stale"):
        check_version(batch, ort.weights_version + 1)


def test_cli_smoke(engine_dirs, capsys, tmp_path):
    from rollout.cli import main

    d = str(engine_dirs["tiny-gpt2"])
    assert main([d, "--prompt", "12+34=", "--prompt", "7", "--max-new-tokens", "4", "--seed", "0", "--n", "2",
                 "--top-k", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(doc["completions"]) == 4 and doc["completions"][1]["prompt_index"] == 0
    f = tmp_path / "prompts.txt"
    f.write_text("sort 321 = \n\n1+1=\n")
    assert main([str(engine_dirs["tiny-t5"]), "--prompts-file", str(f), "--greedy", "--max-new-tokens", "3",
                 "--backend", "torch"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "mean log-prob" in out[0]
    with pytest.raises(RefitError):
        main([d, "--max-new-tokens", "2"])
