"""Published model geometries (refit/learner/builtin/published.py): real widths, head dims, vocabularies, rope settings,
soft-capping and windows, with depth cut to 2 layers and random weights.

Per geometry: the export passes its parity gate (PyTorch's uncached forward vs the engine, 1e-4 on
log-probs) with the graph the exporter chose; perturbed weights pushed into the engine change its output
and equal PyTorch holding the same weights, restored ones give the original output; two PPO steps with
KL(0) = 0 within 1e-6 and exact KL >= 0; two distillation steps, the model its own teacher (KL(0) and
the step-1 loss 0 within 1e-6). The smokes are the family table's own (refit.bench.families, refit.bench.real).
Which geometries run in CI and which are ``slow`` is decided by their measured cost (RSS and seconds,
``python -m refit.bench.families --set real``): see CI and SLOW below.

Also: the table's values against the released models' parameter counts; Gemma-2's attention (per-layer
scale, soft-capping, alternating window, final soft-capping) in the fused graph's reference op and on an
ONNX Runtime node; one full-depth model (SmolLM2-135M) end to end.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from refit.learner.builtin.published import PUBLISHED, build_published, n_params, published_config

TOL = 1e-4  # the export gate's fp32 tolerance on log-probs (conftest.ATOL["onnxruntime"]["fp32"])
TEXTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7"]

# The rows' measured seconds and peak RSS (docs/families.md, "Published geometries") decide: CI runs the cheapest
# decoder-only and encoder-decoder rows.
CI = ["SmolLM2 135M", "T5-small"]
SLOW = [n for n in PUBLISHED if n not in CI]

# The released checkpoints' parameter counts (each model's hub page, safetensors total; tied weights once).
RELEASED_PARAMS = {
    "Llama 3.2 1B": 1_235_814_400, "Qwen2.5 0.5B": 494_032_768, "Qwen3 0.6B": 596_049_920,
    "SmolLM2 135M": 134_515_008, "Mistral 7B v0.1": 7_241_732_096, "Phi-3 mini": 3_821_079_552,
    "Gemma 2 2B": 2_614_341_888, "GPT-2 small": 124_439_808, "T5-small": 60_506_624, "BART-base": 139_420_416,
    "Qwen2.5 1.5B": 1_543_714_304, "Qwen2.5 3B": 3_085_938_688, "Llama 3.2 3B": 3_212_749_824,
}


@pytest.mark.parametrize("name", list(RELEASED_PARAMS))
def test_published_depth_has_the_released_parameter_count(name):
    """Every width, head count, vocabulary and tying choice of the table at once: the full-depth model built
    from it (meta device, no memory) has exactly the released checkpoint's parameter count."""
    assert n_params(name, n_layers=None) == RELEASED_PARAMS[name]


def test_published_settings_reach_the_config():
    """What a parameter count cannot see: rope scaling, windows, soft-capping, the pattern of Gemma-2's layers."""
    llama = published_config("Llama 3.2 1B")
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 32.0
    assert llama.rope_parameters["rope_theta"] == 500000.0 and llama.num_hidden_layers == 2
    gemma = published_config("Gemma 2 2B")
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.sliding_window == 4096
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping, gemma.query_pre_attn_scalar) == (50, 30, 256)
    assert published_config("Mistral 7B v0.1").sliding_window == 4096
    assert published_config("Qwen3 0.6B").head_dim == 128 != 1024 // 16
    t5 = published_config("T5-small")
    assert (t5.num_layers, t5.num_decoder_layers, t5.eos_token_id, t5.decoder_start_token_id) == (2, 2, 1, 0)


# ----------------------------------------------------------------------------- Gemma-2 in the fused graph


