"""LoRA end to end: the LoRA-ready engine against PEFT's forward, adapter pushes and their probe, the adapter-off
reference, KL(0), resume, the PEFT folder out, and the one-line refusals.

The reference for every engine check is PEFT's own ``PeftModel`` forward (refit.learner.run.policy.learner_view),
with the engine's padding and positions, the same as for full-model pushes."""

from __future__ import annotations

import json

import pytest
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.options import ExportOptions
from refit.learner.run.config import LoraSection
from refit.learner.run.sync import Contract, WeightSync, push_tensors
from refit.learner.run.lora import AdapterOff, adapter_tensors, apply_lora
from refit.learner.run.policy import learner_view
from refit.rollout.build import build
from refit.rollout.engine import create_engine
from refit.rollout.types import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]  # four lengths: padding exercised
QUIET = dict(log=lambda *_: None)


def _room(eng, probe, run_dir, tol=1e-4, int8=None) -> WeightSync:
    """The sync room a run would hold over ``eng`` with ``probe`` (temperature 1)."""
    return WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=tol, int8_manifest=int8), run_dir)


@pytest.fixture(scope="module")
def lora_engines(tmp_path_factory, model_dirs):
    """{(geometry, quantize): LoRA-ready (all-linear) engine folder}, each exported on first use."""
    root = tmp_path_factory.mktemp("lora_engines")
    made = {}

    def get(geometry: str, quantize: str = "none", targets=("all-linear",), round_weights: str = "none"):
        key = (geometry, quantize, tuple(targets), round_weights)
        if key not in made:
            made[key] = build(model_dirs[geometry], root / f"{geometry}-{quantize}-{len(made)}",
                              opts=ExportOptions(max_batch=16, max_len=128, quantize=quantize, lora=tuple(targets),
                                                 round_weights=round_weights), **QUIET)
        return made[key]

    return get


def _peft(model_dir, r=4, alpha=8.0, seed=0, targets=("all-linear",), base_dtype="fp32"):
    from refit.core.hf_folder import load_model, model_info

    torch.manual_seed(seed)
    return apply_lora(load_model(model_dir, model_info(model_dir)),
                      LoraSection(r=r, alpha=alpha, target_modules=targets, base_dtype=base_dtype))


@torch.no_grad()
def _perturb_adapter(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _diff(engine, model, batch) -> float:
    eng = engine.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask).logprobs
    mine = learner_view(model, None, batch, 1.0)[0]
    return float(((eng - mine).abs() * batch.response_mask).max())


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama", "tiny-t5"])
def test_engine_with_adapter_equals_peft_forward(arch, model_dirs, lora_engines):
    """GPT-2 (Conv1D, Gemm), Llama (MatMul of a transposed weight) and T5 (encoder and decoder graphs, cross
    attention): after a push of a random adapter the engine's log-probs equal PEFT's within the fp32 gate; the
    push moved exactly the adapter's bytes; the adapter-off view still scores the base."""
    folder = lora_engines(arch)
    m = Manifest.read(folder)
    assert m.lora is not None and m.lora.targets
    if arch == "tiny-t5":
        assert {g for t in m.lora.targets.values() for g in t.graphs} == {"encoder", "decoder"}
    model = _peft(model_dirs[arch])
    assert sorted(m.lora.targets) == sorted(n for n, _ in model.base_model.model.named_modules()
                                            if hasattr(_, "lora_A"))
    eng = create_engine("onnxruntime", folder, hold_weights=False)
    ref = eng.adapter_off()
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0, top_k=20))
    assert _diff(eng, model, batch) < 1e-4  # step 0: B = 0, the policy is the base
    base_lp = learner_view(model, None, batch, 1.0)[0]
    _perturb_adapter(model)
    moved = float(((learner_view(model, None, batch, 1.0)[0] - base_lp).abs() * batch.response_mask).max())
    assert moved > 1e-2  # the adapter changes the function
    tensors = adapter_tensors(model)
    eng.update_weights(tensors)
    assert eng.last_push_s["adapter_bytes"] == sum(t.numel() * 4 for t in tensors.values())
    assert _diff(eng, model, batch) < 1e-4
    assert _diff(ref, AdapterOff(model), batch) < 1e-4  # the reference: the base, on the same sessions
    again = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0, top_k=20))  # the decode loop runs it
    assert float(((again.rollout_plain_logprobs - learner_view(model, None, again, 1.0)[0]).abs()
                  * again.response_mask).max()) < 1e-4
    eng.close()


