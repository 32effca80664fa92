"""Weight push (refit) on the ONNX Runtime engine, against the PyTorch reference.

As in TensorRT's refit sample: perturbed weights must change the output, the engine must then
equal the PyTorch engine holding the same state, and restored weights must give the original
output again. Exercised where the exporter made the map non-trivial: a pre-transposed weight
(Llama ``q_proj``), a tied embedding (GPT-2 ``wte``/``lm_head``, T5 ``shared`` feeding both
graphs) and weights that are byte-identical in a fresh model (LayerNorm/RMSNorm weights, which
the exporter would have merged without its fingerprinting).
"""

from __future__ import annotations

import pytest
import torch

from refit.core.errors import RefitError
from refit.rollout.engine import check_version
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

from conftest import ATOL

TOL = ATOL["onnxruntime"]["fp32"]  # the parity table's: ORT against the PyTorch reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pair(arch, engine_dirs, model_dirs):
    return OrtEngine(engine_dirs[arch]), TorchEngine(model_dirs[arch])


def _probe(ref, prompts):
    """A fixed sampled batch whose score() is the 'output' compared below."""
    return ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))


def _score(eng, batch):
    return eng.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask).logprobs


def _assert_engine_matches_reference(ort, ref, batch, prompts):
    torch.testing.assert_close(_score(ort, batch), _score(ref, batch), atol=TOL, rtol=0)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(ort.generate(prompts, greedy).response_ids, ref.generate(prompts, greedy).response_ids)


def _push_both(ort, ref, named):
    ort.update_weights(named)
    ref.update_weights(named)


def _roundtrip(ort, ref, prompts, named_new):
    """Perturb -> changed and equal to the reference -> restore -> the original output."""
    params = {**dict(ref.model.named_buffers()), **dict(ref.model.named_parameters(remove_duplicate=False))}
    original = {n: params[n].detach().clone() for n in named_new}
    batch = _probe(ref, prompts)
    before = _score(ort, batch)
    v0 = ort.weights_version
    _push_both(ort, ref, named_new)
    assert ort.weights_version == v0 + 1
    assert (_score(ort, batch) - before).abs().max() > 1e-3, "perturbed weights must change the output"
    _assert_engine_matches_reference(ort, ref, batch, prompts)
    _push_both(ort, ref, original)
    assert ort.weights_version == v0 + 2
    torch.testing.assert_close(_score(ort, batch), before, atol=1e-6, rtol=0)


def _noisy(t, seed, scale=0.5):
    return t.detach() + torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_transposed_weight_llama_q_proj(engine_dirs, model_dirs, prompts):
    ort, ref = _pair("tiny-llama", engine_dirs, model_dirs)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert [t.transform for t in ort.manifest.weight_map[name]] == ["transpose"]
    q = dict(ref.model.named_parameters())[name]
    assert q.shape[0] == q.shape[1], "square: a missing transpose would not fail on shape, only on values"
    _roundtrip(ort, ref, prompts, {name: _noisy(q, 1)})
    k = "model.layers.1.self_attn.k_proj.weight"  # GQA: (n_kv * d, d), not square
    _roundtrip(ort, ref, prompts, {k: _noisy(dict(ref.model.named_parameters())[k], 2)})


@pytest.mark.parametrize("arch,canonical,alias", [("tiny-gpt2", "transformer.wte.weight", "lm_head.weight"),
                                                  ("tiny-t5", "shared.weight", "decoder.embed_tokens.weight")])
def test_tied_embedding(engine_dirs, model_dirs, prompts, arch, canonical, alias):
    ort, ref = _pair(arch, engine_dirs, model_dirs)
    assert ort.manifest.tied[alias] == canonical
    emb = dict(ref.model.named_parameters())[canonical]
    _roundtrip(ort, ref, prompts, {canonical: _noisy(emb, 3, scale=2.0)})
    _roundtrip(ort, ref, prompts, {alias: _noisy(emb, 4, scale=2.0)})  # pushed under the tied alias
    if arch == "tiny-t5":
        assert {t.graph for t in ort.manifest.weight_map[canonical]} == {"encoder", "decoder"}


@pytest.mark.parametrize("arch,fmt", [("tiny-gpt2", "transformer.h.{}.ln_1.weight"),
                                      ("tiny-llama", "model.layers.{}.input_layernorm.weight")])
