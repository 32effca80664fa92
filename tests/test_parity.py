"""Backend parity, as one matrix: every registered backend against the PyTorch reference.

Dimensions (torchtune ``test_reproducibility_batched``):

- backend: every name in ``refit.rollout.engine.backends()`` but the reference ``torch``, plus
  ``tensorrt-stand-in`` (the TrtEngine code paths on the host stand-in of
  tests/tensorrt_standin.py); ``tensorrt`` itself skips with the reason where it cannot run;
- dtype: fp32, and fp16 where the backend's row of ``conftest.ATOL`` has it (``FP16_ARCHS``);
- architecture: ``conftest.ARCHS`` -- GPT-2 and Llama with left-padded prompts, T5, BART and
  Marian with a right-padded encoder input; the prompts have four lengths, so every batch is padded;
- decoding: greedy and seeded sampling with temperature/top-k/top-p truncation;
- cache: generate (prefill + one-token cached steps) and score (prefill + chunks of 1, 3 or
  all positions through the cache) against one uncached HF forward over prompt + response.

Checks: greedy tokens exactly equal (fp16 rows may part at a near-tie of the reference, see
:func:`_assert_greedy_agree`); ``rollout_logprobs``, ``rollout_plain_logprobs``, top-k and
``score()`` log-probs ``assert_close(atol=ATOL[backend][dtype], rtol=0)``; a prompt alone equals
the same prompt inside the padded batch (``PAD_ATOL``); and the ``on_step`` hook's events.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, ATOL, FP16_ARCHS, PAD_ATOL
from refit.core.padding import position_ids_from_mask
from refit.rollout.engine import backends, create_engine
from refit.rollout.types import SamplingParams

REFERENCE = "torch"
OTHERS = sorted({*backends(), "tensorrt-stand-in"} - {REFERENCE})
SAME_SAMPLER = {"torch", "onnxruntime", "tensorrt", "tensorrt-stand-in"}  # refit.rollout.sampling with one seeded stream
GREEDY = SamplingParams(max_new_tokens=8, greedy=True, return_topk=2)  # top-2: the near-tie test
SAMPLED = SamplingParams(max_new_tokens=8, seed=3, temperature=0.8, top_k=20, top_p=0.9, return_topk=4)
SCORE_TEMP, SCORE_TOPK = 0.7, 5
CHUNKS = [1, 3, 64]  # 64 > any response here: the whole response in one cached forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cases(names, dtypes=("fp32", "fp16")):
    """(backend, dtype, arch) params for the backends in ``names`` that have a tolerance for the dtype."""
    out = []
    for b in names:
        for dt in ATOL.get(b, {"fp32": None}):  # no row: still run, so test_table_covers_... names it
            if dt in dtypes:
                marks = [pytest.mark.tensorrt, pytest.mark.gpu] if b == "tensorrt" else []
                out += [pytest.param(b, dt, a, id=f"{b}-{dt}-{a}", marks=marks)
                        for a in (ARCHS if dt == "fp32" else FP16_ARCHS)]
    return out


@pytest.fixture(scope="module")
def engine(request, engine_dirs, trt_folders):
    """``engine(backend, dtype, arch)``: one engine per key for the module, opened on first use."""
    made = {}

    def get(backend: str, dtype: str, arch: str):
        if (backend, dtype, arch) not in made:
            src = engine_dirs[arch] if dtype == "fp32" else request.getfixturevalue("fp16_engine_dir")
            if backend.startswith("tensorrt"):  # TensorRT builds from the standard-op graph
                src = request.getfixturevalue("plain_engine_dirs")[arch] if dtype == "fp32" else src
                folders = trt_folders("stand-in" if backend == "tensorrt-stand-in" else "tensorrt")
                made[backend, dtype, arch] = folders.open(folders.get(f"{arch}-{dtype}", src))
            else:
                made[backend, dtype, arch] = create_engine(backend, src)
        return made[backend, dtype, arch]

    yield get
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """``reference(arch)``: the torch engine's greedy and sampled batches on the padded prompts, cached."""
    cache = {}

    def get(arch):
        if arch not in cache:
            ref = engine(REFERENCE, "fp32", arch)
            cache[arch] = (ref.generate(prompts, GREEDY), ref.generate(prompts, SAMPLED))
        return cache[arch]

    return get


def _tol(backend, dtype):
    return ATOL[backend][dtype]