def test_adapter_off_reference_is_the_base_engine_bit_for_bit(model_dirs, lora_engines, default_engine_dirs):
    """The adapter-off view of a pushed LoRA engine scores exactly what the plain engine of the same model
    scores: the unbound branch adds an exact zero."""
    model = _peft(model_dirs["tiny-llama"])
    _perturb_adapter(model)
    eng = create_engine("onnxruntime", lora_engines("tiny-llama"), hold_weights=False)
    eng.update_weights(adapter_tensors(model))
    plain = create_engine("onnxruntime", default_engine_dirs["tiny-llama"], hold_weights=False)
    b = plain.generate(PROMPTS, SamplingParams(max_new_tokens=5, greedy=True))
    args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    assert torch.equal(eng.adapter_off().score(*args).logprobs, plain.score(*args).logprobs)
    assert not torch.equal(eng.score(*args).logprobs, plain.score(*args).logprobs)
    with pytest.raises(RefitError, match="adapter-off view"):
        eng.adapter_off().update_weights(adapter_tensors(model))


def test_stale_adapter_is_caught_by_the_probe_and_a_push_fixes_it(model_dirs, lora_engines, tmp_path):
    model = _peft(model_dirs["tiny-gpt2"])
    eng = create_engine("onnxruntime", lora_engines("tiny-gpt2"), hold_weights=False)
    probe = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    sync = _room(eng, probe, tmp_path)
    assert sync.check_now(model) < 1e-4
    _perturb_adapter(model)
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(model)  # the engine still runs the old adapter
    eng.update_weights(push_tensors(model))
    assert sync.check_now(model) < 1e-4
    # another rank: new buffers bound; rank 0 unbinds (off: the base again)
    other = _peft(model_dirs["tiny-gpt2"], r=2, alpha=4.0)
    _perturb_adapter(other, seed=3)
    eng.update_weights(adapter_tensors(other))
    assert _diff(eng, other, probe) < 1e-4
    off = {n: t[:0] if n.endswith("lora_A") else t[:, :0] for n, t in adapter_tensors(other).items()}
    eng.update_weights(off)
    assert _diff(eng, AdapterOff(other), probe) < 1e-4
    eng.update_weights(adapter_tensors(other))  # bound again after being off, at the rank it had
    assert _diff(eng, other, probe) < 1e-4


