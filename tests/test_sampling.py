"""refit.rollout.sampling, refit.rollout.row_streams and refit.rollout.types: pure torch, no engine.

Four ways: hand-built cases, reference identities (HF's logits warpers,
plain log_softmax), fast vs slow (the two-level exponential race draws from softmax and keeps
its tokens under backend-sized logit noise; the one-pass untruncated step equals log_softmax;
reused scratch buffers change nothing), and the record checker rejecting every broken padding
rule.
"""

from __future__ import annotations

import pytest
import torch

import refit.rollout.row_streams as row_streams
from refit.rollout.processors import plain_logprobs, process_logits, top_k_filter, top_p_filter
from refit.rollout.row_streams import RowStreams, row_seed
from refit.rollout.sampling import RACE_BLOCK, StepBuffers, chosen_logprobs, one_thread, sample, sample_step
from refit.rollout.types import RolloutBatch, SamplingParams


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(b=4, v=50, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_plain_when_no_truncation():
    x = _logits()
    assert torch.allclose(process_logits(x, SamplingParams()), torch.log_softmax(x, -1), atol=1e-6)
    t = SamplingParams(temperature=0.7)
    assert torch.allclose(process_logits(x, t), torch.log_softmax(x / 0.7, -1), atol=1e-6)
    assert torch.allclose(plain_logprobs(x, 0.7), torch.log_softmax(x / 0.7, -1), atol=1e-6)


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_hf(k):
    from transformers.generation.logits_process import TopKLogitsWarper

    x = _logits()
    ours = top_k_filter(x, k)
    ref = TopKLogitsWarper(k)(None, x.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert (torch.isfinite(ours).sum(-1) == k).all()


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_hf(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    x = _logits()
    ours = top_p_filter(x, p)
    ref = TopPLogitsWarper(p)(None, x.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = torch.isfinite(ours)
    probs = x.softmax(-1)
    assert kept.gather(-1, x.argmax(-1, keepdim=True)).all(), "the top token is always kept"
    mass = (probs * kept).sum(-1)
    assert (mass >= p - 1e-6).all() or p <= probs.max(-1).values.min()
    # smallest such set: dropping the least likely kept token falls below p
    smallest_kept = probs.masked_fill(~kept, 2.0).min(-1).values
    assert ((mass - smallest_kept < p) | (kept.sum(-1) == 1)).all()


def test_hand_built_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = process_logits(probs.log(), SamplingParams(top_p=0.8))
    assert torch.isfinite(lp).tolist() == [[True, True, False, False]]
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    lp = process_logits(probs.log(), SamplingParams(top_p=0.81))
    assert torch.isfinite(lp).tolist() == [[True, True, True, False]]
    lp = process_logits(probs.log(), SamplingParams(top_p=0.01))
    assert torch.isfinite(lp).tolist() == [[True, False, False, False]]


def test_truncated_logprob_not_below_plain_and_samples_inside_top_k():
    x = _logits(b=8, v=100)
    params = SamplingParams(top_k=7, temperature=1.3, seed=0)
    gen = make_generator(0)
    topset = torch.topk(x, 7, -1).indices
    for _ in range(50):
        ids, proc, plain, _ = sample_step(x, params, gen)
        assert (proc >= plain - 1e-6).all()
        assert (topset == ids[:, None]).any(-1).all()


def test_greedy_is_point_mass():
    x = _logits()
    lp = process_logits(x, SamplingParams(greedy=True))
    ids = sample(lp, make_generator(0), greedy=True)
    assert torch.equal(ids, x.argmax(-1))
    proc, plain = chosen_logprobs(x, lp, ids, 1.0)
    assert torch.equal(proc, torch.zeros(4))
    assert torch.allclose(plain, torch.log_softmax(x, -1).max(-1).values)


def test_seeded_sampling_reproducible():
    lp = torch.log_softmax(_logits(), -1)
    a = [sample(lp, make_generator(5)) for _ in range(2)]
    b = torch.stack([sample(lp, g) for g in [make_generator(6)] for _ in range(10)])
    c = torch.stack([sample(lp, g) for g in [make_generator(5)] for _ in range(10)])
    assert torch.equal(a[0], a[1])
    assert not torch.equal(b, c)


def test_race_draws_from_softmax():
    """Fast (exponential race) equals slow (the probabilities themselves) in distribution."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    lp = probs.log().expand(20000, -1).contiguous()
    ids = sample(lp, make_generator(0))
    freq = torch.bincount(ids, minlength=5).float() / ids.numel()
    assert torch.allclose(freq, probs, atol=0.015)
    masked = lp.clone()
    masked[:, 0] = float("-inf")
    assert (sample(masked, make_generator(1)) != 0).all(), "-inf tokens are never drawn"


def test_two_level_race_across_blocks():
    """A block by its mass, then a token inside it, is softmax: blocks of mass 0.5/0.3/0.2 (the
    last one partial), tokens inside the partial block at their rates, -inf never drawn."""
    v = 2 * RACE_BLOCK + 3
    p = torch.zeros(v, dtype=torch.float64)
    p[:RACE_BLOCK], p[RACE_BLOCK:2 * RACE_BLOCK] = 0.5 / RACE_BLOCK, 0.3 / RACE_BLOCK
    p[2 * RACE_BLOCK:] = torch.tensor([0.1, 0.06, 0.04], dtype=torch.float64)
    lp = p.log().float()
    lp[5] = lp[RACE_BLOCK + 9] = float("-inf")  # masked inside full blocks
    ids = sample(lp.expand(40000, -1).contiguous(), make_generator(0))
    blocks = torch.bincount(ids // RACE_BLOCK, minlength=3).double() / ids.numel()
    torch.testing.assert_close(blocks, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.01, rtol=0)
    tail = torch.bincount(ids[ids >= 2 * RACE_BLOCK] - 2 * RACE_BLOCK, minlength=3).double() / ids.numel()
    torch.testing.assert_close(tail, torch.tensor([0.1, 0.06, 0.04], dtype=torch.float64), atol=0.006, rtol=0)
    assert not ((ids == 5) | (ids == RACE_BLOCK + 9)).any()


def test_same_seed_same_tokens_under_backend_sized_noise():
    """Two backends' logits differ by ~1e-6; the same seed must still pick the same tokens. A race key
    depends on one score and its block's mass, not on a running sum over the vocabulary (GPT-2
    small, ORT vs PyTorch, 32 rows x 32 tokens at T=0.7/top_p=0.9: an inverse CDF split 2 rows,
    the race none)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 50257, generator=g) * 2.0
    y = x + 1e-6 * torch.randn(x.shape, generator=g)
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)):
        ga, gb, same = make_generator(4), make_generator(4), []
        for _ in range(8):
            same.append(sample_step(x, params, ga)[0] == sample_step(y, params, gb)[0])
        assert torch.stack(same).float().mean() >= 0.99


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, return_topk=3),
                                    SamplingParams(greedy=True, return_topk=2), SamplingParams(top_k=9, top_p=0.9)])
