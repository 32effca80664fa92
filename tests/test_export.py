"""Export: parity for every family (refit.bench.export_families), padding invariance, capabilities, weight map,
TensorRT CPU checks, cache reuse, bad input and refused models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from refit.core.hf_folder import load_model
from refit.core.errors import RefitError
from refit.bench.export_families import FAMILIES, SEQ2SEQ
from refit.core.manifest import Manifest
from refit.export.options import ExportOptions
from refit.rollout.build import build
from refit.core.padding import pad_batch
from refit.rollout.engine import create_engine
from refit.rollout.parity import engine_greedy_logits, torch_reference_logits
from refit.rollout.parity import log_softmax as _log_softmax
from refit.export.weight_map import canonical_params

FAMILY_ARCHS = list(FAMILIES.values())  # every family (GPT-2 ... Marian), one tiny checkpoint each


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_export_parity_recorded(engine_dirs, arch):
    m = Manifest.read(engine_dirs[arch])
    p = m.parity
    assert p.max_abs_logprob_diff < 1e-4 and p.max_abs_logit_diff < 1e-4
    assert p.decode_steps >= 4 and len(set(p.prompt_lengths)) > 1
    assert m.padding.prompt_side == ("right" if arch in SEQ2SEQ else "left")
    for g, spec in m.graphs.items():
        assert (engine_dirs[arch] / spec.file).exists() and (engine_dirs[arch] / spec.data).exists()
        assert spec.inputs and spec.outputs[0] in ("logits", "encoder_hidden_states")
    assert set(m.versions) >= {"torch", "transformers", "onnx", "onnxruntime"}
    assert m.hashes.hf_weights_sha256 and m.cache_key


# What the probe must find per family (refit.export.capabilities); the manifest records it.
EXPECTED_CAPS = {
    "tiny-gpt2": dict(positions="learned", position_offset=0, tied_head=True, n_kv_heads=4),
    "tiny-llama": dict(positions="rotary", rotary_fraction=1.0, tied_head=False, n_heads=4, n_kv_heads=2),
    "tiny-qwen2": dict(positions="rotary", tied_head=False, n_heads=4, n_kv_heads=2),
    "tiny-mistral": dict(positions="rotary", n_heads=4, n_kv_heads=1, sliding_window=4),
    "tiny-neox": dict(positions="rotary", rotary_fraction=0.25, tied_head=False),
    "tiny-phi": dict(positions="rotary", rotary_fraction=0.5, tied_head=False),
    "tiny-opt": dict(positions="learned", position_offset=2, tied_head=True),
    "tiny-t5": dict(positions="relative", padding_side="right", decoder_start_id=0, final_logits_bias=False),
    "tiny-bart": dict(positions="learned", position_offset=2, embed_scale=1.0, final_logits_bias=True,
                      padding_side="right", decoder_start_id=1, tied_head=True),
    "tiny-marian": dict(positions="sinusoidal", embed_scale=32 ** 0.5, final_logits_bias=True, padding_side="right",
                        decoder_start_id=0, tied_head=True),
}


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_capabilities_found_by_the_probe(engine_dirs, arch):
    m = Manifest.read(engine_dirs[arch])  # read() checks the record against dims, padding and special ids
    caps = m.capabilities
    for key, want in EXPECTED_CAPS[arch].items():
        assert getattr(caps, key) == pytest.approx(want), (arch, key, getattr(caps, key))
    assert (caps.kind == "seq2seq") == (arch in SEQ2SEQ)
    # a bias only BART-family models have is a weight of the map, fed to the decoder graph
    assert ("final_logits_bias" in m.weight_map) == caps.final_logits_bias


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in ("tiny-bart", "tiny-marian") else a
                                  for a in FAMILY_ARCHS])  # CI's budget: T5 stands for the encoder-decoders there
def test_trt_cpu_checks_pass(plain_engine_dirs, arch):
    """refit.rollout.tensorrt.check on each family's graphs: supported ops, covered profiles, 1:1 weight map (the
    standard-op graphs TensorRT builds from; the default decoder-only export is the fused one)."""
    from refit.rollout.tensorrt.check import check_engine_folder

    assert check_engine_folder(plain_engine_dirs[arch]) == []


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_padding_invariance(engine_dirs, tokenizer, arch):
    """A prompt alone and inside a padded batch gives the same engine log-probs (1e-5)."""
    eng = engine_dirs[arch]
    m = Manifest.read(eng)
    seqs = [tokenizer(p).input_ids for p in ["1+2=", "sort 987654 = ", "Refit"]]
    ids, mask = pad_batch(seqs, m.special_ids.pad, m.padding.prompt_side)
    batch, fed_b = engine_greedy_logits(eng, ids, mask, n_decode=4)
    for i, s in enumerate(seqs):
        a_ids, a_mask = pad_batch([s], m.special_ids.pad, m.padding.prompt_side)
        alone, fed_a = engine_greedy_logits(eng, a_ids, a_mask, n_decode=4)
        np.testing.assert_array_equal(fed_a[0], fed_b[i])
        np.testing.assert_allclose(_log_softmax(alone[0]), _log_softmax(batch[i]), atol=1e-5, rtol=0)


def test_weight_map_complete_and_one_to_one(engine_dirs, model_dirs):
    for arch in FAMILY_ARCHS:
        m = Manifest.read(engine_dirs[arch])
        model = load_model(model_dirs[arch])
        params, tied = canonical_params(model)
        assert set(m.weight_map) == set(params), arch
        assert m.tied == tied
        targets = [(t.graph, t.engine) for ts in m.weight_map.values() for t in ts]
        assert len(targets) == len(set(targets)), f"{arch}: an engine weight has two owners"
    llama = Manifest.read(engine_dirs["tiny-llama"]).weight_map
    assert any(t.transform == "transpose" for ts in llama.values() for t in ts), "expected folded transposes"


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_no_weight_feeds_a_transpose(engine_dirs, arch):
    """Tied lm_heads are Gemm(transB=1) on the stored weight (gemm_for_transposed_weights), so ONNX
    Runtime folds no transposed copy of a weight when a session opens (every weight push)."""
    import onnx

    m = Manifest.read(engine_dirs[arch])
    for spec in m.graphs.values():
        g = onnx.load(str(engine_dirs[arch] / spec.file), load_external_data=False).graph
        weights = {t.name for t in g.initializer}
        assert not [n.name for n in g.node if n.op_type == "Transpose" and n.input[0] in weights]
    if m.capabilities.tied_head:  # GPT-2, OPT, T5, BART, Marian tie the lm_head to the embedding
        dec = onnx.load(str(engine_dirs[arch] / "decoder.onnx"), load_external_data=False).graph
        assert any(n.op_type == "Gemm" and n.output[0].endswith("_gemm_y") for n in dec.node)


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_replacing_weights_through_map_reproduces_torch(engine_dirs, model_dirs, tokenizer, arch):
    """New weights (every tensor perturbed) pushed through the map give PyTorch's output for them."""
    eng = engine_dirs[arch]
    m = Manifest.read(eng)
    model = load_model(model_dirs[arch])
    params, _ = canonical_params(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params.values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    seqs = [tokenizer(p).input_ids for p in ["12+34=", "sort 31 = "]]
    ids, mask = pad_batch(seqs, m.special_ids.pad, m.padding.prompt_side)
    base, _ = engine_greedy_logits(eng, ids, mask, n_decode=0)
    engine = create_engine("onnxruntime", eng)
    engine.update_weights(params)  # through the map (refit.export.weight_map.engine_weights)
    eng_logits, fed = engine_greedy_logits(eng, ids, mask, n_decode=4, engine=engine)
    engine.close()
    ref = torch_reference_logits(model, m, ids, mask, fed)
    np.testing.assert_allclose(_log_softmax(eng_logits), _log_softmax(ref), atol=1e-4, rtol=0)
    assert np.abs(base[:, 0] - eng_logits[:, 0]).max() > 1e-3, "perturbed weights did not change the output"


def test_reexport_same_weights_is_reused(engine_dirs, model_dirs):
    logs = []
    out = build(model_dirs["tiny-gpt2"], engine_dirs["tiny-gpt2"], opts=ExportOptions(max_batch=16, max_len=128),
                      log=logs.append)
    assert out == engine_dirs["tiny-gpt2"] and "reused" in logs[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "refit", *args], capture_output=True, text=True, timeout=300)