def test_int8_base_with_fp32_adapter(model_dirs, lora_engines, tmp_path):
    """An int8 base (MatMulInteger) with the adapter in fp32: the engine equals PEFT's model whose base layers
    run the engine's int8 arithmetic, within the int8 gate's tolerance; no base weight is re-quantized."""
    folder = lora_engines("tiny-llama", "int8")
    m = Manifest.read(folder)
    assert m.quantization is not None and m.lora is not None
    model = _peft(model_dirs["tiny-llama"])
    _perturb_adapter(model)
    eng = create_engine("onnxruntime", folder, hold_weights=False)
    eng.update_weights(adapter_tensors(model))
    assert eng.last_push_s["quantize"] == 0.0
    probe = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    sync = _room(eng, probe, tmp_path, int8=m)
    assert sync.check_now(model) <= 2e-3
    ref = sync.int8_reference(model)
    assert sync.int8_reference(model) is ref  # made once, held by the room, shares the policy's parameters
    assert not hasattr(model, "_refit_int8_reference")  # nothing set on the PEFT model
    assert {id(p) for p in ref.parameters()} <= {id(p) for p in model.parameters()} | {
        id(p) for p in ref.parameters() if p.dtype == torch.int8 or not p.requires_grad}
    from refit.core.int8 import Int8Linear

    held = [n for n, mod in ref.named_modules() if isinstance(mod, Int8Linear) and mod._weight is not None]
    assert held == []  # no dequantized fp32 copy of a base layer is kept (a full fp32 base, at 1.5B 6 GB)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_bf16_base_on_the_learner(arch, model_dirs, lora_engines, tmp_path):
    """lora.base_dtype bf16: the base's parameters in bf16 (the adapter and the rotary buffers in fp32), the engine
    exported from the same rounded weights (round_weights bf16). The probe (the learner's weights in fp32
    arithmetic, fp32_compute) equals the engine at step 0 and after a perturbed adapter's push, and catches the
    adapter left stale; the engine of the unrounded checkpoint is not what the learner holds; the bf16 training
    forward is within bf16 rounding of the engine, not equal to it."""
    from refit.learner.run.lora import fp32_compute

    model = _peft(model_dirs[arch], base_dtype="bf16")
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    eng = create_engine("onnxruntime", lora_engines(arch, round_weights="bf16"), hold_weights=False)
    probe = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    sync = _room(eng, probe, tmp_path)
    assert sync.check_now(model) < 1e-5  # the adapter's B is 0: the rounded base
    plain = create_engine("onnxruntime", lora_engines(arch), hold_weights=False)
    with fp32_compute(model):
        assert _diff(plain, model, probe) > 1e-4  # the checkpoint's own weights: not the base the learner holds
    _perturb_adapter(model)
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(model)  # the engine still runs the old adapter
    eng.update_weights(push_tensors(model, eng))
    assert sync.check_now(model) < 1e-5
    assert 1e-4 < _diff(eng, model, probe) < 0.1  # the bf16 forward: the engine's numbers up to bf16 rounding
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}  # fp32_compute undone


def test_bf16_base_with_an_int8_engine(model_dirs, lora_engines, tmp_path):
    """A bf16 learner base beside an int8 engine exported from the same rounded base: the probe (the learner's
    weights quantized as the engine's, in fp32 arithmetic) passes at the int8 gate's tolerance after a perturbed
    adapter's push, and catches the stale adapter."""
    folder = lora_engines("tiny-llama", "int8", round_weights="bf16")
    m = Manifest.read(folder)
    model = _peft(model_dirs["tiny-llama"], base_dtype="bf16")
    eng = create_engine("onnxruntime", folder, hold_weights=False)
    probe = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    sync = _room(eng, probe, tmp_path, int8=m)
    _perturb_adapter(model)
    with pytest.raises(RefitError, match="parity probe failed after weight push"):
        sync.check_now(model)
    eng.update_weights(adapter_tensors(model))
    assert sync.check_now(model) <= 2e-3


def test_bad_lora_settings_are_one_line(model_dirs, tmp_path):
    with pytest.raises(RefitError, match="lora: target_modules \\['no_such_layer'\\] cannot be used") as e:
        _peft(model_dirs["tiny-llama"], targets=("no_such_layer",))
    assert "\n" not in str(e.value)
    with pytest.raises(RefitError, match="lora: r = 4096 is larger than layer"):
        _peft(model_dirs["tiny-llama"], r=4096)
    with pytest.raises(RefitError, match="config: lora.r = -1"):
        LoraSection(r=-1)
    from refit.rollout.build import engine_source

    for backend in ("tensorrt", "torch", "hf"):
        with pytest.raises(RefitError, match="a LoRA-ready engine \\(adapter inputs\\) is built for rollout.backend "
                                             "onnxruntime"):
            engine_source(backend, model_dirs["tiny-llama"], tmp_path / "e", 4, 64, lora=("all-linear",))
    with pytest.raises(RefitError, match="config: lora needs an engine backend"):
        _cfg(model_dirs, tmp_path / "r", **{"rollout.backend": "torch"})
    with pytest.raises(RefitError, match="config: lora with scale.workers > 1 is not built"):
        _cfg(model_dirs, tmp_path / "r", **{"scale.workers": 2})
    with pytest.raises(RefitError, match="lora: target_modules \\['no_such_layer'\\] cannot be used"):
        build(model_dirs["tiny-llama"], tmp_path / "x", opts=ExportOptions(max_batch=4, max_len=64,
                                                                           lora=("no_such_layer",)), **QUIET)
    assert not (tmp_path / "x").exists()  # refused before anything was written


