"""Fused-attention engines (refit/export/fused.py, refit/rollout/ort_fused.py) and in-flight batching
(refit/rollout/decode.py).

Parity matrix: fused graph vs plain graph vs the PyTorch reference, on each decoder-only family
(GPT-2 learned positions, Llama rotary + grouped KV heads), padded batch, greedy and sampled with
truncation, incremental decode and score(). Encoder-decoder fused graphs (T5, BART, Marian):
tests/test_fused_seq2seq.py.
Then: the KV buffer reused across batches reads no stale position, rows are the same whatever the
slot count, and a weight push into a fused engine matches the reference (a perturbed one differs).
Tolerance: 1e-4 on log-probs across graphs/backends (the export gate's fp32 tolerance); rows of one
engine under different slot counts must be identical.
"""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from conftest import same_rows
from refit.core.manifest import Manifest
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams

DECODERS = ["tiny-gpt2", "tiny-llama"]
# every decoder-only family built here; Mistral's window (4 tokens) is shorter than the prompts
FAMILIES = DECODERS + ["tiny-qwen2", "tiny-mistral", "tiny-neox", "tiny-phi", "tiny-opt"]
TEXTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7", "1+1=", "sort 55 = "]
TOL = 1e-4
SAMPLED = SamplingParams(max_new_tokens=12, seed=3, temperature=0.9, top_k=50, top_p=0.95)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def plain_dirs(plain_engine_dirs):
    """The standard-op graph of each model (the session's engine_dirs hold the fused one)."""
    return plain_engine_dirs


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t).input_ids for t in TEXTS]


def _same(a, b, tol=TOL):
    same_rows(a, b, tol)


def test_manifest_records_the_attention(engine_dirs, plain_dirs):
    for g in FAMILIES:
        m = Manifest.read(engine_dirs[g])
        assert m.attention == "fused" and m.parity.max_abs_logprob_diff < TOL, g
        assert "GroupQueryAttention" in (engine_dirs[g] / "decoder.onnx").read_bytes().decode("latin-1")
        assert Manifest.read(plain_dirs[g]).attention == "plain"


def test_fused_refused_where_it_cannot_run(model_dirs, tmp_path):
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    with pytest.raises(RefitError, match="attention=fused does not apply.*dtype bf16.*no bf16 kernel"):
        build(model_dirs["tiny-gpt2"], tmp_path / "bf16", opts=ExportOptions(attention="fused", dtype="bf16"),
                    log=lambda *_: None)
    with pytest.raises(RefitError, match="unknown attention"):
        build(model_dirs["tiny-gpt2"], tmp_path / "x", opts=ExportOptions(attention="flash"), log=lambda *_: None)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, greedy=True), SAMPLED], ids=["greedy", "sampled"])