def _gemma_small_vocab(window: int):
    """Gemma-2-2B's attention geometry (head_dim 256, 8/4 heads, scalar 256, soft-capping 50/30) with a
    512-token vocabulary and a ``window``-token sliding window on layer 0, so short rows cross it."""
    from transformers import AutoModelForCausalLM

    cfg = published_config("Gemma 2 2B")
    cfg.vocab_size, cfg.sliding_window, cfg.intermediate_size = 512, window, 256
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_gemma2_fused_wrapper_matches_hf():
    """The fused graph's wrapper run eagerly (``refit::gqa``, the PyTorch reference of the ONNX node) equals HF's
    own forward on compact rows of 5, 2 and 7 tokens against a 4-token window on layer 0, full on layer 1:
    scale, attention soft-capping, the per-layer window and the final soft-capping all reach it."""
    import copy

    from refit.export.fused import FusedDecoder
    from refit.core.padding import position_ids_from_mask

    ref = _gemma_small_vocab(window=4)
    wrapped = FusedDecoder(copy.deepcopy(ref))
    cfg = ref.config
    lens = [5, 2, 7]
    ids, pos = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    left, lmask = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate(lens):
        r = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n))
        ids[i, :n], pos[i, :n] = r, torch.arange(n)
        left[i, 7 - n:], lmask[i, 7 - n:] = r, 1
    n = torch.tensor(lens, dtype=torch.int32)
    past = [torch.zeros(3, cfg.num_key_value_heads, 9, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    with torch.no_grad():
        out = wrapped(ids, pos, n - 1, n, torch.tensor(9, dtype=torch.int32), (n - 1).long()[:, None], *past)[0]
        want = ref(input_ids=left, attention_mask=lmask,
                   position_ids=torch.from_numpy(position_ids_from_mask(lmask.numpy()))).logits[:, -1]
        cfg.final_logit_softcapping = None
        uncapped = ref(input_ids=left, attention_mask=lmask,
                       position_ids=torch.from_numpy(position_ids_from_mask(lmask.numpy()))).logits[:, -1]
    torch.testing.assert_close(out[:, 0], want, atol=1e-5, rtol=0)
    assert (want - uncapped).abs().max() > 1e-3, "the final soft-capping is visible at this geometry"


def test_onnxruntime_softcap_matches_the_reference_op():
    """One GroupQueryAttention node with ``softcap``, ``scale``, a 3-token window and an attention bias on ONNX
    Runtime == ``refit::gqa`` with the same: the cap applies to the scaled scores before the bias (as ORT's CPU
    kernel does), and it changes the output at this cap."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as h

    from refit.export.fused import gqa

    n, d, cap, b, chunk, start, scale, softcap, window = 2, 8, 12, 2, 3, 4, 0.7, 0.5, 3
    vi = h.make_tensor_value_info
    ins = [vi(x, TP.FLOAT, ["b", "s", n * d]) for x in "qkv"]
    ins += [vi(x, TP.FLOAT, ["b", n, "c", d]) for x in ("pk", "pv")]
    ins += [vi("sk", TP.INT32, ["b"]), vi("tot", TP.INT32, []), vi("ab", TP.FLOAT, ["b", n, "s", "t"]),
            vi("qs", TP.INT32, ["b"])]
    node = h.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tot", "", "", "", "ab"] + [""] * 5
                       + ["qs"], ["o", "ok", "ov"], domain="com.microsoft", num_heads=n, kv_num_heads=n,
                       local_window_size=window, softcap=softcap, scale=scale)
    graph = h.make_graph([node], "g", ins, [vi(x, TP.FLOAT, None) for x in ("o", "ok", "ov")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(b, chunk, n * d, generator=g) for _ in range(3))
    pk, pv = 3 * torch.randn(b, n, cap, d, generator=g), torch.randn(b, n, cap, d, generator=g)
    qs = torch.tensor([chunk, 1], dtype=torch.int32)
    sk, tot = start + qs - 1, torch.tensor(start + chunk, dtype=torch.int32)
    ab = 2 * torch.randn(b, n, chunk, start + chunk, generator=g)
    feed = dict(q=q, k=k, v=v, pk=pk.clone(), pv=pv.clone(), sk=sk, tot=tot, ab=ab, qs=qs)
    got = torch.from_numpy(sess.run(["o"], {x: t.numpy() for x, t in feed.items()})[0])
    want = gqa(q, k, v, pk, pv, sk, tot, qs, ab, n, n, scale, window, softcap)[0]
    uncapped = gqa(q, k, v, pk, pv, sk, tot, qs, ab, n, n, scale, window, 0.0)[0]
    for i in range(b):
        torch.testing.assert_close(got[i, :qs[i]], want[i, :qs[i]], atol=1e-5, rtol=0)
    assert (want - uncapped).abs().max() > 1e-2


@pytest.mark.slow
def test_gemma2_fused_export_and_push_at_real_widths(tmp_path, tokenizer):
    """Gemma-2-2B's published widths (2 layers) with the vocabulary cut to 512 (the full 256000-row embedding
    alone is 2.4 GB fp32, beyond this machine's export budget): the FUSED graph passes the parity gate
    (``attention="fused"`` raises otherwise; before soft-capping reached the op it failed by 2.8), and a push
    of perturbed layer-0 weights, the ``1 + w`` norms among them, equals PyTorch."""
    from refit.bench.real import push_check
    from refit.core.manifest import Manifest
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    from transformers import AutoModelForCausalLM

    cfg = published_config("Gemma 2 2B")
    cfg.vocab_size = 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(tmp_path / "model"))
    tokenizer.save_pretrained(str(tmp_path / "model"))
    del model
    opts = ExportOptions(max_batch=16, max_len=128, attention="fused")
    engine = build(tmp_path / "model", tmp_path / "engine", opts=opts, log=lambda *_: None)
    m = Manifest.read(engine)
    assert m.attention == "fused" and m.parity.max_abs_logprob_diff <= TOL
    # scale 1: this random Gemma puts ~all mass on one token (logit 18 against a spread of 1.2), so the sampled
    # tokens' log-probs are ~0 and a 0.05 perturbation moves them by 3e-5 only
    r = push_check(str(tmp_path / "model"), str(engine), [tokenizer(t).input_ids for t in TEXTS], scales=(1.0,))
    assert any(t.transform not in (None, "copy", "transpose") for n in m.weight_map for t in m.weight_map[n]
               if "layernorm" in n), "Gemma's norms are pushed through their affine transform"
    assert r["changed_by"] > 1e-2 and r["vs_torch"] <= TOL and r["restored"] <= 1e-5


# ----------------------------------------------------------------------------- each geometry, 2 layers


def _geometries():
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PUBLISHED]


@pytest.fixture(scope="module", params=_geometries())
def exported(request, tmp_path_factory, tokenizer):
    """(name, record) of one geometry: checkpoint and engine folder, exported through the parity gate. One
    geometry is held at a time (module scope, one param), its folders removed after its tests."""
    from refit.core.manifest import Manifest
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    name = request.param
    root = tmp_path_factory.mktemp("real")
    model_dir = build_published(name, root / "model", tokenizer=tokenizer)
    engine_dir = build(model_dir, root / "engine", opts=ExportOptions(max_batch=16, max_len=128),
                             log=lambda *_: None)
    yield name, {"model_dir": str(model_dir), "engine_dir": str(engine_dir), "root": root,
                 "manifest": Manifest.read(engine_dir)}
    shutil.rmtree(root, ignore_errors=True)


def test_export_parity_at_real_geometry(exported):
    name, rec = exported
    m, cfg = rec["manifest"], published_config(name)
    assert m.parity.max_abs_logprob_diff <= TOL
    assert m.dims.vocab_size == cfg.vocab_size and m.dims.n_layers == 2
    if PUBLISHED[name].decoder_start is None:  # decoder-only: the fused graph applies and passes at each of these
        assert m.attention == "fused", f"{name}: fell back to {m.attention}"


def test_weight_push_at_real_geometry(exported, tokenizer):
    from refit.bench.real import push_check

    _, rec = exported
    r = push_check(rec["model_dir"], rec["engine_dir"], [tokenizer(t).input_ids for t in TEXTS])
    assert r["pushed"] >= 3
    assert r["changed_by"] > 1e-2, "perturbed weights must change the output"
    assert r["vs_torch"] <= TOL, "the engine must equal PyTorch holding the pushed weights"
    assert r["restored"] <= 1e-5


def _available_gb() -> float:
    """MemAvailable of /proc/meminfo, GB: what a child process may take without the kernel's OOM killer."""
    with open("/proc/meminfo") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
    return kb / 2**20


def _smoke_in_child(stage: str, name: str, rec: dict) -> dict:
    """``refit.bench.smokes.<stage>_smoke`` on the geometry's folders in a child process under an RSS cap of the
    memory available now less 1 GB: a geometry whose learner does not fit this machine (Gemma 2 2B's PPO at
    vocabulary 256000 on 24 GB) is skipped with its measured peak instead of the OOM killer ending the whole
    session. (A 90% cap skipped Mistral 7B's PPO at 20.3 GB, which passes here in-process.)"""
    import json
    import sys

    from refit.bench.real import measured

    code = ("import json, sys; from pathlib import Path; from refit.bench import smokes; "
            f"r = smokes.{stage}_smoke(json.loads(sys.argv[1]), Path(sys.argv[2]), export_final=False); "
            "print(json.dumps(r))")
    cap = round(_available_gb() - 1.0, 1)
    args = {k: rec[k] for k in ("model_dir", "engine_dir")}
    m = measured([sys.executable, "-c", code, json.dumps(args), str(rec["root"] / stage)], rss_cap_gb=cap)
    if m.capped:
        pytest.skip(f"{name}: the {stage} smoke passed {cap:g} GB RSS (the memory available here less 1 GB) after "
                    f"{m.seconds:.0f} s; it needs a larger machine (python -m refit.bench.families --set real "
                    "measures each geometry's peak)")
    assert m.rc == 0, f"{name} {stage} smoke: exit {m.rc}: {m.last_error}"
    return json.loads(m.stdout.strip().splitlines()[-1])


def test_ppo_two_steps_at_real_geometry(exported):
    name, rec = exported
    r = _smoke_in_child("ppo", name, rec)
    assert r["steps"] == 2
    assert abs(r["kl0"]) <= 1e-6
    assert r["min_exact_kl"] >= 0
    assert r["probe"] <= TOL


def test_distill_two_steps_at_real_geometry(exported):
    name, rec = exported
    r = _smoke_in_child("distill", name, rec)
    assert r["steps"] == 2
    assert abs(r["kl0"]) <= 1e-6 and abs(r["step1_loss"]) <= 1e-6  # its own teacher: nothing to learn
    assert r["probe"] <= TOL


# ----------------------------------------------------------------------------- one full-depth model, end to end


@pytest.mark.slow
def test_full_depth_smollm2_export_ppo_push_resume(tmp_path, tokenizer):
    """SmolLM2-135M at its published depth (30 layers, 134.5M parameters, random weights): export through the
    parity gate, two PPO steps (a weight push and probe each), stop, resume from the checkpoint for two more;
    KL(0) = 0, exact KL >= 0, every probe within the gate's tolerance, the engine's weights version goes on
    from the checkpoint; then the trained policy pushed whole into an engine of the exported weights equals
    PyTorch holding the trained policy."""
    import time

    from refit.core.manifest import Manifest
    from refit.export.options import ExportOptions
    from refit.rollout.build import build
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    t0 = time.perf_counter()
    model_dir = build_published("SmolLM2 135M", tmp_path / "model", n_layers=None, tokenizer=tokenizer)
    engine_dir = build(model_dir, tmp_path / "engine", opts=ExportOptions(max_batch=16, max_len=128),
                             log=lambda *_: None)
    m = Manifest.read(engine_dir)
    assert m.dims.n_layers == 30 and m.parity.max_abs_logprob_diff <= TOL and m.attention == "fused"
    t_export = time.perf_counter() - t0
    cfg = dict(model_dir=str(model_dir), engine_dir=str(engine_dir), output_dir=str(tmp_path / "run"), steps=4,
               batch_size=4, num_generations=2, advantage_estimator="gae", num_mini_batches=2, num_ppo_epochs=1,
               response_length=4, save_steps=2, probe_size=4, progress=False, tensorboard=False, plots=False, max_operand=9,
               num_prompts=32, learning_rate=1e-4, kl_estimator="exact", top_k=20, top_p=0.9,
               reward="refit.learner.builtin.tasks:length_reward", export_final=False)
    run_ppo(PPOConfig.from_flat(**cfg, max_steps_this_run=2), log=lambda *_: None)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    run_dir = run_ppo(PPOConfig.from_flat(**cfg), resume=True, log=lambda *_: None)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["engine/weights_version"] for r in rows] == [1, 2, 3, 4]
    assert abs(rows[0]["kl/exact"]) <= 1e-6 and min(r["kl/exact"] for r in rows) >= 0
    assert max(r["probe/max_abs_logprob_diff"] for r in rows if "probe/max_abs_logprob_diff" in r) <= TOL
    # the trained policy (the last checkpoint) pushed whole into a fresh engine of the exported weights
    from refit.export.weight_map import canonical_params
    from refit.rollout.ort_backend import OrtEngine
    from refit.rollout.torch_backend import TorchEngine
    from refit.rollout.types import SamplingParams

    ort, ref = OrtEngine(engine_dir), TorchEngine(run_dir / "checkpoints" / "step_000004" / "policy")
    batch = ref.generate([tokenizer(t).input_ids for t in TEXTS], SamplingParams(max_new_tokens=8, seed=0))
    score = lambda e: e.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids,  # noqa: E731
                              batch.response_mask).logprobs
    before = score(ort)
    params, _ = canonical_params(ref.model)
    ort.update_weights({n: t.detach() for n, t in params.items()})
    after, want = score(ort), score(ref)
    moved, vs_torch = float((after - before).abs().max()), float((after - want).abs().max())
    ort.close()
    ref.close()
    assert moved > 0 and vs_torch <= TOL
    print(f"\nfull-depth SmolLM2-135M: build + export {t_export:.1f} s (parity {m.parity.max_abs_logprob_diff:.2e}), "
          f"total {time.perf_counter() - t0:.1f} s; KL(0) {rows[0]['kl/exact']:.2e}, step-4 exact KL "
          f"{rows[-1]['kl/exact']:.2e}; trained policy pushed: moved {moved:.2e}, vs PyTorch {vs_torch:.2e}")