def _cfg(model_dirs, out, **kw):
    from refit.learner.ppo.config import PPOConfig

    base = {"model.model_dir": str(model_dirs["tiny-gpt2"]), "run.output_dir": str(out), "run.steps": 4,
            "run.batch_size": 4, "num_generations": 2, "advantage_estimator": "grpo", "response_length": 4,
            "ckpt.save_steps": 2, "rollout.probe_size": 4, "log.progress": False, "log.tensorboard": False,
            "log.plots": False, "data.max_operand": 9, "data.num_prompts": 32, "optim.learning_rate": 5e-3,
            "export_final": False, "lora.r": 4, "lora.alpha": 8.0, "num_ppo_epochs": 1, "num_mini_batches": 1,
            "rollout.quantize": "none"}  # the fp32 LoRA engine's paths (the int8 default: tests/test_precision.py)
    base.update(kw)
    return PPOConfig.from_flat(**base)


def _resumed_equals_uninterrupted(full, part) -> list[dict]:
    """A 4-step run stopped at step 2 and resumed (``part``) logs what the uninterrupted run (``full``) logs, and it
    trained (KL > 0 at the end); the uninterrupted run's rows."""
    from refit.learner.run.metrics import read_metrics

    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a[2:], b[2:]):
        for k, v in ra.items():
            if not k.startswith(("time/", "tokens_per_s")) and v is not None:
                assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (ra["step"], k)
    assert a[-1]["kl/exact"] > 1e-6  # it trained
    return a


def test_ppo_with_lora_kl0_adapter_only_checkpoint_and_exact_resume(model_dirs, tmp_path):
    """KL(0) <= 1e-6 with the reference on the engine's adapter-off view; the optimizer holds only the adapter;
    a checkpoint holds the adapter folder only; a run stopped at step 2 and resumed logs what the uninterrupted
    run logs."""
    from refit.learner.ppo.cycle import run_ppo, setup
    from refit.learner.ppo.route import experience

    run = setup(_cfg(model_dirs, tmp_path / "s"), resume=False, **QUIET)
    assert run.ref_engine is not None and run.ref_engine.sessions is run.engine.sessions.raw  # one copy of the base
    n_adapter = sum(p.numel() for p in run.policy.parameters() if p.requires_grad)
    assert sum(p.numel() for g in run.optimizer.param_groups for p in g["params"]) == n_adapter
    rollout = run.engine.generate(run.prompt_ids[:4], SamplingParams(max_new_tokens=6, top_k=5, top_p=0.9, seed=3))
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(stats[f"kl/{k}"]) <= 1e-6, (k, stats[f"kl/{k}"])
    run.engine.close()

    full = run_ppo(_cfg(model_dirs, tmp_path / "full"), **QUIET)
    part = tmp_path / "part"
    run_ppo(_cfg(model_dirs, part, **{"run.max_steps_this_run": 2}), **QUIET)
    ck = part / "checkpoints" / "step_000002" / "policy"
    assert (ck / "adapter_model.safetensors").is_file() and not (ck / "model.safetensors").exists()
    run_ppo(_cfg(model_dirs, part), resume=True, **QUIET)
    a = _resumed_equals_uninterrupted(full, part)
    assert max(r.get("probe/max_abs_logprob_diff", 0.0) for r in a) < 1e-4


