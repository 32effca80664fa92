"""fp16 and bf16 engines (``refit export --dtype``): the gate at the dtype's tolerance against PyTorch in that
dtype, the graph side (ONNX checker, every I/O and weight dtype, the weight bytes against the checkpoint's
tensors rounded to the dtype), a push in that dtype against a PyTorch forward of the same weights, fused
attention or its fallback with the reason, and the learner's probe after a push into an fp16 engine.

On this CPU: fp16 graphs run on ONNX Runtime's CPU provider as they are; bf16 graphs through their CPU twin
(refit/export/precision.py). CI runs tiny models (tiny-llama, a Gemma-2-style model at head_dim 256 with a narrow
width); published geometries (2 layers, narrow vocabularies where the vocabulary only costs time) are slow.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.onnx_export import DTYPES, PARITY_TOL
from refit.export.options import ExportOptions
from refit.rollout.build import build
from refit.core.padding import pad_batch
from refit.rollout.parity import PARITY_PROMPTS, engine_greedy_logits, torch_reference_logits
from refit.rollout.parity import log_softmax as _log_softmax
from refit.export.precision import ONNX_ELEM, engine_run_on_cpu, graph_dtype_problems

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# published configurations (their config.json values), depth cut to 2; "vocab": None = the test tokenizer's
REAL = {
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                         rope_theta=100000.0, rms_norm_eps=1e-5)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                         intermediate_size=4864, vocab_size=None, tie_word_embeddings=True,
                                         rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "t5-small": ("T5Config", dict(d_model=512, num_heads=8, d_kv=64, d_ff=2048, vocab_size=32128,
                                  feed_forward_proj="relu", tie_word_embeddings=True)),
    "gemma-2-2b": ("Gemma2Config", dict(hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                        intermediate_size=9216, vocab_size=None, final_logit_softcapping=30.0,
                                        attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                                        sliding_window=4096)),
    # CI: Gemma 2's head_dim, soft-capping and 1 + w norms at a narrow width
    "narrow-gemma2": ("Gemma2Config", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                           intermediate_size=128, vocab_size=None, final_logit_softcapping=30.0,
                                           attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                                           sliding_window=4096)),
}


def build_config_model(name: str, out, tokenizer):
    """A random-weight 2-layer checkpoint of ``REAL[name]``; norm weights given values (Gemma inits them at 0,
    where ``1 + w`` and a push that drops it would agree)."""
    import transformers

    from refit.learner.builtin.models import _IDS

    cls, kw = REAL[name]
    kw = {**kw, "vocab_size": kw["vocab_size"] or len(tokenizer)}
    if cls == "T5Config":
        kw.update(num_layers=2, num_decoder_layers=2, decoder_start_token_id=0)
    else:
        kw.update(num_hidden_layers=2, max_position_embeddings=512)
    cfg = getattr(transformers, cls)(**kw, **_IDS)
    torch.manual_seed(0)
    auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory, model_dirs, tokenizer):
    """{(model, dtype): engine folder}, each exported on first use (attention auto)."""
    root = tmp_path_factory.mktemp("dtype")
    made = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in made:
            src = model_dirs[name] if name.startswith("tiny-") else root / name
            if not src.exists():
                build_config_model(name, src, tokenizer)
            made[name, dtype] = build(src, root / f"{name}-{dtype}", opts=ExportOptions(dtype=dtype, max_batch=8, max_len=64),
                                      log=lambda *_: None)
        return made[name, dtype]

    return get


def _weight_bytes(engine_dir, graph_file: str) -> dict[str, tuple[int, bytes]]:
    """{initializer: (onnx elem type, raw bytes)} of every external initializer, read from the .data file."""
    import onnx

    model = onnx.load(str(engine_dir / graph_file), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            with open(engine_dir / ext["location"], "rb") as f:
                f.seek(int(ext["offset"]))
                out[t.name] = (t.data_type, f.read(int(ext["length"])))
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()


def check_graph_side(d, dtype: str) -> int:
    """The graph-side checks, none needing a runtime: checker and dtypes (refit.export.precision), then every mapped
    weight's bytes equal the checkpoint's fp32 tensor rounded to the dtype (and transformed as the map says),
    computed here with torch alone. Returns the number of weights compared."""
    from refit.core.hf_folder import load_model
    from refit.rollout.tensorrt.check_weights import check_weight_map
    from refit.export.weight_map import canonical_params

    m = Manifest.read(d)
    assert m.dtype == dtype
    hf, _ = canonical_params(load_model(m.source_model))  # fp32, as saved
    n = 0
    for g, spec in m.graphs.items():
        targets = {t.engine: t.stored_dtype for ts in m.weight_map.values() for t in ts if t.graph == g}
        assert graph_dtype_problems(d / spec.file, dtype, targets) == []
        if m.attention != "fused":  # what TensorRT, the bf16 engine's runtime, refits: stored dtypes included
            assert check_weight_map(m, d / spec.file, g) == []
        stored = _weight_bytes(d, spec.file)
        for hf_name, ts in m.weight_map.items():
            for t in (x for x in ts if x.graph == g):
                # affine: rounded to the engine's dtype first (the graph computes 1 + w.float() from the bf16 w);
                # a copy in its own stored_dtype (T5's fp32 wo in fp16) straight from the checkpoint
                w = hf[hf_name].detach()
                w = (w.to(DTYPES[dtype]) if t.transform == "affine" else w).to(DTYPES[t.stored_dtype or dtype])
                want = {"identity": lambda: w, "transpose": lambda: w.t(),
                        "affine": lambda: w * t.scale + t.shift}[t.transform]()
                elem, raw = stored[t.engine]
                assert elem == ONNX_ELEM[t.stored_dtype or dtype], (hf_name, t)
                assert raw == _raw(want), f"{g}:{t.engine} does not hold {hf_name} in {dtype}"
                n += 1
    return n


def check_push(d, dtype: str, names: list[str], scale: float, tmp_path) -> tuple[float, float]:
    """Push perturbed ``names`` (in ``dtype``, through the weight map) into the graphs as the engine's session
    does (external initializers replaced), run the gate's greedy steps (a bf16 graph: its CPU twin), and compare
    with PyTorch in ``dtype`` holding the same weights. Returns (max |logprob diff| to PyTorch, max |logprob
    change| of the first step)."""
    from refit.core.hf_folder import load_model
    from refit.learner.builtin.models import build_tokenizer
    from refit.export.weight_map import canonical_params
    from refit.rollout.engine import create_engine

    work = tmp_path / d.name
    shutil.copytree(d, work)
    m = Manifest.read(work)
    model = load_model(m.source_model, dtype=DTYPES[dtype])
    params, _ = canonical_params(model)
    g = torch.Generator().manual_seed(7)
    new = {n: (params[n].detach().float() + scale * torch.randn(params[n].shape, generator=g)).to(DTYPES[dtype])
           for n in names}
    files, _ = engine_run_on_cpu(work, m.graphs, dtype)
    tok = build_tokenizer()
    seqs = [tok(p, add_special_tokens=False).input_ids for p in PARITY_PROMPTS]
    ids, mask = pad_batch(seqs, m.special_ids.pad, m.padding.prompt_side)
    before, _ = engine_greedy_logits(work, ids, mask, 3, files=files)
    engine = create_engine("onnxruntime", work, graph_files=files)
    engine.update_weights(new)  # through the map, in the engine's dtype (refit.export.weight_map.engine_weights)
    after, fed = engine_greedy_logits(work, ids, mask, 3, engine=engine)
    engine.close()
    with torch.no_grad():
        for n, t in new.items():
            params[n].copy_(t)
    ref = torch_reference_logits(model, m, ids, mask, fed)
    diff = float(np.abs(_log_softmax(after) - _log_softmax(ref)).max())
    changed = float(np.abs(_log_softmax(after[:, :1]) - _log_softmax(before[:, :1])).max())
    return diff, changed


def _check_manifest(d, dtype: str, attention: str):
    m = Manifest.read(d)
    p = m.parity
    assert (m.dtype, p.reference_dtype, p.tolerance_logprob) == (dtype, dtype, PARITY_TOL[dtype])
    assert p.max_abs_logprob_diff <= p.tolerance_logprob and f"in {dtype}" in p.reference
    assert m.attention == attention, m.attention_reason
    if dtype == "bf16":
        assert "CPU twin" in p.engine_run and "needs a GPU provider" in p.engine_run
        assert "no bf16 kernel" in m.attention_reason
        assert not list(d.glob("*twin*")), "the CPU twin is the gate's, not the engine folder's"
    else:
        assert p.engine_run.startswith("CPUExecutionProvider")
    return m


@pytest.mark.parametrize("dtype,attention", [("fp16", "fused"), ("bf16", "plain")])
def test_tiny_llama_export_push(exports, dtype, attention, tmp_path):
    d = exports("tiny-llama", dtype)
    _check_manifest(d, dtype, attention)
    assert check_graph_side(d, dtype) == len(Manifest.read(d).weight_map)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.input_layernorm.weight",
             "model.embed_tokens.weight"]
    diff, changed = check_push(d, dtype, names, 0.5, tmp_path)
    assert diff <= PARITY_TOL[dtype] and changed > 10 * max(diff, 1e-3), (diff, changed)


def test_gemma_style_norm_bf16_push(exports, tmp_path):
    """``1 + w.float()`` (Gemma's RMSNorm) stays fp32 in a bf16 graph: an affine target with stored_dtype fp32,
    whose bytes and push are exact; head_dim 256 (GroupQueryAttention would take it; bf16 falls back)."""
    d = exports("narrow-gemma2", "bf16")
    m = _check_manifest(d, "bf16", "plain")
    norms = {n: ts for n, ts in m.weight_map.items() if "norm" in n}
    assert norms and all(t.transform == "affine" and t.stored_dtype == "fp32" and t.shift == 1.0
                         for ts in norms.values() for t in ts)
    check_graph_side(d, "bf16")
    names = ["model.layers.0.input_layernorm.weight", "model.norm.weight", "model.layers.1.self_attn.k_proj.weight"]
    diff, changed = check_push(d, "bf16", names, 0.3, tmp_path)
    assert diff <= PARITY_TOL["bf16"] and changed > 10 * max(diff, 1e-3), (diff, changed)


def test_fused_bf16_refused_and_ort_backend_refuses_bf16_in_one_line(exports, model_dirs, tmp_path):
    from refit.rollout.ort_backend import OrtEngine

    with pytest.raises(RefitError, match="attention=fused does not apply.*no bf16 kernel"):
        build(model_dirs["tiny-llama"], tmp_path / "f", opts=ExportOptions(dtype="bf16", attention="fused"),
                    log=lambda *_: None)
    with pytest.raises(RefitError, match="is bf16: .*no bf16 compute kernels.*tensorrt backend on a GPU"):
        OrtEngine(exports("tiny-llama", "bf16"))


def test_learner_probe_after_push_into_fp16_engine(exports, model_dirs, prompts, tmp_path):
    """The learner's probe with an fp16 engine: compared with its fp32 model's weights rounded to fp16, at
    least the fp16 gate's tolerance; a push that took passes, an engine left stale fails in one line."""
    from refit.core.hf_folder import load_model
    from refit.learner.run.sync import Contract, WeightSync, engine_dtype
    from refit.rollout.ort_backend import OrtEngine
    from refit.rollout.torch_backend import TorchEngine
    from refit.rollout.types import SamplingParams

    eng = OrtEngine(exports("tiny-llama", "fp16"))
    assert engine_dtype(eng) == "fp16" and eng.manifest.attention == "fused"
    model = load_model(model_dirs["tiny-llama"])
    probe = TorchEngine(model_dirs["tiny-llama"]).generate(prompts, SamplingParams(max_new_tokens=6, seed=0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    sync = WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-3), tmp_path)
    pushed = sync.push_now(model)
    assert pushed.version == 1 == sync.version and pushed.probe_diff <= PARITY_TOL["fp16"]
    stale = copy.deepcopy(model)
    with torch.no_grad():
        stale.get_input_embeddings().weight.add_(0.5 * torch.randn(stale.get_input_embeddings().weight.shape,
                                                                   generator=g))
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(stale)


REAL_CASES = [("smollm2-135m", "fp16", "fused"), ("smollm2-135m", "bf16", "plain"), ("qwen2.5-0.5b", "bf16", "plain"),
              ("t5-small", "fp16", "fused"), ("t5-small", "bf16", "plain"), ("gemma-2-2b", "bf16", "plain")]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,attention", REAL_CASES, ids=[f"{n}-{d}" for n, d, _ in REAL_CASES])
def test_real_geometry_export_push(exports, name, dtype, attention, tmp_path):
    d = exports(name, dtype)
    m = _check_manifest(d, dtype, attention)
    check_graph_side(d, dtype)
    attn = [n for n in m.weight_map if "q_proj.weight" in n or "SelfAttention.q.weight" in n][:1]
    names = attn + [next(n for n in m.weight_map if "norm" in n or "layer_norm" in n)]
    # 0.05 absolute: 2.5x a q_proj's init std at these widths; larger weights grow the activations and the
    # dtype's error with them (0.3 gave 0.156 on Gemma-2-2B in bf16, past the 0.1 gate)
    diff, changed = check_push(d, dtype, names, 0.05, tmp_path)
    print(f"{name} {dtype}: gate {m.parity.max_abs_logprob_diff:.3e}, after push {diff:.3e}, change {changed:.3e}")
    assert diff <= PARITY_TOL[dtype] and changed > 5 * max(diff, 1e-3), (diff, changed)
