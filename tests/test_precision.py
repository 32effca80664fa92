"""The precision chosen from the hardware (refit.learner.run.precision): every branch of the choice on injected
hardware facts, and real tiny runs at the new defaults (LoRA: an int8 engine here) and with bf16 forced (full
fine-tuning under bf16 autocast, emulated on a CPU without bf16 units), each with KL at step 1 exactly 0."""

from __future__ import annotations

import warnings

import pytest
import torch

from refit.learner.distill.config import DistillConfig
from refit.learner.ppo.config import PPOConfig
from refit.learner.run.precision import HardwareFacts, mixed_bf16, resolve_precision, with_precision

NO_BF16 = HardwareFacts(device="cpu", bf16_units=False, int8_isa="AVX512-VNNI")  # this box: a Xeon with VNNI only
BF16_CPU = HardwareFacts(device="cpu", bf16_units=True, bf16_isa="AVX512-BF16", int8_isa="AVX512-VNNI")  # Zen 4
OLD_CPU = HardwareFacts(device="cpu", bf16_units=False, int8_isa="")  # AVX2, no VNNI
CUDA = HardwareFacts(device="cuda", bf16_units=True, bf16_isa="NVIDIA H100", int8_isa="AVX512-VNNI")
OLD_GPU = HardwareFacts(device="cuda", bf16_units=False, int8_isa="AVX512-VNNI")  # V100, T4: no native bf16


def ppo(**kw) -> PPOConfig:
    return PPOConfig.from_flat(**{"model.model_dir": "m", **kw})


def resolved(cfg, facts, job="ppo"):
    """(precision record, the config it resolves to)."""
    p = resolve_precision(cfg, facts, job)
    return p, with_precision(cfg, p)


@pytest.mark.parametrize("facts, learner, quantize, why", [
    (BF16_CPU, "bf16", "int8", "bf16 units: AVX512-BF16"),  # a bf16 CPU: bf16 base + int8 engine
    (NO_BF16, "int8", "int8", "no bf16 units"),  # here: the base held as the int8 engine holds it, int8 GEMMs
    (OLD_CPU, "fp32", "none", "this CPU has no bf16 units"),  # no VNNI: int8 not faster, fp32 engine
    (CUDA, "bf16", "int8", "bf16 units: NVIDIA H100"),  # the onnxruntime engine still runs on the CPU
])
def test_lora_defaults_follow_the_hardware(facts, learner, quantize, why):
    p, cfg = resolved(ppo(**{"lora.r": 8}), facts)
    assert (p.learner, p.base_dtype, p.quantize) == (learner, learner, quantize)
    assert why in p.learner_why and not p.autocast and not p.warning
    run_precision = "fp32" if learner == "int8" else learner  # an int8 base: the adapter, activations, optimizer fp32
    assert (cfg.run.precision, cfg.lora.base_dtype, cfg.rollout.quantize) == (run_precision, learner, quantize)
    assert cfg.lora.bf16_base == (learner == "bf16") and cfg.lora.low_base == (learner != "fp32")
    assert not mixed_bf16(cfg)
    # TIS whenever the engine computes otherwise than the learner's forward (int8 engine, or a bf16 base)
    assert cfg.correction == ("tis" if quantize == "int8" or learner == "bf16" else "none")
    assert ("learner int8 base (the int8 engine's weights and arithmetic), fp32 adapter" in p.line("ppo")) == (
        learner == "int8")
    line = p.line("ppo", cfg.correction == "tis")
    assert line.startswith("refit ppo: precision: learner ") and (" TIS on" in line) == (cfg.correction == "tis")
    if quantize == "int8":
        assert "engine int8 weights (LoRA: frozen base, onnxruntime int8 matmuls on AVX512-VNNI)" in line
    else:
        assert "no int8 dot-product units" in line


@pytest.mark.parametrize("facts, learner", [(NO_BF16, "fp32"), (OLD_CPU, "fp32"), (BF16_CPU, "bf16"), (CUDA, "bf16"),
                                            (OLD_GPU, "fp32")])