def test_final_folders_merged_and_peft_adapter_agree(model_dirs, tmp_path):
    """OUTPUT_DIR/final loads with from_pretrained (the base with the adapter merged), OUTPUT_DIR/final/adapter
    with PeftModel.from_pretrained over the base; both give the trained policy's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from refit.learner.ppo.cycle import run_ppo

    out = run_ppo(_cfg(model_dirs, tmp_path / "r", **{"run.steps": 2, "export_final": True}), **QUIET)
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dirs["tiny-gpt2"]),
                                     out / "final" / "adapter").eval()
    assert json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    eng = create_engine("onnxruntime", out / "final_engine", hold_weights=False)
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    lp_merged, lp_peft = learner_view(merged, None, b, 1.0)[0], learner_view(peft, None, b, 1.0)[0]
    assert float(((lp_merged - lp_peft).abs() * b.response_mask).max()) < 1e-5
    base = AutoModelForCausalLM.from_pretrained(model_dirs["tiny-gpt2"]).eval()
    assert float(((learner_view(base, None, b, 1.0)[0] - lp_peft).abs() * b.response_mask).max()) > 1e-5
    assert _diff(eng, merged, b) < 1e-4


@pytest.mark.slow  # 33 s; the bf16 base is emulated on a CPU without bf16 units (CI's); test_precision covers the choice
def test_ppo_with_a_bf16_base_kl0_probe_resume_and_final(model_dirs, tmp_path):
    """A PPO run with lora.base_dtype bf16 and the head adapted: the reference is the policy with its adapter off in
    PyTorch (its bf16 arithmetic), so KL(0) is 0; every push passes the fp32 probe; a run stopped at step 2 and resumed
    logs what the uninterrupted run logs; OUTPUT_DIR/final holds fp32 weights that equal the learner's fp32 view and
    its engine (final_engine)."""
    from transformers import AutoModelForCausalLM

    from refit.learner.ppo.cycle import run_ppo, setup
    from refit.learner.ppo.route import experience
    from refit.learner.run.lora import AdapterOff, fp32_compute

    kw = {"lora.base_dtype": "bf16", "lora.target_modules": ("all-linear", "lm_head"),
          "reward": "refit.learner.builtin.tasks:length_reward"}  # dense: the policy moves off the reference
    run = setup(_cfg(model_dirs, tmp_path / "s", **kw), resume=False, **QUIET)
    assert run.ref_engine is None and isinstance(run.ref, AdapterOff) and not run.sync.contract.check_on_rollout
    assert run.cfg.correction == "tis"  # the bf16 forward and the engine's fp32 differ by rounding: corrected
    assert Manifest.read(tmp_path / "s" / "engine").options["round_weights"] == "bf16"
    rollout = run.engine.generate(run.prompt_ids[:4], SamplingParams(max_new_tokens=6, top_k=5, top_p=0.9, seed=3))
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert stats[f"kl/{k}"] == 0.0, (k, stats[f"kl/{k}"])
    run.engine.close()

    full = run_ppo(_cfg(model_dirs, tmp_path / "full", **kw, export_final=True), **QUIET)
    part = tmp_path / "part"
    run_ppo(_cfg(model_dirs, part, **kw, **{"run.max_steps_this_run": 2}), **QUIET)
    run_ppo(_cfg(model_dirs, part, **kw), resume=True, **QUIET)
    a = _resumed_equals_uninterrupted(full, part)
    assert max(r.get("probe/max_abs_logprob_diff", 0.0) for r in a) < 1e-5

    merged = AutoModelForCausalLM.from_pretrained(full / "final").eval()
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    eng = create_engine("onnxruntime", full / "final_engine", hold_weights=False)
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    assert _diff(eng, merged, batch) < 1e-4
    trained = _peft(model_dirs["tiny-gpt2"], targets=kw["lora.target_modules"], base_dtype="bf16")
    from refit.learner.run.lora import load_trainable_state
    from safetensors.torch import load_file

    load_trainable_state(trained, {k.replace(".weight", ".default.weight") if "lora_" in k else k: v for k, v in
                                   load_file(full / "final" / "adapter" / "adapter_model.safetensors").items()})
    with fp32_compute(trained):
        assert _diff(eng, trained, batch) < 1e-4  # final/ is the rounded base with the adapter, in fp32


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama"])
def test_all_linear_and_the_tied_output_head(arch, model_dirs, lora_engines, tmp_path):
    """``target_modules all-linear lm_head``: PEFT's all-linear layers plus the output head, which the embeddings
    are tied to (GPT-2; tiny-llama untied). The engine with the adapter equals PEFT's forward; the adapter on the
    head changes the function; OUTPUT_DIR/final (merged) loads with from_pretrained and equals PEFT's forward, its
    head untied from the unchanged input embeddings where the base tied them."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from refit.learner.builtin.models import build_tokenizer
    from refit.learner.run.final import save_final_model
    from refit.learner.run.lora import adapts_tied_head

    targets = ("all-linear", "lm_head")
    model = _peft(model_dirs[arch], targets=targets)
    every = _peft(model_dirs[arch])
    names = lambda m: {n for n, x in m.base_model.model.named_modules() if hasattr(x, "lora_A")}  # noqa: E731
    assert names(model) == names(every) | {"lm_head"}
    with pytest.raises(RefitError, match=r"lm_hed names no module of this model"):  # a typo beside all-linear
        _peft(model_dirs[arch], targets=("all-linear", "lm_hed"))
    tied = model.get_base_model().config.tie_word_embeddings
    assert adapts_tied_head(model) == tied and not adapts_tied_head(every)
    folder = lora_engines(arch, targets=targets)
    assert "lm_head" in Manifest.read(folder).lora.targets
    if tied:  # an engine without adapter inputs (TensorRT) would refit the head's merge into the embeddings too
        with pytest.raises(RefitError, match="output head tied to the input embeddings cannot be merged"):
            push_tensors(model, SimpleNamespace(adapter=None))
    else:
        assert "lm_head.weight" in push_tensors(model, SimpleNamespace(adapter=None))
    eng = create_engine("onnxruntime", folder, hold_weights=False)
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0, top_k=20))
    with torch.no_grad():  # only the head's adapter: it alone must move the output
        model.base_model.model.lm_head.lora_B["default"].weight.normal_(0, 0.05)
    eng.update_weights(adapter_tensors(model))
    assert _diff(eng, model, batch) < 1e-4
    assert _diff(eng.adapter_off(), AdapterOff(model), batch) < 1e-4
    base_lp = learner_view(AdapterOff(model), None, batch, 1.0)[0]
    mine = learner_view(model, None, batch, 1.0)[0]
    assert float(((mine - base_lp).abs() * batch.response_mask).max()) > 1e-2
    eng.close()
    model.eval()
    save_final_model(tmp_path, model, build_tokenizer())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    assert float(((learner_view(merged, None, batch, 1.0)[0] - mine).abs() * batch.response_mask).max()) < 1e-5
    assert not merged.config.tie_word_embeddings
    assert merged.get_output_embeddings().weight is not merged.get_input_embeddings().weight
    assert model.get_base_model().config.tie_word_embeddings == tied  # the live model's config is as it was
    embed = model.get_base_model().get_input_embeddings().weight
    assert torch.equal(merged.get_input_embeddings().weight, embed)  # the input side untouched
    from peft import PeftModel
    from safetensors import safe_open

    with safe_open(str(tmp_path / "final" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # the adapter only, not the frozen embedding matrices
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dirs[arch]),
                                     tmp_path / "final" / "adapter").eval()
    assert float(((learner_view(peft, None, batch, 1.0)[0] - mine).abs() * batch.response_mask).max()) < 1e-5