def test_duplicate_norm_weights_push_independently(engine_dirs, model_dirs, prompts, arch, fmt):
    ort, ref = _pair(arch, engine_dirs, model_dirs)
    a, b = fmt.format(0), fmt.format(1)
    params = dict(ref.model.named_parameters())
    assert torch.equal(params[a], params[b]), "fresh model: the two norm weights are byte-identical"
    engine_names = {ort.manifest.weight_map[n][0].engine for n in (a, b)}
    assert len(engine_names) == 2, "the exporter kept them as two engine weights"
    g = torch.Generator().manual_seed(5)
    new = {a: 1.0 + torch.rand(params[a].shape, generator=g), b: 0.2 + 0.5 * torch.rand(params[b].shape, generator=g)}
    _roundtrip(ort, ref, prompts, new)


def test_full_state_dict_push(engine_dirs, model_dirs, prompts):
    """Every HF name, aliases included, as a learner would push after an update."""
    ort, ref = _pair("tiny-t5", engine_dirs, model_dirs)
    sd = {n: _noisy(t, i, scale=0.05) for i, (n, t) in enumerate(ref.model.state_dict().items())}
    for alias, canon in ort.manifest.tied.items():
        sd[alias] = sd[canon]
    _push_both(ort, ref, sd)
    _assert_engine_matches_reference(ort, ref, _probe(ref, prompts), prompts)


def test_version_bumps_and_stale_batch(engine_dirs, model_dirs, prompts):
    ort, ref = _pair("tiny-gpt2", engine_dirs, model_dirs)
    assert ort.weights_version == 0 and ref.weights_version == 0
    old = ort.generate(prompts, SamplingParams(max_new_tokens=2))
    assert old.weights_version == 0
    name = "transformer.ln_f.bias"
    _push_both(ort, ref, {name: _noisy(dict(ref.model.named_parameters())[name], 6)})
    assert ort.weights_version == 1 and ref.weights_version == 1
    check_version(ort.generate(prompts, SamplingParams(max_new_tokens=2)), ort.weights_version)
    with pytest.raises(RefitError, match="stale"):
        check_version(old, ort.weights_version)