def test_full_fine_tuning_defaults(facts, learner):
    """Full fine-tuning: bf16 autocast over fp32 masters where bf16 is native (CUDA as run.bf16 did; a bf16 CPU),
    else fp32; the engine fp32 either way; TIS on exactly when the learner is bf16; the reference in PyTorch then."""
    from refit.learner.ppo.models import ref_on_engine

    p, cfg = resolved(ppo(), facts)
    assert (p.learner, p.quantize, p.base_dtype) == (learner, "none", "fp32")
    assert p.autocast == mixed_bf16(cfg) == (learner == "bf16")
    assert "full fine-tuning" in p.engine_why
    assert cfg.correction == ("tis" if learner == "bf16" else "none")
    assert cfg.probe_on_rollout == (learner == "fp32")  # bf16 old log-probs: pushes checked on the probe batch
    assert ref_on_engine(cfg) == (learner == "fp32")  # bf16: the reference computed as the policy's old log-probs
    assert ("bf16 autocast, fp32 master weights" in p.line("ppo")) == (learner == "bf16")


def test_explicit_settings_win():
    # run.precision fp32: the behaviour before, also on bf16 hardware and for the engine's auto
    p, cfg = resolved(ppo(**{"lora.r": 8, "run.precision": "fp32"}), BF16_CPU)
    assert (p.learner, p.quantize, cfg.correction) == ("fp32", "none", "none")
    assert p.learner_why == "run.precision fp32" and p.engine_why == "run.precision fp32"
    # explicit lora.base_dtype / rollout.quantize win over auto, both ways
    p, _ = resolved(ppo(**{"lora.r": 8, "lora.base_dtype": "fp32", "rollout.quantize": "none"}), BF16_CPU)
    assert (p.learner, p.quantize, p.learner_why, p.engine_why) == ("fp32", "none", "lora.base_dtype fp32",
                                                                    "rollout.quantize none")
    p, _ = resolved(ppo(**{"lora.r": 8, "lora.base_dtype": "bf16", "rollout.quantize": "int8"}), OLD_CPU)
    assert (p.learner, p.quantize) == ("bf16", "int8")
    p, _ = resolved(ppo(**{"rollout.quantize": "int8"}), NO_BF16)  # full fine-tuning asked for int8: int8
    assert p.quantize == "int8" and p.learner == "fp32"
    # run.precision bf16 forced where it is emulated: bf16, with a warning; run.bf16 false (the older switch): fp32
    p, cfg = resolved(ppo(**{"run.precision": "bf16"}), NO_BF16)
    assert p.learner == "bf16" and p.autocast and "emulated" in p.warning and "forced" in p.learner_why
    assert resolved(ppo(**{"run.bf16": False}), CUDA)[0].learner == "fp32"
    # an explicit fp32 engine reference keeps auto's learner fp32 (else KL(0) > 0); forcing bf16 with it is refused
    p, cfg = resolved(ppo(ref_backend="onnxruntime"), BF16_CPU)
    assert p.learner == "fp32" and "ref_backend onnxruntime" in p.learner_why
    from refit.core.errors import RefitError

    with pytest.raises(RefitError, match="ref_backend onnxruntime with run.precision bf16"):
        ppo(ref_backend="onnxruntime", **{"run.precision": "bf16"})


def test_int8_base_rules():
    """auto holds the LoRA base in int8 only for one CPU learner process of refit ppo without bf16 units and with an
    int8 engine; explicit fp32 settings keep fp32; an explicit int8 base where it is not built is one line, as is an
    int8 base beside an fp32 engine or an engine reference (KL(0) would not be 0)."""
    from refit.core.errors import RefitError

    lora = {"lora.r": 8}
    assert resolve_precision(ppo(**lora), NO_BF16, processes=2).learner == "fp32"  # DDP: each rank would need it
    assert resolve_precision(ppo(**lora, **{"run.precision": "fp32"}), NO_BF16).learner == "fp32"
    assert resolve_precision(ppo(**lora, **{"rollout.quantize": "none"}), NO_BF16).learner == "fp32"
    assert resolve_precision(ppo(**lora, **{"lora.base_dtype": "fp32"}), NO_BF16).learner == "fp32"
    assert resolve_precision(ppo(**lora), OLD_CPU).learner == "fp32"  # no VNNI: no int8 engine, no int8 base
    assert resolve_precision(ppo(**lora, **{"run.bf16": False}), NO_BF16).learner == "fp32"
    p, cfg = resolved(ppo(**lora, **{"lora.base_dtype": "int8"}), BF16_CPU)  # explicit: wins over bf16 units
    assert (p.learner, p.quantize, cfg.lora.base_dtype, cfg.run.precision) == ("int8", "int8", "int8", "fp32")
    assert cfg.correction == "tis"
    with pytest.raises(RefitError, match="lora.base_dtype int8 is built for refit ppo with one CPU learner"):
        resolve_precision(ppo(**lora, **{"lora.base_dtype": "int8"}), CUDA)
    with pytest.raises(RefitError, match="lora.base_dtype int8 is built for refit ppo"):
        resolve_precision(DistillConfig.from_flat(**{"lora.r": 4, "lora.base_dtype": "int8"}), NO_BF16, "distill")
    with pytest.raises(RefitError, match="set rollout.quantize int8"):
        ppo(**lora, **{"lora.base_dtype": "int8", "rollout.quantize": "none"})
    with pytest.raises(RefitError, match="ref_backend onnxruntime with lora.base_dtype int8"):
        ppo(**lora, **{"lora.base_dtype": "int8"}, ref_backend="onnxruntime")