def _one_line_error(r, *words):
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_input_missing_folder(tmp_path):
    _one_line_error(_cli("export", str(tmp_path / "nope"), "-o", str(tmp_path / "out")), "does not exist")
    assert not (tmp_path / "out").exists()


def test_bad_input_not_a_checkpoint(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "README").write_text("hello")
    _one_line_error(_cli("export", str(tmp_path / "m"), "-o", str(tmp_path / "out")), "not an HF checkpoint")
    assert not (tmp_path / "out").exists()


def test_bad_input_unknown_model_type(tmp_path, model_dirs, fresh_copy):
    d = fresh_copy(model_dirs["tiny-gpt2"], "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "not-a-model"
    (d / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "cannot read the config", "not-a-model")
    assert not (tmp_path / "out").exists()


def _tiny_mamba(out, tokenizer):
    """A real AutoModelForCausalLM whose cache holds SSM states, no attention keys/values."""
    from transformers import AutoModelForCausalLM, MambaConfig

    from refit.learner.builtin.models import BOS_ID, EOS_ID, PAD_ID

    cfg = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, state_size=4, num_hidden_layers=2,
                      pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def test_model_missing_a_capability_is_refused_before_writing(tmp_path, tokenizer):
    """Mamba: loadable, but its cache keeps no attention K/V; refused in one line, nothing written."""
    d = _tiny_mamba(tmp_path / "mamba", tokenizer)
    r = _cli("export", str(d), "-o", str(tmp_path / "out"))
    _one_line_error(r, "cannot export", "MambaForCausalLM", "missing capability: attention KV cache")
    assert not (tmp_path / "out").exists()
    # no temporary folder left either; the engine folder's lock file (refit/core/integrity.py engine_lock) stays beside
    # it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "mamba"], "no temporary folder left either"


def test_encoder_padding_side_is_probed_not_assumed(tmp_path, model_dirs, fresh_copy):
    """BART's encoder has learned positions and takes no position ids: a tokenizer that pads left
    (the seed thread's forced left padding) would shift them, so the probe refuses it."""
    d = fresh_copy(model_dirs["tiny-bart"], "m")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "padding_side": "left"}))
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "encoder output changes with left-padding",
                    "missing capability: padding-invariant prompts")
    assert not (tmp_path / "out").exists()