def test_distill_with_a_bf16_lora_base(model_dirs, engine_dirs, tmp_path):
    """refit distill with the student's LoRA base in bf16: the student engine is exported from the rounded base (the
    run's own folder), every push passes the fp32 probe, the losses are finite and the adapter trains."""
    from conftest import tiny_distill_config

    from refit.learner.distill.cycle import run_distill
    from refit.learner.run.metrics import read_metrics

    out = tmp_path / "d"
    run_distill(tiny_distill_config(model_dirs, engine_dirs, out, student_engine_dir="", lmbda=1.0,
                                    **{"lora.r": 4, "lora.alpha": 8.0, "lora.base_dtype": "bf16"}), **QUIET)
    rows = [r for r in read_metrics(out) if r["step"] > 0]  # step 0: the evaluation before training
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert max(r["probe/max_abs_logprob_diff"] for r in rows if "probe/max_abs_logprob_diff" in r) < 1e-5
    from safetensors.torch import load_file

    last = sorted(out.rglob("adapter_model.safetensors"))[-1]
    assert any(float(t.abs().max()) > 0 for k, t in load_file(last).items() if "lora_B" in k)  # B starts at 0
    engines = [Manifest.read(p.parent) for p in out.rglob("manifest.json")]
    assert any((m.options or {}).get("round_weights") == "bf16" and m.lora is not None for m in engines)