def test_fused_plain_torch_parity(engine_dirs, plain_dirs, prompts, arch, params):
    fused, plain = create_engine("onnxruntime", engine_dirs[arch]), create_engine("onnxruntime", plain_dirs[arch])
    ref = create_engine("torch", engine_dirs[arch])
    a = fused.generate(prompts, params)
    assert a.prompt_mask.min() == 0, "the batch really is padded"
    _same(a, plain.generate(prompts, params))
    _same(a, ref.generate(prompts, params))
    args = (a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask)
    t = 1.0 if params.greedy else params.temperature
    s_fused, s_ref = fused.score(*args, t, chunk_size=3), ref.score(*args, t)  # prefill + chunked cached steps
    torch.testing.assert_close(s_fused.logprobs, s_ref.logprobs, atol=TOL, rtol=0)
    assert torch.isfinite(s_fused.logprobs).all()
    torch.testing.assert_close(s_fused.logprobs, a.rollout_plain_logprobs, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-mistral"])
def test_gqa_reference_op_matches_hf(model_dirs, arch):
    """The wrapper run eagerly (the custom op's PyTorch reference) equals HF's own forward on compact rows
    (Mistral: rows of 5 and 7 tokens against its 4-token sliding window)."""
    from refit.core.hf_folder import load_model, model_info
    from refit.export.fused import FusedDecoder
    from refit.core.padding import position_ids_from_mask

    info = model_info(model_dirs[arch])
    ref = load_model(model_dirs[arch], info)
    wrapped = FusedDecoder(load_model(model_dirs[arch], info))
    cfg = ref.config
    n_kv, head_dim, n_layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    lens = [5, 2, 7]
    rows = [torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    ids, pos = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    left, lmask = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], pos[i, :len(r)] = r, torch.arange(len(r))
        left[i, 7 - len(r):], lmask[i, 7 - len(r):] = r, 1
    n = torch.tensor(lens, dtype=torch.int32)
    past = [torch.zeros(3, n_kv, 9, head_dim) for _ in range(2 * n_layers)]
    with torch.no_grad():
        out = wrapped(ids, pos, n - 1, n, torch.tensor(9, dtype=torch.int32), (n - 1).long()[:, None], *past)
        want = ref(input_ids=left, attention_mask=lmask, position_ids=torch.from_numpy(
            position_ids_from_mask(lmask.numpy()))).logits[:, -1]
    torch.testing.assert_close(out[0][:, 0], want, atol=1e-5, rtol=0)
    assert int((out[1][:, :, 7:] != 0).sum()) == 0, "nothing written past the longest row"


@pytest.mark.parametrize("arch", DECODERS + ["tiny-t5", "tiny-bart", pytest.param("tiny-marian", marks=pytest.mark.slow)])
def test_kv_buffer_reuse_reads_no_stale_positions(engine_dirs, prompts, arch):
    """A short batch decoded after a longer one in the same (reused, uncleared) buffers gives a fresh engine's
    rows (decoder-only and encoder-decoder fused engines)."""
    eng = create_engine("onnxruntime", engine_dirs[arch])
    short = SamplingParams(max_new_tokens=6, seed=1)
    eng.generate([p * 3 for p in prompts], SamplingParams(max_new_tokens=30, seed=9))  # fills the buffer deep
    kv = eng._kv_pools[0].kv
    assert kv is not None and float(abs(next(iter(kv.arrays.values()))[:, :, 20:]).sum()) > 0
    again = eng.generate(prompts, short)
    assert eng._kv_pools[0].kv is kv, "the buffer was reused, not reallocated"
    _same(again, create_engine("onnxruntime", engine_dirs[arch]).generate(prompts, short), tol=0)


@pytest.mark.parametrize("arch", DECODERS + ["tiny-t5"])
def test_kv_buffers_held_across_alternating_batch_sizes(engine_dirs, prompts, arch):
    """A PPO step's pattern: a rollout (12 rows), an evaluation (6 rows), a score (6 rows), the rollout again. After
    the first call no KV buffer set is allocated: each call gets exactly its rows, the first rows of the held set
    (the same memory); every call's output equals a fresh engine's, token for token and log-prob for log-prob."""
    import numpy as np

    rollout = SamplingParams(max_new_tokens=8, seed=4, n=2, temperature=0.9)  # 12 rows: within max_batch 16
    evaluation = SamplingParams(max_new_tokens=8, greedy=True)
    eng = create_engine("onnxruntime", engine_dirs[arch])
    got = []  # (rows asked for, the buffers handed out) of every pool.get
    real_get = eng._kv_pools[0].get
    eng._kv_pools[0].get = lambda batch, capacity: got.append((batch, real_get(batch, capacity))) or got[-1][1]

    a = eng.generate(prompts, rollout)
    b = eng.generate(prompts, evaluation)
    c = eng.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    d = eng.generate(prompts, rollout)

    def fresh():
        return create_engine("onnxruntime", engine_dirs[arch])

    fa, fb = fresh().generate(prompts, rollout), fresh().generate(prompts, evaluation)
    fc = fresh().score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    for x, y in ((a, fa), (b, fb), (d, fa)):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.response_mask, y.response_mask)
        assert torch.equal(x.rollout_logprobs, y.rollout_logprobs)
        assert torch.equal(x.rollout_plain_logprobs, y.rollout_plain_logprobs)
    assert torch.equal(c.logprobs, fc.logprobs)
    assert [n for n, _ in got] == [12, 6, 6, 12] and [kv.batch for _, kv in got] == [12, 6, 6, 12]
    first = {name: arr for name, arr in got[0][1].arrays.items()}
    for _, kv in got[1:]:
        assert all(np.shares_memory(kv.arrays[name], first[name]) for name in first), "a new buffer set"