def test_sample_step_equals_log_softmax_reference(params):
    """The one-pass step (log Z from the CDF, top-k of the scores) matches plain log_softmax; reused
    scratch buffers and one intra-op thread give the same tokens as fresh ones."""
    x = _logits(b=6, v=300)
    ids, proc, plain, top = sample_step(x, params, make_generator(3))
    ref = torch.log_softmax(x / params.temperature, -1)
    torch.testing.assert_close(plain, ref.gather(-1, ids[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    if not params.truncates:
        assert torch.equal(proc, plain)
    if params.return_topk:
        want = ref.topk(params.return_topk, -1)
        torch.testing.assert_close(top[0], want.values, atol=1e-6, rtol=0)
        assert torch.equal(top[1], want.indices)
    buffers, gen = StepBuffers(), make_generator(3)
    with one_thread():
        again = [sample_step(x, params, gen, buffers)[0] for _ in range(3)]
    fresh = make_generator(3)
    assert all(torch.equal(a, sample_step(x, params, fresh)[0]) for a in again)
    assert torch.equal(again[0], ids)


@pytest.mark.parametrize("bad", [dict(temperature=0), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(n=0),
                                 dict(max_new_tokens=0), dict(return_topk=-2), dict(stop_ids=(-1,))])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError) as e:
        SamplingParams(**bad)
    assert "\n" not in str(e.value)


def _batch(**over):
    resp = torch.tensor([[5, 1, 0], [6, 7, 8]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lp = -torch.rand(2, 3) * mask
    fields = dict(prompt_ids=torch.tensor([[0, 4], [3, 4]]), prompt_mask=torch.tensor([[0, 1], [1, 1]]),
                  response_ids=resp, response_mask=mask, rollout_logprobs=lp, rollout_plain_logprobs=lp.clone(),
                  prompt_index=torch.tensor([0, 1]), weights_version=0, sampling=SamplingParams(), is_seq2seq=False,
                  pad_id=0, eos_id=1)
    fields.update(over)
    return RolloutBatch(**fields)


def test_rollout_batch_check_accepts_and_rejects():
    _batch().check()
    bad = [
        dict(prompt_mask=torch.tensor([[1, 0], [1, 1]])),  # right-padded decoder prompt
        dict(response_mask=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])),  # hole in the mask
        dict(response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])),  # mask runs past EOS
        dict(response_mask=torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),  # ends without a stop token
             response_ids=torch.tensor([[5, 0, 0], [6, 7, 8]])),
        dict(prompt_ids=torch.tensor([[0, 4], [3, 4]], dtype=torch.int32)),  # dtype
        dict(rollout_logprobs=torch.zeros(2, 4)),  # shape
    ]
    for over in bad:
        with pytest.raises(ValueError):
            _batch(**over).check()
    seq2seq = _batch(is_seq2seq=True, prompt_mask=torch.tensor([[1, 0], [1, 1]]))
    seq2seq.check()  # T5: encoder input right-padded
    with pytest.raises(ValueError):
        _batch(is_seq2seq=True).check()