def _assert_greedy_agree(want, got, tol, row=None):
    """``got``'s greedy rows equal ``want``'s token for token, masks equal, plain log-probs within ``tol``.

    They may part only at a near-tie of the reference (its top-2 log-probs within 2 tol: either token is a
    correct argmax at that precision); they are compared up to there. ``row``: the row of ``want`` that a
    one-row ``got`` is (the padding test); else row for row."""
    gap = want.topk_logprobs[..., 0] - want.topk_logprobs[..., 1]  # (B, Tr), top-2 of the reference
    for g, r in enumerate([row] if row is not None else range(want.num_rows)):
        g = r if row is None else g
        length = int(want.response_mask[r].sum())
        w = want.response_ids[r, :length]
        x = torch.full_like(w, -1)
        x[:min(length, got.response_ids.shape[1])] = got.response_ids[g, :length]
        parted = (w != x).nonzero()
        n = int(parted[0]) if len(parted) else length
        if n < length:
            assert gap[r, n] <= 2 * tol, (f"row {r} token {n}: {int(x[n])}, the reference's {int(w[n])} leads by "
                                          f"{float(gap[r, n]):.2e} > 2 x {tol}")
        else:  # the whole row agreed: it stopped where the reference's did
            assert got.response_mask[g, length:].sum() == 0, f"row {r} runs on past the reference's stop"
        assert torch.equal(got.response_mask[g, :n], want.response_mask[r, :n])
        torch.testing.assert_close(got.rollout_plain_logprobs[g, :n], want.rollout_plain_logprobs[r, :n],
                                   atol=tol, rtol=0)


@torch.no_grad()
def _uncached_logprobs(model, batch, start_id, temperature):
    """One HF forward over prompt + response, no cache: (B, Tr, V) log_softmax(logits / temperature)."""
    tr = batch.response_ids.shape[1]
    if batch.is_seq2seq:
        start = torch.full((batch.num_rows, 1), start_id, dtype=torch.long)
        dec = torch.cat([start, batch.response_ids[:, :-1]], 1)
        logits = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, decoder_input_ids=dec).logits
    else:
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.response_mask.long()], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        logits = logits[:, batch.prompt_ids.shape[1] - 1:-1][:, :tr]
    return torch.log_softmax(logits.float() / temperature, -1)


def _assert_topk_close(got_lp, got_ids, want_lp, want_ids, m, tol):
    """Top-k log-probs within ``tol`` on the mask; ids equal where the reference has no near-tie inside the k."""
    torch.testing.assert_close(got_lp[m], want_lp[m], atol=tol, rtol=0)
    apart = (want_lp[..., :-1] - want_lp[..., 1:]).min(-1).values > 2 * tol
    assert torch.equal(got_ids[m & apart], want_ids[m & apart])


# ----------------------------------------------------------------------------- the table itself


def test_table_covers_every_registered_backend():
    """A newly registered backend must state its tolerance here before the matrix can compare it."""
    assert REFERENCE in backends() and REFERENCE in ATOL
    missing = [b for b in OTHERS if b not in ATOL]
    assert not missing, f"add a row to conftest.ATOL for {missing}"
    assert all(ATOL[b].get("fp32") for b in OTHERS), "every backend runs fp32"


# ----------------------------------------------------------------------------- generate vs the reference


@pytest.mark.parametrize("backend,dtype,arch", _cases(OTHERS))
def test_greedy_matches_reference(engine, reference, prompts, backend, dtype, arch):
    want, _ = reference(arch)
    assert want.prompt_mask.min() == 0, "the batch really is padded"
    got = engine(backend, dtype, arch).generate(prompts, GREEDY)
    _assert_greedy_agree(want, got, _tol(backend, dtype))
    assert (got.rollout_logprobs == 0).all() and (want.rollout_logprobs == 0).all(), "greedy: a point mass"
    if dtype == "fp32":  # no near-tie at fp32 tolerances in these models: identical batches, no exception used
        assert torch.equal(got.response_ids, want.response_ids)


@pytest.mark.parametrize("backend,dtype,arch", _cases(OTHERS, dtypes=("fp32",)))
def test_sampled_matches_reference(engine, reference, prompts, backend, dtype, arch):
    """Same sampler and seed: the same tokens and both log-prob kinds. HF samples with its own random
    stream, so its rows are scored by the reference instead."""
    _, want = reference(arch)
    eng, tol, m = engine(backend, dtype, arch), _tol(backend, dtype), want.response_mask > 0
    got = eng.generate(prompts, SAMPLED)
    if backend in SAME_SAMPLER:
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
        torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=tol, rtol=0)
        torch.testing.assert_close(got.rollout_plain_logprobs, want.rollout_plain_logprobs, atol=tol, rtol=0)
        _assert_topk_close(got.topk_logprobs, got.topk_ids, want.topk_logprobs, want.topk_ids, m, tol)
    else:
        ref = engine(REFERENCE, "fp32", arch)
        s = ref.score(got.prompt_ids, got.prompt_mask, got.response_ids, got.response_mask,
                      temperature=SAMPLED.temperature, topk=SAMPLED.return_topk)
        torch.testing.assert_close(got.rollout_plain_logprobs, s.logprobs, atol=tol, rtol=0)
        gm = got.response_mask > 0
        _assert_topk_close(got.topk_logprobs, got.topk_ids, s.topk_logprobs, s.topk_ids, gm, tol)
    on = got.response_mask > 0
    assert (got.rollout_logprobs[on] >= got.rollout_plain_logprobs[on] - 1e-6).all(), \
        "top-k/top-p renormalise: the sampled distribution's log-prob is never below the plain one"