# ----------------------------------------------------------------------------- the table's measurements


def test_measured_peak_rss_and_cap():
    """refit.bench.real.measured: a child holding 400 MB reports a peak of at least that (wait4's ru_maxrss), and
    the same child under a 0.2 GB cap is stopped, not waited for."""
    import sys

    from refit.bench.real import measured

    hold = [sys.executable, "-c", "import time; b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
                                  "time.sleep(3); print('done')"]
    m = measured(hold)
    assert m.rc == 0 and not m.capped and m.stdout.strip() == "done" and m.peak_rss_gb >= 400 / 1024
    capped = measured(hold, rss_cap_gb=0.2)
    assert capped.capped and capped.rc != 0 and capped.seconds < 3 and "done" not in capped.stdout


def test_a_stage_runs_in_its_own_process_and_reports_its_failure_in_one_line(tmp_path):
    """refit.bench.real: each stage of a row is a child process of its own (its peak RSS is its own); a stage that
    fails (here: no engine folder under the work dir) comes back as one 'failed: ...' line, and the table prints
    it in that stage's cell with the stage's seconds and peak RSS."""
    from refit.bench.families import markdown_real
    from refit.bench.real import _stage_child

    result, m = _stage_child("push", "SmolLM2 135M", tmp_path, rss_cap_gb=4)
    assert isinstance(result, str) and result.startswith("failed: RefitError") and "\n" not in result
    assert m.rc == 0 and not m.capped and 0 < m.peak_rss_gb < 4
    rec = {"family": "SmolLM2 135M", "params_m": 35.4, "export": "ok", "attention": "fused", "parity": 2.5e-6,
           "export_s": 23.5, "export_rss_gb": 0.86, "push": result, "push_s": m.seconds, "push_rss_gb": m.peak_rss_gb,
           "push_anon_gb": m.peak_anon_gb, "seconds": 30.0, "peak_rss_gb": 0.9}
    assert 0 < m.peak_anon_gb <= m.peak_rss_gb + 0.01  # the poll's anonymous memory: part of what wait4 counts
    row = markdown_real([rec]).splitlines()[-1]
    assert "failed: RefitError" in row and f"{m.seconds} s, {m.peak_rss_gb} GB (anon {m.peak_anon_gb}); -; -" in row
    cut = markdown_real([{**rec, "vocab_cut": 512}]).splitlines()[-1]
    assert cut.startswith("| SmolLM2 135M (vocabulary cut to 512) |")