def test_rollout_batch_rows():
    b = _batch()
    one = b.rows([1])
    assert one.num_rows == 1 and torch.equal(one.response_ids, b.response_ids[1:])
    one.check()


def _per_row_reference(seed, keys, steps, logits, params):
    """The per-row streams as they were: one torch.Generator per row, one exponential_ call per row per step."""
    gens = [make_generator(row_seed(seed, *k)) for k in keys]

    class PerRow(RowStreams):  # the old draw, row by row, through the same race
        def exponential(self, n):
            out = torch.empty(len(gens), n, dtype=torch.float64)
            for i, g in enumerate(gens):
                out[i].exponential_(generator=g)
            return out

    streams = PerRow(seed, [])
    buf = StepBuffers()
    return [sample_step(x, params, streams, buf)[0] for x, _ in zip(logits, range(steps))]


@pytest.mark.parametrize("per_row_max", [0, 10**6])
@pytest.mark.parametrize("params", [SamplingParams(seed=3), SamplingParams(seed=3, temperature=0.7, top_p=0.9)])
def test_vectorised_row_streams_keep_per_row_tokens(params, per_row_max, monkeypatch):
    """RowStreams steps every row's MT19937 at once (or, few rows, numpy's MT19937 per row: per_row_max): its
    draws are exponential_'s (exact() bit for bit, exponential() to the last bit) and the tokens are the
    per-row generators' ones, on the default path and on the near-tie path (every row redone with exact(),
    EXACT_MARGIN forced to inf)."""
    import refit.rollout.sampling as S

    monkeypatch.setattr(row_streams, "PER_ROW_MAX", per_row_max)

    keys = [(p, s) for p in range(9) for s in range(2)]
    v = 2 * RACE_BLOCK + 40
    logits = [torch.randn(len(keys), v, generator=torch.Generator().manual_seed(i)) * 3 for i in range(6)]
    want = _per_row_reference(3, keys, 6, logits, params)
    for margin in (S.EXACT_MARGIN, float("inf")):
        monkeypatch.setattr(S, "EXACT_MARGIN", margin)
        streams, buf = RowStreams(3, keys), StepBuffers()
        got = [sample_step(x, params, streams, buf)[0] for x in logits]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    streams = RowStreams(11, keys)
    gens = [make_generator(row_seed(11, *k)) for k in keys]
    for step, n in enumerate([258, 1, 700, 5, 624, 300]):
        if step == 2:  # a slot takes a new row (in-flight batching): its stream restarts
            streams.assign(4, (50, 1))
            gens[4] = make_generator(row_seed(11, 50, 1))
        fast = streams.exponential(n)
        ref = torch.stack([torch.empty(n, dtype=torch.float64).exponential_(generator=g) for g in gens])
        assert torch.equal(streams.exact(torch.arange(len(keys))), ref)
        assert (fast - ref).abs().max() < 1e-14