@pytest.mark.parametrize("arch", DECODERS)
def test_rows_do_not_depend_on_slot_count(engine_dirs, prompts, arch):
    """One static batch, 4 / 32 / 1 in-flight slots, static batches of 5: identical rows (tokens and
    log-probs), rows stopping at spread lengths."""
    params = SamplingParams(max_new_tokens=12, seed=5, temperature=0.9, top_k=50, n=2, return_topk=3,
                            stop_ids=tuple(range(5, 40)))
    rows = {s: create_engine("onnxruntime", engine_dirs[arch], slots=s).generate(prompts, params)
            for s in (None, 4, 32, 1)}
    rows["static-5"] = create_engine("onnxruntime", engine_dirs[arch], slots=5, inflight=False).generate(prompts, params)
    lengths = rows[None].response_mask.sum(1)
    assert lengths.min() < lengths.max(), "rows stop at different lengths, so slots are refilled"
    for s in (4, 32, 1, "static-5"):
        _same(rows[None], rows[s], tol=0)
        assert torch.equal(rows[None].topk_ids, rows[s].topk_ids)
    _same(rows[None], create_engine("torch", engine_dirs[arch]).generate(prompts, params))


def test_deferred_batched_admission_gives_the_same_rows(engine_dirs, prompts):
    """Slots refilled three at a time (one prefill run into a scratch buffer, copied into the slots)."""
    from refit.rollout.decode import inflight_loop
    from refit.rollout.engine import pad_prompts, row_keys

    params = SamplingParams(max_new_tokens=10, seed=7, n=3, stop_ids=tuple(range(5, 60)))
    eng = create_engine("onnxruntime", engine_dirs["tiny-llama"])
    want = eng.generate(prompts, params)
    ids, mask, index = pad_prompts(prompts, params.n, eng.spec)
    with torch.no_grad():
        got = inflight_loop(eng._new_state(ids.shape[1] + 10), ids, mask, params, eng.spec, 5,
                            row_keys(index, params.n), admit_min=3)
    assert torch.equal(got["response_ids"], want.response_ids)
    assert torch.equal(got["rollout_plain_logprobs"], want.rollout_plain_logprobs)


def test_row_stream_is_keyed_by_prompt_and_sample(engine_dirs, prompts):
    """A row keeps its tokens when other prompts are dropped around it (its key is (prompt, sample))."""
    eng = create_engine("onnxruntime", engine_dirs["tiny-gpt2"])
    params = SamplingParams(max_new_tokens=8, seed=2)
    full = eng.generate(prompts[:2], params)
    assert not torch.equal(full.response_ids[0], full.response_ids[1]) or prompts[0] != prompts[1]
    alone = eng.generate(prompts[:1], params)
    assert torch.equal(full.response_ids[0, :alone.response_ids.shape[1]], alone.response_ids[0])