# ----------------------------------------------------------------------------- score vs one uncached forward


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend,dtype,arch", _cases([REFERENCE, *OTHERS]))
def test_score_matches_uncached_forward(engine, reference, backend, dtype, arch, chunk):
    """score() (prefill + cached chunks) on the reference's sampled rows == one uncached HF forward;
    the reference's own generate() (prefill + one-token cached steps) too."""
    _, batch = reference(arch)
    ref = engine(REFERENCE, "fp32", arch)
    lp = _uncached_logprobs(ref.model, batch, ref.spec.decoder_start_id, SCORE_TEMP)  # (B, Tr, V)
    want = lp.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask
    want_tk, want_ids = lp.topk(SCORE_TOPK, dim=-1)
    tol, m = _tol(backend, dtype), batch.response_mask > 0
    s = engine(backend, dtype, arch).score(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                           batch.response_mask, temperature=SCORE_TEMP, topk=SCORE_TOPK,
                                           chunk_size=chunk)
    torch.testing.assert_close(s.logprobs, want, atol=tol, rtol=0)
    _assert_topk_close(s.topk_logprobs, s.topk_ids, want_tk, want_ids, m, tol)
    assert (s.topk_logprobs[~m] == 0).all() and (s.topk_ids[~m] == ref.spec.pad_id).all()
    if backend == REFERENCE and chunk == CHUNKS[0]:  # generate's cached steps, at the sampling temperature
        gen = _uncached_logprobs(ref.model, batch, ref.spec.decoder_start_id, SAMPLED.temperature)
        plain = gen.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask
        torch.testing.assert_close(batch.rollout_plain_logprobs, plain, atol=tol, rtol=0)
        _assert_topk_close(batch.topk_logprobs, batch.topk_ids, *gen.topk(SAMPLED.return_topk, dim=-1), m, tol)


@pytest.mark.parametrize("backend,dtype,arch", _cases([REFERENCE, *OTHERS]))
def test_score_full_vocabulary_is_the_distribution_in_vocab_order(engine, reference, backend, dtype, arch):
    """topk = V (the engine reference's exact-KL input): every token's log-prob in vocabulary order, equal
    to the uncached forward's log_softmax, 0 on padding, ids a broadcast arange (no sort, no int64 copy)."""
    _, batch = reference(arch)
    ref = engine(REFERENCE, "fp32", arch)
    want = _uncached_logprobs(ref.model, batch, ref.spec.decoder_start_id, SCORE_TEMP)  # (B, Tr, V)
    m = batch.response_mask > 0
    v = want.shape[-1]
    s = engine(backend, dtype, arch).score(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                           batch.response_mask, temperature=SCORE_TEMP, topk=v)
    torch.testing.assert_close(s.topk_logprobs[m], want[m], atol=_tol(backend, dtype), rtol=0)
    assert (s.topk_logprobs[~m] == 0).all()
    assert s.topk_ids.shape == want.shape and s.topk_ids.stride() == (0, 0, 1)
    assert torch.equal(s.topk_ids[0, 0], torch.arange(v))


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("backend,dtype,arch", _cases([REFERENCE, *OTHERS]))
def test_prompt_alone_equals_prompt_in_padded_batch(engine, prompts, backend, dtype, arch):
    """Left padding (decoder-only) and right padding (T5 encoder) are invisible: a row's greedy tokens and
    log-probs inside the batch equal those of its prompt generated alone, on one backend."""
    eng = engine(backend, dtype, arch)
    batch = eng.generate(prompts, GREEDY)
    side = "right" if batch.is_seq2seq else "left"
    pad_col = -1 if side == "right" else 0
    assert batch.prompt_mask[:, pad_col].eq(0).any(), f"some prompt is {side}-padded"
    for i in range(len(prompts)):
        _assert_greedy_agree(batch, eng.generate([prompts[i]], GREEDY), PAD_ATOL[dtype], row=i)


# ----------------------------------------------------------------------------- the on_step hook


@pytest.mark.parametrize("backend,dtype,arch", _cases([REFERENCE, *OTHERS], dtypes=("fp32",)))
def test_on_step_hook_sees_prefill_then_decode_steps(engine, prompts, backend, dtype, arch):
    """N response positions -> one "prefill" event, then N-1 "decode" events, each counting the rows still
    generating (the response mask's column sums); the hook changes nothing in the batch."""
    eng = engine(backend, dtype, arch)
    params = SamplingParams(max_new_tokens=6, seed=1, top_k=10)
    events = []
    got = eng.generate(prompts, params, on_step=events.append)
    n = got.response_ids.shape[1]
    assert [e.phase for e in events] == ["prefill"] + ["decode"] * (n - 1)
    assert [e.step for e in events] == list(range(n))
    assert [e.tokens for e in events] == got.response_mask.sum(0).long().tolist()
    assert all(e.seconds > 0 for e in events)
    assert torch.equal(got.response_ids, eng.generate(prompts, params).response_ids)  # seeded: reproducible