def test_engine_auto_per_backend_and_job():
    """TensorRT's int8 path (weight-only Q/DQ) is not chosen by auto; distill keeps fp32 engines (its student probe
    has no int8 side) and follows the learner rules alike."""
    p, _ = resolved(ppo(**{"lora.r": 8, "rollout.backend": "tensorrt"}), CUDA)
    assert p.quantize == "none" and "TensorRT" in p.engine_why and p.learner == "bf16"
    d = DistillConfig.from_flat(**{"lora.r": 4})
    p, cfg = resolved(d, BF16_CPU, "distill")
    assert (p.learner, p.quantize, cfg.lora.base_dtype) == ("bf16", "none", "bf16") and "distill" in p.engine_why
    p, cfg = resolved(DistillConfig(), BF16_CPU, "distill")
    assert p.autocast and mixed_bf16(cfg) and p.line("distill").endswith("would re-quantize the whole model)")


def test_unresolved_auto_reads_as_the_old_defaults():
    """A config used piecemeal (no job's setup): rollout.quantize auto is no int8 engine, the learner fp32."""
    cfg = ppo(**{"lora.r": 8})
    assert cfg.rollout.quantize == "auto" and cfg.lora.base_dtype == "auto"
    assert cfg.correction == "none" and not cfg.lora.bf16_base and not mixed_bf16(cfg)


def test_bf16_is_fast_reads_the_instructions():
    """oneDNN's own 'bf16 supported' is true on any AVX-512 CPU (it converts and multiplies in fp32); the choice reads
    the AVX512-BF16/AMX instructions themselves."""
    from refit.learner.run.lora import bf16_is_fast

    flags = set(open("/proc/cpuinfo").read().split()) if __import__("os").path.exists("/proc/cpuinfo") else set()
    if flags and __import__("platform").machine() == "x86_64":
        assert bf16_is_fast("cpu") == bool({"avx512_bf16", "amx_bf16"} & flags)


# ---------------------------------------------------------------------------------------------- real tiny runs

def _run_cfg(model_dirs, out, **kw) -> PPOConfig:
    base = {"model.model_dir": str(model_dirs["tiny-gpt2"]), "run.output_dir": str(out), "run.steps": 2,
            "run.batch_size": 4, "num_generations": 2, "advantage_estimator": "grpo", "response_length": 4,
            "ckpt.save_steps": 2, "rollout.probe_size": 4, "log.progress": False, "log.tensorboard": False,
            "log.plots": False, "data.max_operand": 9, "data.num_prompts": 16, "optim.learning_rate": 5e-3,
            "export_final": False, "num_ppo_epochs": 1, "num_mini_batches": 1,
            "reward": "refit.learner.builtin.tasks:length_reward"}
    return PPOConfig.from_flat(**{**base, **kw})


def _run(cfg):

    from refit.core.manifest import Manifest
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_dir = run_ppo(cfg, log=lines.append)
    return read_metrics(run_dir), [x for x in lines if "precision:" in x], Manifest.read(cfg.model.engine_dir or run_dir / "engine")