def test_row_tokens_do_not_depend_on_the_batch():
    """A row's tokens are a function of (seed, its key, its logits): alone, or among other rows in any order."""
    keys = [(p, s) for p in range(6) for s in range(3)]
    logits = [torch.randn(len(keys), 300, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    params = SamplingParams(seed=7)
    whole = torch.stack([sample_step(x, params, s)[0] for s in [RowStreams(7, keys)] for x in logits])
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(0))
    mixed = torch.stack([sample_step(x[order], params, s)[0] for s in [RowStreams(7, [keys[i] for i in order])]
                         for x in logits])
    assert torch.equal(mixed, whole[:, order])
    for r in (0, 7, 17):
        alone = torch.stack([sample_step(x[r:r + 1], params, s)[0] for s in [RowStreams(7, [keys[r]])] for x in logits])
        assert torch.equal(alone[:, 0], whole[:, r])


def _torch_race(scores, streams):
    """The RowStreams race as it was in torch (before the numpy race): ids, row max, float64 total."""
    import refit.rollout.sampling as S

    b, v = scores.shape
    full, nb = v - v % RACE_BLOCK, -(-v // RACE_BLOCK)
    m = scores.amax(-1, keepdim=True)
    w = (scores - m).exp()
    mass = w[:, :full].view(b, full // RACE_BLOCK, RACE_BLOCK).sum(-1)
    if full < v:
        mass = torch.cat([mass, w[:, full:].sum(-1, keepdim=True)], 1)
    mass = mass.double()
    e = streams.exponential(nb + RACE_BLOCK)
    padded = torch.full((b, nb * RACE_BLOCK), float("-inf"), dtype=torch.float64)
    padded[:, :v] = scores
    ids, close = S._race_keys(padded, mass, e, nb, True)
    if close.any():
        rows = close.nonzero().flatten()
        ids[rows] = S._race_keys(padded[rows], mass[rows], streams.exact(rows), nb, False)[0]
    return ids, m, mass.sum(-1, keepdim=True)


@pytest.mark.parametrize("v", [100, 384, RACE_BLOCK, 2 * RACE_BLOCK + 40, 5000])
@pytest.mark.parametrize("margin", [None, 1.0, float("inf")])
def test_numpy_race_is_the_torch_race_bit_for_bit(v, margin, monkeypatch):
    """The numpy race (with RowStreams) gives the torch race's ids, row max and total mass bit for bit, and
    sample_step its log-probs, over consecutive steps: random logits with -inf entries, a whole -inf block,
    exact ties of scores, and near-tie rows (margin 1.0: some rows, inf: every row, redone on exact())."""
    import refit.rollout.sampling as S

    if margin is not None:
        monkeypatch.setattr(S, "EXACT_MARGIN", margin)
    keys = [(p, s) for p in range(7) for s in range(3)]
    g = torch.Generator().manual_seed(v)
    mine, ref, buf = RowStreams(5, keys), RowStreams(5, keys), StepBuffers()
    for step in range(5):
        x = torch.randn(len(keys), v, generator=g) * (1 + 3 * step)
        x[torch.rand(x.shape, generator=g) < 0.3] = float("-inf")
        x[0, :RACE_BLOCK] = float("-inf") if v > RACE_BLOCK else x[0]  # an empty block: mass 0
        x[1, :] = 0.5  # every score tied
        x[2, 0], x[2, 1:] = 1.0, float("-inf")  # one finite token
        got, want = S._race(x, mine, buf), _torch_race(x, ref)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    mine, ref = RowStreams(9, keys), RowStreams(9, keys)
    for t in (1.0, 0.7):
        x = torch.randn(len(keys), v, generator=g) * 2
        ids, proc, plain, _ = sample_step(x, SamplingParams(temperature=t), mine, buf)
        s = x / t if t != 1.0 else x
        r_ids, m, total = _torch_race(s, ref)
        r_plain = (s.gather(-1, r_ids[:, None]) - (m + total.log().float())).squeeze(-1)
        assert torch.equal(ids, r_ids) and torch.equal(plain, r_plain) and torch.equal(proc, r_plain)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=1, seed=0),
                                    SamplingParams(max_new_tokens=1, seed=0, top_k=5, top_p=0.9),
                                    SamplingParams(max_new_tokens=1, greedy=True)], ids=["plain", "top-k-p", "greedy"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_stop_sampling_in_one_line(params, bad):
    """A row with a NaN or +inf logit (a broken model or push) raises one line naming the rows, on every path; the
    finite rows of the same batch alone sample as before."""
    from refit.core.errors import RefitError

    logits = torch.randn(4, 384, generator=torch.Generator().manual_seed(0))
    ok = sample_step(logits, params, RowStreams(0, [(i, 0) for i in range(4)]))
    logits[2, 17] = bad
    with pytest.raises(RefitError, match=r"non-finite logits .* 1 of 4 rows \(first: \[2\]\)") as e:
        sample_step(logits, params, RowStreams(0, [(i, 0) for i in range(4)]))
    assert "\n" not in str(e.value)
    again = sample_step(logits[[0, 1, 3]], params, RowStreams(0, [(i, 0) for i in (0, 1, 3)]))
    assert torch.equal(again[0], ok[0][[0, 1, 3]])


def test_one_thread_changes_torch_threads_on_the_main_thread_only():
    """torch's intra-op setting is process-wide: one_thread() on another thread (a shard's or the overlapped
    engine's decode loop) must leave it alone, or it would switch the learner's threads; on the main thread it sets
    one inside the block and restores the count after."""
    import threading

    from refit.rollout.sampling import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []

        def worker():
            with one_thread():
                seen.append(torch.get_num_threads())

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == [2] and torch.get_num_threads() == 2
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
