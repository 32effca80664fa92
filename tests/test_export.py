"""Export: parity for each geometry, padding invariance, weight map, cache reuse, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from export.checkpoint import load_model
from export.errors import RefitError
from export.graph import open_session
from export.manifest import Manifest
from export.onnx_export import ExportOptions, export_onnx
from export.padding import pad_batch
from export.parity import _log_softmax, engine_greedy_logits, torch_reference_logits
from export.weight_map import canonical_params, engine_weights

from conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_export_parity_recorded(engine_dirs, arch):
    m = Manifest.read(engine_dirs[arch])
    p = m.parity
    assert p.max_abs_logprob_diff < 1e-4 and p.max_abs_logit_diff < 1e-4
    assert p.decode_steps >= 4 and len(set(p.prompt_lengths)) > 1
    assert m.padding.prompt_side == ("right" if arch == "tiny-t5" else "left")
    for g, spec in m.graphs.items():
        assert (engine_dirs[arch] / spec.file).exists() and (engine_dirs[arch] / spec.data).exists()
        assert spec.inputs and spec.outputs[0] in ("logits", "encoder_hidden_states")
    assert set(m.versions) >= {"torch", "transformers", "onnx", "onnxruntime"}
    assert m.hashes.hf_weights_sha256 and m.cache_key


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_invariance(engine_dirs, tokenizer, arch):
    """A prompt alone and inside a padded batch gives the same engine log-probs (1e-5)."""
    eng = engine_dirs[arch]
    m = Manifest.read(eng)
    seqs = [tokenizer(p).input_ids for p in ["1+2=", "sort 987654 = ", "Refit"]]
    ids, mask = pad_batch(seqs, m.special_ids.pad, m.padding.prompt_side)
    batch, fed_b = engine_greedy_logits(eng, m, ids, mask, n_decode=4)
    for i, s in enumerate(seqs):
        a_ids, a_mask = pad_batch([s], m.special_ids.pad, m.padding.prompt_side)
        alone, fed_a = engine_greedy_logits(eng, m, a_ids, a_mask, n_decode=4)
        np.testing.assert_array_equal(fed_a[0], fed_b[i])
        np.testing.assert_allclose(_log_softmax(alone[0]), _log_softmax(batch[i]), atol=1e-5, rtol=0)


def test_weight_map_complete_and_one_to_one(engine_dirs, model_dirs):
    for arch in ARCHS:
        m = Manifest.read(engine_dirs[arch])
        model = load_model(model_dirs[arch])
        params, tied = canonical_params(model)
        assert set(m.weight_map) == set(params), arch
        assert m.tied == tied
        targets = [(t.graph, t.engine) for ts in m.weight_map.values() for t in ts]
        assert len(targets) == len(set(targets)), f"{arch}: an engine weight has two owners"
    llama = Manifest.read(engine_dirs["tiny-llama"]).weight_map
    assert any(t.transform == "transpose" for ts in llama.values() for t in ts), "expected folded transposes"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_weight_feeds_a_transpose(engine_dirs, arch):
    """Tied lm_heads are Gemm(transB=1) on the stored weight (gemm_for_transposed_weights), so ONNX
    Runtime folds no transposed copy of a weight when a session opens (every weight push)."""
    import onnx

    m = Manifest.read(engine_dirs[arch])
    for spec in m.graphs.values():
        g = onnx.load(str(engine_dirs[arch] / spec.file), load_external_data=False).graph
        weights = {t.name for t in g.initializer}
        assert not [n.name for n in g.node if n.op_type == "Transpose" and n.input[0] in weights]
    if arch != "tiny-llama":  # GPT-2 and T5 tie the lm_head to the embedding
        dec = onnx.load(str(engine_dirs[arch] / "decoder.onnx"), load_external_data=False).graph
        assert any(n.op_type == "Gemm" and n.output[0].endswith("_gemm_y") for n in dec.node)


@pytest.mark.parametrize("arch", ARCHS)
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
    new = engine_weights(params, m.weight_map, torch.float32)
    sessions = {name: open_session(eng / spec.file, {k: v.numpy() for k, v in new[name].items()})
                for name, spec in m.graphs.items()}
    seqs = [tokenizer(p).input_ids for p in ["12+34=", "sort 31 = "]]
    ids, mask = pad_batch(seqs, m.special_ids.pad, m.padding.prompt_side)
    import export.parity as parity

    orig = parity.open_session
    parity.open_session = lambda path, *a, **k: sessions[path.stem]
    try:
        eng_logits, fed = engine_greedy_logits(eng, m, ids, mask, n_decode=4)
    finally:
        parity.open_session = orig
    ref = torch_reference_logits(model, m, ids, mask, fed)
    np.testing.assert_allclose(_log_softmax(eng_logits), _log_softmax(ref), atol=1e-4, rtol=0)
    base, _ = engine_greedy_logits(eng, m, ids, mask, n_decode=0)
    assert np.abs(base[:, 0] - eng_logits[:, 0]).max() > 1e-3, "perturbed weights did not change the output"


def test_reexport_same_weights_is_reused(engine_dirs, model_dirs):
    logs = []
    out = export_onnx(model_dirs["tiny-gpt2"], engine_dirs["tiny-gpt2"], ExportOptions(max_batch=16, max_len=128),
                      log=logs.append)
    assert out == engine_dirs["tiny-gpt2"] and "reused" in logs[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "learner.cli", *args], capture_output=True, text=True, timeout=300)


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


def test_bad_input_unsupported_architecture(tmp_path, model_dirs, fresh_copy):
    d = fresh_copy(model_dirs["tiny-gpt2"], "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "unsupported architecture", "gpt2", "t5")


def test_bad_input_corrupt_config(tmp_path, model_dirs, fresh_copy):
    d = fresh_copy(model_dirs["tiny-gpt2"], "m")
    (d / "config.json").write_text("{not json")
    _one_line_error(_cli("export", str(d), "-o", str(tmp_path / "out")), "not valid JSON")


def test_bad_input_output_holds_something_else(tmp_path, model_dirs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _one_line_error(_cli("export", str(model_dirs["tiny-gpt2"]), "-o", str(out)), "holds something else")
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
        export_onnx(model_dirs["tiny-gpt2"], tmp_path / "out", ExportOptions(parity_tol=1e-12), log=lambda *_: None)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_cli_help_lists_every_command():
    r = _cli("--help")
    assert r.returncode == 0
    for c in ("export", "generate", "bench", "ppo", "distill", "demo", "build-model"):
        assert c in r.stdout
    r = _cli("export", "--help")
    assert r.returncode == 0 and "--max_batch" in r.stdout and "--dtype" in r.stdout  # --max-batch is accepted too