@pytest.mark.parametrize("arch", DECODERS)
def test_weight_push_into_fused_engine(engine_dirs, model_dirs, prompts, arch):
    """Perturbed weights change the fused engine's output and match the reference holding them; restored
    weights give the original output."""
    from refit.rollout.torch_backend import TorchEngine

    eng, ref = create_engine("onnxruntime", engine_dirs[arch]), TorchEngine(model_dirs[arch])
    probe = ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
    args = (probe.prompt_ids, probe.prompt_mask, probe.response_ids, probe.response_mask)
    before = eng.score(*args).logprobs
    params = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    new = {n: p + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    eng.update_weights(new)
    ref.update_weights(new)
    after = eng.score(*args).logprobs
    assert (after - before).abs().max() > 1e-2, "the push changed the output"
    torch.testing.assert_close(after, ref.score(*args).logprobs, atol=TOL, rtol=0)
    eng.update_weights(params)
    torch.testing.assert_close(eng.score(*args).logprobs, before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk,start", [(7, 0), (1, 6), (3, 4)], ids=["prefill", "decode", "chunk"])
def test_onnxruntime_local_window_matches_the_reference_op(chunk, start):
    """One GroupQueryAttention node with local_window_size 3 on ONNX Runtime == ``refit::gqa`` with window 3
    (the op counts the query's own token in the window, as HF's sliding_window); rows of different lengths."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as h

    from refit.export.fused import gqa

    n, d, cap, b, window = 2, 8, 12, 2, 3
    vi = h.make_tensor_value_info
    ins = [vi(x, TP.FLOAT, ["b", "s", n * d]) for x in "qkv"] + [vi(x, TP.FLOAT, ["b", n, "c", d]) for x in ("pk", "pv")]
    ins += [vi("sk", TP.INT32, ["b"]), vi("tot", TP.INT32, []), vi("qs", TP.INT32, ["b"])]
    node = h.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tot"] + [""] * 9 + ["qs"],
                       ["o", "ok", "ov"], domain="com.microsoft", num_heads=n, kv_num_heads=n, local_window_size=window)
    graph = h.make_graph([node], "g", ins, [vi(x, TP.FLOAT, None) for x in ("o", "ok", "ov")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(chunk)
    q, k, v = (torch.randn(b, chunk, n * d, generator=g) for _ in range(3))
    pk, pv = torch.randn(b, n, cap, d, generator=g), torch.randn(b, n, cap, d, generator=g)
    qs = torch.tensor([chunk, max(chunk - 2, 1)], dtype=torch.int32)  # the second row: fewer new tokens
    sk = start + qs - 1
    tot = torch.tensor(start + chunk, dtype=torch.int32)
    feed = dict(q=q, k=k, v=v, pk=pk.clone(), pv=pv.clone(), sk=sk, tot=tot, qs=qs)
    got = torch.from_numpy(sess.run(["o"], {x: t.numpy() for x, t in feed.items()})[0])
    want = gqa(q, k, v, pk, pv, sk, tot, qs, None, n, n, d ** -0.5, window)[0]
    unwindowed = gqa(q, k, v, pk, pv, sk, tot, qs, None, n, n, d ** -0.5)[0]
    for i in range(b):
        torch.testing.assert_close(got[i, :qs[i]], want[i, :qs[i]], atol=1e-5, rtol=0)
    assert (got[0, -1] - unwindowed[0, -1]).abs().max() > 1e-3  # the window changed the last query's output


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_fused_engine_refused_off_the_cpu_provider(engine_dirs, arch):
    """The fused graph has only run on ONNX Runtime's CPU provider: asking for CUDA is one line, before any
    provider lookup or session (so the same line on a machine without CUDA)."""
    with pytest.raises(RefitError, match="fused-attention graph, run here on the CPU provider only"):
        create_engine("onnxruntime", engine_dirs[arch], device="cuda")


@pytest.mark.parametrize("arch", DECODERS)
def test_repeated_prompts_prefilled_once_give_the_same_rows(engine_dirs, prompts, arch, monkeypatch):
    """n samples per prompt: the distinct prompts are prefilled once and their K/V copied to every row
    (refit/rollout/ort_fused.py distinct_rows); tokens and log-probs equal the row-by-row prefill exactly."""
    import refit.rollout.ort_fused as fused

    params = SamplingParams(max_new_tokens=10, seed=4, temperature=0.9, n=2, return_topk=2)  # within max_batch 16
    eng = create_engine("onnxruntime", engine_dirs[arch])
    runs = []
    real = fused._run_fused
    monkeypatch.setattr(fused, "_run_fused", lambda sess, host, *a, **k: runs.append(host["input_ids"].shape)
                        or real(sess, host, *a, **k))
    deduped = eng.generate(prompts, params)
    assert runs[0][0] == len(prompts), "the prefill ran once per distinct prompt"
    monkeypatch.setattr(fused, "DEDUP_MIN", 10**9)
    runs.clear()
    each = eng.generate(prompts, params)
    assert runs[0][0] == len(prompts) * params.n
    _same(deduped, each, tol=0)
    assert torch.equal(deduped.topk_ids, each.topk_ids)


@pytest.mark.parametrize("arch", DECODERS + ["tiny-t5"])
def test_decode_step_binding_gives_the_per_step_runs_rows(engine_dirs, prompts, arch, monkeypatch):
    """Decode steps rerun one IOBinding with inputs rewritten in place (refit/rollout/ort_run.py StepBinding): tokens,
    log-probs and top-k equal the per-step binding's (StepBinding off) exactly, static and in slots, with rows
    idling after a stop (their logits zeroed)."""
    from refit.rollout.ort_run import StepBinding

    runs = []
    real = StepBinding.run
    monkeypatch.setattr(StepBinding, "run", lambda self, *a: runs.append(1) or real(self, *a))
    for kw in ({}, {"slots": 3}):
        eng = create_engine("onnxruntime", engine_dirs[arch], **kw)
        params = SamplingParams(max_new_tokens=12, seed=5, temperature=0.9, n=2, return_topk=2,
                                stop_ids=tuple(range(eng.spec.vocab_size // 8)))
        runs.clear()
        bound = eng.generate(prompts, params)
        assert runs, "decode steps ran through the step binding"
        with monkeypatch.context() as m:
            m.setattr(StepBinding, "fits", staticmethod(lambda sess: False))
            each = create_engine("onnxruntime", engine_dirs[arch], **kw).generate(prompts, params)
        assert (bound.response_mask.sum(1) < bound.response_mask.shape[1]).any(), "some row stopped early"
        _same(bound, each, tol=0)
        assert torch.equal(bound.topk_ids, each.topk_ids) and torch.equal(bound.response_ids, each.response_ids)


def test_shard_bounds_cut_at_prompt_boundaries():
    """Shards are cut only where the prompt changes (a prompt's samples share one shard and its prefill), as even
    in rows as that allows; fewer prompts than shards give one shard per prompt; one shard is the whole batch."""
    from refit.rollout.decode import row_keys, shard_bounds

    keys = row_keys(torch.arange(16).repeat_interleave(8), 8)  # 16 prompts x 8 samples
    assert shard_bounds(keys, 2) == [(0, 64), (64, 128)]
    assert shard_bounds(keys, 3) == [(0, 40), (40, 88), (88, 128)]  # 42.7 and 85.3 rows: nearest prompt starts
    assert shard_bounds(keys, 1) == [(0, 128)]
    assert shard_bounds(row_keys(torch.arange(2).repeat_interleave(4), 4), 4) == [(0, 4), (4, 8)]
    uneven = [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 0)]  # keys of 3 prompts, 1 + 5 + 1 rows
    assert shard_bounds(uneven, 2) == [(0, 6), (6, 7)]  # the prompt start nearest row round(3.5) = 4: row 6


def test_sharded_decode_runs_shards_on_threads_of_their_own():
    """schedule(shards=S): each shard's state made by new_state(shard) and stepped on its own thread (shard 0 on the
    caller's), the rows concatenated in input order, right-padded to the longest; a failing shard is raised."""
    import threading

    from refit.rollout.decode import schedule
    from refit.rollout.types import ModelSpec

    vocab = 11
    spec = ModelSpec(kind="decoder", vocab_size=vocab, pad_id=0, eos_id=1, max_len=64, prompt_side="left",
                     decoder_start_id=None)

    class Counting:  # next token = (last + 1) % vocab: rows of different prompts stop at different steps
        def __init__(self, shard, seen):
            self.shard, self.seen = shard, seen

        def _logits(self, last):
            self.seen.add((self.shard, threading.current_thread()))  # the Thread object: an ident is reused
            out = torch.full((len(last), vocab), -1e9)
            out[torch.arange(len(last)), (last + 1) % vocab] = 0.0
            return out

        def prefill(self, ids, mask):
            return self._logits(ids[:, -1])

        def extend(self, ids, mask):
            return self._logits(ids[:, -1])[:, None]

    ids = torch.tensor([[5], [5], [8], [8], [2], [2]])  # 3 prompts x 2 samples; 8 -> 9 -> 10 -> 0 -> eos
    mask = torch.ones_like(ids)
    keys = [(p, s) for p in range(3) for s in range(2)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    seen: set = set()
    want = schedule(lambda: Counting(0, set()), ids, mask, params, spec, keys, None)
    got = schedule(lambda shard=0: Counting(shard, seen), ids, mask, params, spec, keys, None, shards=3)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert {s for s, _ in seen} == {0, 1, 2} and len({t for _, t in seen}) == 3, seen
    assert threading.current_thread() in {t for s, t in seen if s == 0}, "shard 0 runs on the caller's thread"

    class Broken(Counting):
        def extend(self, ids, mask):
            raise RefitError("shard 2 failed")

    with pytest.raises(RefitError, match="shard 2 failed"):
        schedule(lambda shard=0: (Broken if shard == 2 else Counting)(shard, set()), ids, mask, params, spec, keys,
                 None, shards=3)


@pytest.mark.parametrize("arch", DECODERS)
def test_sharded_engine_gives_the_same_rows(engine_dirs, plain_dirs, model_dirs, prompts, arch):
    """OrtEngine(shards=S): the rows cut into S shards decoded on S threads at once over the same sessions are the
    rows of one batch, bit for bit (tokens, both log-prob kinds, top-k), static and in flight, on the fused and
    the plain graph; each shard keeps KV buffers of its own; a weight push reaches every shard."""
    import numpy as np

    params = SamplingParams(max_new_tokens=12, seed=5, temperature=0.9, top_k=50, n=2, return_topk=3,
                            stop_ids=tuple(range(5, 40)))
    one = create_engine("onnxruntime", engine_dirs[arch]).generate(prompts, params)
    for folder in (engine_dirs[arch], plain_dirs[arch]):
        for kw in ({"shards": 2}, {"shards": 3, "threads": 3}, {"shards": 2, "slots": 4}):
            eng = create_engine("onnxruntime", folder, **kw)
            got = eng.generate(prompts, params)
            _same(one, got, tol=0 if folder == engine_dirs[arch] else TOL)
            if folder == engine_dirs[arch]:
                assert torch.equal(one.topk_ids, got.topk_ids)
                held = [p.held for p in eng._kv_pools]
                assert len(held) == kw["shards"] and all(h is not None for h in held)
                assert not any(np.shares_memory(held[0].arrays[n], held[1].arrays[n]) for n in held[0].arrays)
    # a push (perturbed weights) reaches every shard: the sharded engine's rows are the one-batch engine's
    from refit.rollout.torch_backend import TorchEngine

    g = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
           for n, p in TorchEngine(model_dirs[arch]).model.named_parameters()}
    one, sharded = create_engine("onnxruntime", engine_dirs[arch]), create_engine("onnxruntime", engine_dirs[arch],
                                                                                   shards=2)
    before = sharded.generate(prompts, params)
    one.update_weights(new)
    sharded.update_weights(new)
    after = sharded.generate(prompts, params)
    assert not torch.equal(before.rollout_plain_logprobs, after.rollout_plain_logprobs), "the push changed the rows"
    _same(one.generate(prompts, params), after, tol=0)
    with pytest.raises(RefitError, match="shards must be an integer >= 1"):
        create_engine("onnxruntime", engine_dirs[arch], shards=0)


def test_sharded_encoder_decoder_engine_gives_the_same_rows(engine_dirs, prompts):
    """T5 (the fused seq2seq decoder): each shard runs the encoder on its rows and decodes over buffers of its own;
    the rows are one batch's, bit for bit."""
    params = SamplingParams(max_new_tokens=10, seed=4, temperature=0.8, n=2)
    one = create_engine("onnxruntime", engine_dirs["tiny-t5"]).generate(prompts, params)
    _same(one, create_engine("onnxruntime", engine_dirs["tiny-t5"], shards=3).generate(prompts, params), tol=0)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_sharded_score_gives_the_same_log_probs(engine_dirs, prompts, arch):
    """score() on an engine with shards: row ranges scored on threads of their own, joined in order: the same
    log-probs, top-k and whole-vocabulary results as one batch, bit for bit (the whole vocabulary's ids stay a
    broadcast view)."""
    one = create_engine("onnxruntime", engine_dirs[arch])
    sharded = create_engine("onnxruntime", engine_dirs[arch], shards=3)
    batch = one.generate(prompts, SamplingParams(max_new_tokens=9, seed=1, n=2))
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    for topk in (0, 4, one.spec.vocab_size):
        want, got = one.score(*args, topk=topk, chunk_size=4), sharded.score(*args, topk=topk, chunk_size=4)
        assert torch.equal(want.logprobs, got.logprobs), topk
        if topk:
            assert torch.equal(want.topk_logprobs, got.topk_logprobs) and torch.equal(want.topk_ids, got.topk_ids)
    assert got.topk_ids.stride()[0] == 0, "the whole vocabulary's ids are a view, not (B, Tr, V) int64"
    empty = sharded.score(*args[:2], batch.response_ids[:, :0], batch.response_mask[:, :0], topk=4)
    assert empty.logprobs.shape == (batch.num_rows, 0) and empty.topk_ids.shape == (batch.num_rows, 0, 4)
