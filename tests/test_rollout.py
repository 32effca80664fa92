"""Rollout engines: what one engine must do beyond parity (parity with the PyTorch reference is the
matrix in tests/test_parity.py): seeding, n samples per prompt, uneven stops, processed vs plain
log-probs, one-line errors, the registry and protocol, autograd-safe tensors, version checks, the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch

from refit.core.errors import RefitError
from refit.rollout.engine import (Engine, LoopEngine, ModelSpec, backends, check_version, create_engine, next_version,
                            register_backend)
from refit.rollout.types import SamplingParams

from conftest import ARCHS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(engine_dirs):
    """{arch: (torch reference engine, onnxruntime engine)} on the session's engine folders."""
    out = {a: (create_engine("torch", engine_dirs[a]), create_engine("onnxruntime", engine_dirs[a])) for a in ARCHS}
    yield out
    for ref, ort in out.values():
        ref.close()
        ort.close()


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
    from refit.rollout.cli import main

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


class _CountingState:
    """A toy StepState: logits favour token (last fed id + 1) % V, so greedy decoding counts up."""

    def __init__(self, vocab: int, rows: list | None = None):
        self.vocab, self.rows = vocab, rows if rows is not None else []

    def _logits(self, ids):
        self.rows.append(int(ids.shape[0]))
        return torch.nn.functional.one_hot((ids + 1) % self.vocab, self.vocab).float() * 10

    def prefill(self, ids, mask):
        return self._logits(ids[:, -1])

    def extend(self, ids, mask):
        return self._logits(ids)


class _ToyEngine(LoopEngine):
    """A backend built from the shared piece: only a spec, a version and a state factory."""

    def __init__(self, max_batch=None):
        self.spec = ModelSpec(kind="decoder", pad_id=0, eos_id=15, decoder_start_id=None, prompt_side="left",
                              vocab_size=16, max_len=None)
        self._version, self.max_batch, self.capacities = 3, max_batch, []
        self.rows: list[int] = []  # rows of each prefill and extend the states ran

    def _new_state(self, capacity=0):
        self.capacities.append(capacity)
        return _CountingState(self.spec.vocab_size, self.rows)

    def update_weights(self, named_tensors, version=None):  # the backend's own, as in every real one
        self._version = next_version(self._version, version)

    def close(self):
        pass


def test_loop_engine_shared_generate_and_score():
    """LoopEngine's generate/score: the batch carries weights_version, on_step sees every phase, the
    state factory gets the call's capacity, and a call over max_batch runs in runs of at most max_batch rows,
    with the same rows."""
    eng = _ToyEngine()
    assert isinstance(eng, Engine) and eng.weights_version == 3
    events = []
    batch = eng.generate([[1, 2], [4]], SamplingParams(max_new_tokens=3, greedy=True), on_step=events.append)
    assert batch.weights_version == 3 and batch.response_ids.tolist() == [[3, 4, 5], [5, 6, 7]]
    assert [(e.phase, e.step, e.tokens) for e in events] == [("prefill", 0, 2), ("decode", 1, 2), ("decode", 2, 2)]
    assert eng.capacities == [2 + 3] and max(eng.rows) == 2
    scored = eng.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    assert scored.logprobs.shape == (2, 3) and eng.capacities[-1] == 2 + 3
    eng.update_weights({})
    assert eng.weights_version == 4 and eng.generate([[1]], SamplingParams(max_new_tokens=1)).weights_version == 4
    prompts, params = [[1], [2, 3], [4], [5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, greedy=True)
    whole, limited = _ToyEngine(), _ToyEngine(max_batch=3)
    a, b = whole.generate(prompts, params), limited.generate(prompts, params)
    assert max(whole.rows) == 8 and max(limited.rows) == 3  # 8 rows through 3 at a time
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    limited.rows.clear()
    sa = whole.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, topk=2)
    sb = limited.score(a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask, topk=2)
    assert max(limited.rows) == 3 and torch.equal(sa.logprobs, sb.logprobs) and torch.equal(sa.topk_ids, sb.topk_ids)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_a_batch_over_the_engines_max_batch_runs_within_it(engines, prompts, arch):
    """Issue 32 #4: more rows than the engine's max_batch (its shape profiles) run in calls of at most max_batch
    rows (in flight on the fused decoder, static batches on the encoder-decoder and under a timing hook, whose
    phases each batch reports) with the same tokens and log-probs as one call; score() in row ranges of
    max_batch, the same log-probs."""
    _, ort = engines[arch]
    params = SamplingParams(max_new_tokens=6, seed=3, n=3, return_topk=2, stop_ids=tuple(range(5, 40)))
    assert ort.max_batch == 16  # the session's engine folders (conftest)
    try:
        ort.max_batch = 1000
        whole = ort.generate(prompts, params)
        s_whole = ort.score(whole.prompt_ids, whole.prompt_mask, whole.response_ids, whole.response_mask, topk=3)
        ort.max_batch = 5
        split = ort.generate(prompts, params)
        events = []
        timed = ort.generate(prompts, params, on_step=events.append)  # a timing hook: static batches of 5, 5, 2
        s_split = ort.score(whole.prompt_ids, whole.prompt_mask, whole.response_ids, whole.response_mask, topk=3)
    finally:
        ort.max_batch = 16
    assert whole.num_rows == 3 * len(prompts) > 5
    for name in ("response_ids", "response_mask", "rollout_logprobs", "rollout_plain_logprobs", "topk_ids",
                 "topk_logprobs"):
        assert torch.equal(getattr(whole, name), getattr(split, name)), name
        assert torch.equal(getattr(whole, name), getattr(timed, name)), name
    assert [e.tokens for e in events if e.phase == "prefill"] == [5, 5, 2]
    assert torch.equal(s_whole.logprobs, s_split.logprobs) and torch.equal(s_whole.topk_ids, s_split.topk_ids)
    assert torch.equal(s_whole.topk_logprobs, s_split.topk_logprobs)