def test_bad_push_leaves_engine_unchanged(engine_dirs, model_dirs, prompts):
    ort, ref = _pair("tiny-gpt2", engine_dirs, model_dirs)
    batch = _probe(ref, prompts)
    before = _score(ort, batch)
    w = dict(ref.model.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    emb = dict(ref.model.named_parameters())["transformer.wte.weight"]
    bad = [{"transformer.h.0.attn.c_attn.weight": _noisy(w, 1), "no.such.weight": torch.zeros(3)},
           {"transformer.h.0.attn.c_attn.weight": torch.zeros(w.shape[0] + 1, w.shape[1])},
           {"transformer.wte.weight": _noisy(emb, 1), "lm_head.weight": _noisy(emb, 2)}]  # tied, two values
    for named in bad:
        for eng in (ort, ref):
            with pytest.raises(RefitError) as e:
                eng.update_weights(named)
            assert "\n" not in str(e.value)
    assert ort.weights_version == 0 and ref.weights_version == 0
    torch.testing.assert_close(_score(ort, batch), before, atol=0, rtol=0)


def test_pushed_tensors_are_owned_by_the_engine(engine_dirs, model_dirs, prompts):
    """The learner keeps training its tensors in place; the engine must not see that until the next push."""
    ort, ref = _pair("tiny-gpt2", engine_dirs, model_dirs)
    name = "transformer.h.1.mlp.c_fc.weight"
    t = _noisy(dict(ref.model.named_parameters())[name], 7)
    ort.update_weights({name: t})
    batch = _probe(ref, prompts)
    pushed = _score(ort, batch)
    t.mul_(-2.0)  # (adding a constant would be invisible after a fresh LayerNorm: its outputs sum to 0)
    torch.testing.assert_close(_score(ort, batch), pushed, atol=0, rtol=0)
    other = "transformer.ln_f.bias"  # a later push reopens the graph from the held weights
    ort.update_weights({other: dict(ref.model.named_parameters())[other].detach().clone()})
    torch.testing.assert_close(_score(ort, batch), pushed, atol=1e-6, rtol=0)


def test_failed_session_open_restores_the_engine(engine_dirs, model_dirs, prompts, monkeypatch):
    """update_weights closes the old session before opening the new one; if that open fails the held
    weights are reopened, the version stays and the output is the pre-push one."""
    import refit.rollout.ort_backend as ob

    ort, ref = _pair("tiny-gpt2", engine_dirs, model_dirs)
    batch = _probe(ref, prompts)
    before = _score(ort, batch)
    real, calls = ob.open_session, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RefitError("cannot load engine graph (planted)")
        return real(*a, **k)

    monkeypatch.setattr(ob, "open_session", flaky)
    name = "transformer.h.0.mlp.c_fc.weight"
    with pytest.raises(RefitError, match="planted"):
        ort.update_weights({name: _noisy(dict(ref.model.named_parameters())[name], 8)})
    assert len(calls) == 2 and ort.weights_version == 0
    torch.testing.assert_close(_score(ort, batch), before, atol=0, rtol=0)


def test_marian_push_every_weight_matches_torch(engine_dirs, model_dirs, prompts):
    """Marian, the seed thread's family: the whole 1:1 map (shared embedding tied to both graphs and
    the lm_head, sinusoidal tables, cross K/V projections in the encoder graph, final_logits_bias)
    pushed perturbed changes the output and equals PyTorch; restored gives the original again."""
    from refit.export.weight_map import canonical_params

    ort, ref = _pair("tiny-marian", engine_dirs, model_dirs)
    params, _ = canonical_params(ref.model)
    assert set(params) == set(ort.manifest.weight_map) and "final_logits_bias" in params
    _roundtrip(ort, ref, prompts, {n: _noisy(t, i, scale=0.05) for i, (n, t) in enumerate(params.items())})


def test_marian_final_logits_bias_alone(engine_dirs, model_dirs, prompts):
    """A buffer only BART-family models have: pushing it alone must reach the engine's logits."""
    ort, ref = _pair("tiny-marian", engine_dirs, model_dirs)
    bias = dict(ref.model.named_buffers())["final_logits_bias"]
    _roundtrip(ort, ref, prompts, {"final_logits_bias": _noisy(bias, 3)})


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_engine_that_does_not_hold_its_weights_takes_complete_pushes_only(arch, engine_dirs, model_dirs, prompts):
    """``hold_weights=False`` (the export's gate, a job's engines): the sessions read the folder's files, no copy
    held in Python. It computes exactly what the holding engine computes; a partial push (which would need the
    held set) is refused in one line, leaving the engine as it was; a complete push (every weight, as a job pushes)
    gives exactly what the holding engine gives after the same push, and moves the output. T5: two graphs and a
    tied embedding feeding both."""
    from refit.export.weight_map import canonical_params

    held, ref = _pair(arch, engine_dirs, model_dirs)
    light = OrtEngine(engine_dirs[arch], hold_weights=False, keep_heap=False)
    assert light.weights is None
    batch = _probe(ref, prompts)
    before = _score(held, batch)
    torch.testing.assert_close(_score(light, batch), before, atol=0, rtol=0)
    params, _ = canonical_params(ref.model)
    first = next(n for n in params if ".0." in n)
    with pytest.raises(RefitError, match="holds no copy of its weights") as e:
        light.update_weights({first: _noisy(params[first], 1)})
    assert "\n" not in str(e.value) and light.weights_version == 0
    torch.testing.assert_close(_score(light, batch), before, atol=0, rtol=0)
    new = {n: _noisy(t, i, scale=0.05) for i, (n, t) in enumerate(params.items())}
    light.update_weights(new)
    held.update_weights(new)
    ref.update_weights(new)
    after = _score(light, batch)
    assert light.weights_version == 1 and (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, _score(held, batch), atol=0, rtol=0)
    torch.testing.assert_close(after, _score(ref, batch), atol=TOL, rtol=0)
    light.close()


def test_engine_without_prepacking_scores_as_the_packed_one(engine_dirs, model_dirs, prompts):
    """``prepack=False`` (PPO's reference engine): the same graph without MLAS's packed weights, read from the
    folder's files; its log-probs equal the packed engine's within the fp32 parity tolerance, and a whole-model
    push reaches it."""
    from refit.export.weight_map import canonical_params

    packed, ref = _pair("tiny-llama", engine_dirs, model_dirs)
    plain = OrtEngine(engine_dirs["tiny-llama"], hold_weights=False, prepack=False, keep_heap=False)
    batch = _probe(ref, prompts)
    torch.testing.assert_close(_score(plain, batch), _score(packed, batch), atol=TOL, rtol=0)
    params, _ = canonical_params(ref.model)
    new = {n: _noisy(t, i, scale=0.05) for i, (n, t) in enumerate(params.items())}
    plain.update_weights(new)
    ref.update_weights(new)
    torch.testing.assert_close(_score(plain, batch), _score(ref, batch), atol=TOL, rtol=0)
    plain.close()


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-t5"])
def test_push_through_files_equals_the_memory_push(arch, engine_dirs, model_dirs, prompts, monkeypatch):
    """``push_via="file"``: the pushed weights written to a scratch graph pair beside the engine folder (never into
    it) and the sessions reopened from it give exactly what the memory route gives; a partial push and a push of a
    wrong shape are refused in one line with the engine unchanged and no file left; each push replaces the previous
    pair; close() removes the scratch folder; the engine folder's files are untouched."""
    import hashlib

    from refit.export.weight_map import canonical_params

    folder = engine_dirs[arch]
    digest = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())  # noqa: E731
                      if p.is_file()}
    before_files = digest()
    mem, ref = _pair(arch, engine_dirs, model_dirs)
    via = OrtEngine(folder, hold_weights=False, push_via="file", keep_heap=False)
    batch = _probe(ref, prompts)
    start = _score(via, batch)
    params, _ = canonical_params(ref.model)
    first = next(n for n in params if ".0." in n)
    with pytest.raises(RefitError, match="holds no copy of its weights"):
        via.update_weights({first: params[first]})
    bad = {**params, first: torch.zeros(3, 3)}
    with pytest.raises(RefitError, match="expects") as e:
        via.update_weights(bad)
    assert "\n" not in str(e.value) and via.weights_version == 0
    torch.testing.assert_close(_score(via, batch), start, atol=0, rtol=0)
    for round_ in (1, 2):
        new = {n: _noisy(t, 10 * round_ + i, scale=0.05) for i, (n, t) in enumerate(params.items())}
        via.update_weights(new)
        mem.update_weights(new)
        torch.testing.assert_close(_score(via, batch), _score(mem, batch), atol=0, rtol=0)
        assert via.weights_version == round_ and (_score(via, batch) - start).abs().max() > 1e-3
        assert sorted(p.name for p in via._scratch.iterdir()) == sorted(
            f"{g}.v{round_}.onnx{x}" for g in via.manifest.graphs for x in ("", ".data"))
    scratch = via._scratch
    assert scratch.parent == folder.parent
    via.close()
    assert not scratch.exists() and digest() == before_files
    monkeypatch.chdir(folder.parent)  # an engine folder given as a relative path (a run's runs/<name>/engine)
    rel = OrtEngine(folder.name, hold_weights=False, push_via="file", keep_heap=False)
    rel.update_weights(new)
    torch.testing.assert_close(_score(rel, batch), _score(mem, batch), atol=0, rtol=0)
    rel.close()
    assert digest() == before_files


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_nan_weight_push_stops_generation_in_one_line(engine_dirs, model_dirs, prompts, arch):
    """A push of a NaN weight (a diverged update) is taken, but the next generate stops in one line instead of
    sampling from NaN logits; pushing the original weights back restores the engine's output exactly."""
    ort, ref = _pair(arch, engine_dirs, model_dirs)
    sp = SamplingParams(max_new_tokens=6, seed=3)
    before = ort.generate(prompts, sp)
    sd = ref.model.state_dict()
    name = next(n for n in ort.manifest.weight_map if n.endswith("weight") and sd[n].dim() == 2 and "embed" not in n
                and "wte" not in n and "shared" not in n)
    bad = sd[name].clone()
    bad[0, 0] = float("nan")
    ort.update_weights({name: bad})
    with pytest.raises(RefitError, match="non-finite logits") as e:
        ort.generate(prompts, sp)
    assert "\n" not in str(e.value)
    ort.update_weights({name: sd[name]})
    after = ort.generate(prompts, sp)
    assert torch.equal(after.response_ids, before.response_ids) and torch.equal(after.rollout_logprobs,
                                                                                before.rollout_logprobs)