@pytest.mark.parametrize("precision", ["auto", pytest.param("bf16", marks=pytest.mark.slow)])  # each: an int8 export
def test_lora_at_defaults_runs_an_int8_engine_with_kl0_and_tis(precision, model_dirs, tmp_path):
    """``refit ppo`` with LoRA at its defaults on this CPU: the int8 engine where the CPU has VNNI (the base quantized
    once at export, the adapter fp32 on top), TIS on, KL at step 1 exactly 0 by every estimator, every push's probe
    passed. ``bf16``: what auto picks on a CPU with bf16 units (forced here): the base held in bf16 and the int8
    engine exported from the same rounded base."""
    from refit.learner.run.precision import hardware_facts

    facts = hardware_facts("cpu")
    rows, line, manifest = _run(_run_cfg(model_dirs, tmp_path / "lora", **{"lora.r": 4, "lora.alpha": 8.0,
                                                                            "run.precision": precision}))
    assert len(line) == 1 and line[0].startswith("refit ppo: precision: learner ")
    int8 = bool(facts.int8_isa)
    assert (manifest.quantization is not None) == int8 and ("engine int8 weights" in line[0]) == int8
    assert line[0].endswith("TIS on") == (int8 or precision == "bf16")
    if precision == "bf16":
        assert "learner bf16 base, fp32 adapter" in line[0] and manifest.options["round_weights"] == "bf16"
    int8_base = int8 and precision == "auto" and not facts.bf16_units
    assert ("learner int8 base" in line[0]) == int8_base
    if int8_base:  # the learner runs the engine's int8 arithmetic: the two log-probs agree to fp32 rounding
        assert all(r["mismatch/mean_abs_diff"] < 1e-4 for r in rows if "mismatch/mean_abs_diff" in r)
    for k in ("k1", "k2", "k3", "exact"):
        assert rows[0][f"kl/{k}"] == 0.0, (k, rows[0][f"kl/{k}"])
    assert rows[-1]["kl/exact"] > 0  # it trained
    assert ("mismatch/tis_grad_scale" in rows[0]) == (int8 or precision == "bf16")


@pytest.mark.parametrize("kl", ["loss", pytest.param("reward", marks=pytest.mark.slow)])
def test_forced_bf16_full_fine_tuning_keeps_kl0(kl, model_dirs, default_engine_dirs, tmp_path):
    """``--run.precision bf16`` on full fine-tuning (emulated here): bf16 autocast over fp32 masters; the reference
    and the old log-probs under the same autocast, so KL at step 1 is exactly 0; TIS on; the fp32 probe passes at the
    fp32 tolerance; the engine stays fp32. Both update paths: the one-pass (KL in the loss) and the two-pass (KL in
    the reward)."""
    kw = {"kl_penalty": "loss", "kl_estimator": "k3"} if kl == "loss" else {}
    rows, line, manifest = _run(_run_cfg(model_dirs, tmp_path / kl, **{"run.precision": "bf16"}, **kw,
                                         **{"model.engine_dir": str(default_engine_dirs["tiny-gpt2"])}))
    assert "learner bf16 autocast, fp32 master weights (run.precision bf16" in line[0] and "TIS on" in line[0]
    assert manifest.quantization is None
    for k in ("k1", "k3", "exact"):
        assert rows[0][f"kl/{k}"] == 0.0, (k, rows[0][f"kl/{k}"])
    assert rows[-1]["kl/exact"] > 0 and "mismatch/tis_grad_scale" in rows[0]
    assert rows[0]["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-6)  # old log-probs from the same bf16 arithmetic
    assert 0 < rows[0]["mismatch/max_abs_diff"] < 0.5  # the bf16 forward differs from the fp32 engine a little
    assert max(r.get("probe/max_abs_logprob_diff", 0.0) for r in rows) < 1e-3


def test_distill_forced_bf16_full_fine_tuning(model_dirs, engine_dirs, tmp_path):
    """``refit distill`` under ``run.precision bf16`` (full fine-tuning, emulated here): the student's forward under
    bf16 autocast, its fp32 masters trained, every push checked by the fp32 probe at the fp32 tolerance; the line
    says so, the engines stay fp32."""
    from conftest import tiny_distill_config

    from refit.learner.distill.cycle import run_distill
    from refit.learner.run.metrics import read_metrics

    out, lines = tmp_path / "d", []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_distill(tiny_distill_config(model_dirs, engine_dirs, out, lmbda=1.0, **{"run.precision": "bf16"}),
                    log=lines.append)
    line = [x for x in lines if "precision:" in x]
    assert line == ["refit distill: precision: learner bf16 autocast, fp32 master weights (run.precision bf16, "
                    "forced: this CPU has no bf16 units (AVX512-BF16/AMX): emulated, slower than fp32), engine fp32 "
                    "(full fine-tuning: every push would re-quantize the whole model)"]
    rows = [r for r in read_metrics(out) if r["step"] > 0]
    assert rows and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert max(r["probe/max_abs_logprob_diff"] for r in rows if "probe/max_abs_logprob_diff" in r) < 1e-4