def test_bad_input_corrupt_config(tmp_path, model_dirs, fresh_copy):
    d = fresh_copy(model_dirs["tiny-gpt2"], "m")
    (d / "config.json").write_text("{not json")
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "not valid JSON")


def test_bad_input_output_holds_something_else(tmp_path, model_dirs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _one_line_error(_cli("export", str(model_dirs["tiny-gpt2"]), "-o", str(out)), "holds other files, not an engine")
    assert (out / "precious.txt").read_text() == "keep me"


def test_bad_input_tokenizer_vocab_mismatch(tmp_path, model_dirs, fresh_copy):
    from transformers import AutoModelForCausalLM

    d = fresh_copy(model_dirs["tiny-gpt2"], "m")
    model = AutoModelForCausalLM.from_pretrained(str(d))
    model.resize_token_embeddings(100)
    model.save_pretrained(str(d))
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "tokenizer/vocab mismatch", "100")
    assert not (tmp_path / "out").exists()


def test_failed_parity_leaves_no_output(tmp_path, model_dirs):
    with pytest.raises(RefitError, match="parity gate failed"):
        build(model_dirs["tiny-gpt2"], tmp_path / "out", opts=ExportOptions(parity_tol=1e-12), log=lambda *_: None)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_cli_help_lists_every_command():
    r = _cli("--help")
    assert r.returncode == 0
    for c in ("export", "generate", "bench", "ppo", "distill", "demo", "build-model"):
        assert c in r.stdout
    r = _cli("export", "--help")
    assert r.returncode == 0 and "--max_batch" in r.stdout and "--dtype" in r.stdout  # --max-batch is accepted too


def test_one_backend_spelling_and_the_old_name_still_taken(tmp_path):
    """An export is for the engine backend rollout.backend names ("onnxruntime" | "tensorrt"); the old "onnx" is
    taken with a warning users see, keeps the cache key an existing engine folder was written under, and anything
    else is refused in one line."""
    import warnings

    from refit.export.options import ExportOptions, cache_key

    assert ExportOptions().backend == "onnxruntime"
    with pytest.warns(FutureWarning, match="now spelled 'onnxruntime'"):
        old = ExportOptions(backend="onnx")
    assert old == ExportOptions() and old.backend == "onnxruntime"
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        key = cache_key(model, ExportOptions(backend="onnxruntime"))
    assert key == cache_key(model, old) and key != cache_key(model, ExportOptions(backend="tensorrt"))
    import hashlib
    from dataclasses import asdict

    from refit.core.contract import weights_hash
    from refit.export.options import EXPORTER_VERSION

    before = {k: v for k, v in asdict(ExportOptions()).items()  # the key as written before these fields existed
              if k not in ("quantize", "lora", "round_weights")}
    before["backend"] = "onnx"  # by the exporter when --backend was spelled onnx
    blob = json.dumps({"w": weights_hash(model), "o": before, "v": EXPORTER_VERSION}, sort_keys=True)
    assert key == hashlib.sha256(blob.encode()).hexdigest()[:32]  # engine folders already written are reused
    assert cache_key(model, ExportOptions(round_weights="bf16")) != key  # a rounded base is another engine
    with pytest.raises(RefitError, match="export backend 'vllm': one of onnxruntime, tensorrt"):
        ExportOptions(backend="vllm")
