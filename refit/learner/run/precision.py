"""Which precision each side of a run computes in, chosen from the hardware, and why (``run.precision``,
``lora.base_dtype``, ``rollout.quantize``: their ``auto``).

The choice is a pure function, :func:`resolve_precision`, of the config and a record of hardware facts
(:class:`HardwareFacts`, read once by :func:`hardware_facts`; tests inject their own), so every branch is tested on
any machine. A job resolves its config once at setup (:func:`settle_precision`): the ``auto`` fields become concrete
values, the rest of the run reads only those, and one line says what was chosen and why, e.g.::

    refit ppo: precision: learner fp32 (this CPU has no bf16 units: AVX512-BF16/AMX), engine int8 weights (LoRA:
    frozen base, onnxruntime int8 matmuls on AVX512-VNNI), TIS on

An unresolved ``auto`` (a config used piecemeal, without a job's setup) reads as the old defaults: fp32 learner on a
CPU, ``rollout.quantize none``. The saved ``config.yaml`` keeps ``auto`` (what was asked); the line says what it was.

The rules (an explicit value always wins over ``auto``):

- learner, ``run.precision auto``: bf16 where the learner's device has bf16 units (a CPU with AVX512-BF16 or AMX
  through oneDNN, a CUDA GPU with native bf16), else fp32; ``run.bf16 false`` (the older switch) or an explicit
  ``ref_backend onnxruntime`` (an fp32 engine reference: KL(0) = 0 needs an fp32 learner) keep it fp32.
  ``fp32`` forces fp32 (and ``rollout.quantize auto`` none: the behaviour before these defaults); ``bf16`` forces
  bf16 also where it is emulated (slower than fp32; a warning), which is how tests exercise it on any CPU.
- bf16 on a LoRA run holds the frozen base in bf16 (``lora.base_dtype``, refit.learner.run.lora.hold_base; the engine
  exported from the same rounded base); on full fine-tuning it is bf16 autocast over fp32 master weights
  (:func:`mixed_bf16`): the update's forward, the old log-probs and the PyTorch reference all under the same autocast,
  so KL(0) is exactly 0 and the first ratio is 1; the probe runs the weights in fp32 against the fp32 engine, and TIS
  (mismatch_correction auto) takes up the engine/learner difference.
- int8 on a LoRA run (``lora.base_dtype auto``): where the learner stays fp32 for want of bf16 units, runs on the CPU
  in one process, and the engine resolves to int8 (below), the frozen base is held as the int8 engine holds it
  (refit.learner.run.lora.hold_int8: the same twins, bit for bit) and its matmuls run the engine's own int8
  arithmetic by int8 GEMMs (``torch._int_mm``), the input gradient straight through the activations' rounding, in
  int8 too; the adapter, the activations and the optimizer stay fp32. The learner's log-probs are then the engine's
  to fp32 rounding (TIS stays on for the activation codes a rounding step moves), the reference is the policy with
  its adapter off (KL(0) = 0), and the base takes a quarter of its fp32 memory. An explicit ``lora.base_dtype
  int8`` elsewhere (CUDA, distillation, several processes) is refused in one line.
- engine, ``rollout.quantize auto``: int8 for a LoRA run on the onnxruntime backend where the CPU has int8
  dot-product instructions (x86-64 AVX512-VNNI / AVX-VNNI / AMX-int8, arm64 dotprod / i8mm: ONNX Runtime's
  MatMulInteger runs on any x86-64/arm64, but only these make it faster than fp32), the base quantized once at
  export and the adapter fp32 on top, TIS on; else none. Full fine-tuning keeps fp32 engines (each push would
  re-quantize the whole model); TensorRT's int8 path is weight-only Q/DQ with fp32 matmuls and has not run on a GPU,
  so auto stays fp32 there; distillation's student probe has no int8 side, so auto stays fp32 there too.
"""

from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from refit.core.errors import RefitError

BF16_CPU = "AVX512-BF16/AMX"  # the x86 instructions oneDNN's bf16 matmuls use (names for the line)
INT8_FLAGS = {"amx_int8": "AMX-int8", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",  # x86-64 (/proc/cpuinfo)
              "i8mm": "i8mm", "asimddp": "dotprod"}  # arm64
BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


@dataclass(frozen=True)
class HardwareFacts:
    """What the choice reads of the machine (:func:`hardware_facts`; tests build their own)."""

    device: str = "cpu"  # the learner's device type: "cpu" | "cuda"
    bf16_units: bool = False  # the learner's device runs bf16 matmuls in hardware (:func:`bf16_is_fast`)
    bf16_isa: str = ""  # what gives it, for the line: "AMX-BF16", "AVX512-BF16", a GPU's name
    int8_isa: str = ""  # the CPU's int8 dot-product instructions ("AVX512-VNNI", "AMX-int8", "dotprod"); "": none
    int8_gemm: bool = True  # this torch multiplies int8 matrices on the CPU (torch._int_mm): the int8 LoRA base


@dataclass(frozen=True)
class Precision:
    """The resolved choice (:func:`resolve_precision`) and its reasons."""

    learner: str  # "fp32" | "bf16" (LoRA: the frozen base in bf16; full fine-tuning: bf16 autocast, fp32 masters)
    # | "int8" (LoRA only: the frozen base held as the int8 engine holds it, its matmuls in int8; the rest fp32)
    base_dtype: str  # lora.base_dtype resolved: "fp32" | "bf16" | "int8" (full fine-tuning: "fp32")
    quantize: str  # rollout.quantize resolved: "none" | "int8"
    learner_why: str
    engine_why: str
    lora: bool = False
    warning: str = ""  # bf16 forced where it is emulated

    @property
    def run_precision(self) -> str:
        """``run.precision`` resolved: the int8 base's adapter, activations and optimizer are fp32."""
        return "fp32" if self.learner == "int8" else self.learner

    @property
    def autocast(self) -> bool:
        """Full fine-tuning under bf16 autocast (fp32 master weights)."""
        return self.learner == "bf16" and not self.lora

    def line(self, job: str, tis: bool | None = None) -> str:
        """The one line a job logs at start; ``tis``: PPO's resolved correction is TIS (None: no such knob)."""
        if self.learner == "int8":
            what = "int8 base (the int8 engine's weights and arithmetic), fp32 adapter"
        elif self.learner == "bf16":
            what = "bf16 base, fp32 adapter" if self.lora else "bf16 autocast, fp32 master weights"
        else:
            what = "fp32"
        engine = "int8 weights" if self.quantize == "int8" else "fp32"
        tail = "" if tis is None else f", TIS {'on' if tis else 'off'}"
        return (f"refit {job}: precision: learner {what} ({self.learner_why}), engine {engine} ({self.engine_why})"
                f"{tail}")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo 'flags' on x86, 'Features' on arm64); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def bf16_is_fast(device="cpu") -> bool:
    """Whether ``device`` has bf16 matmul units (CUDA: Ampere and later; CPU: AVX512-BF16 or AMX, through oneDNN);
    elsewhere bf16 matmuls are emulated and slower than fp32's."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    # the CPU's own flags, as torch's cpuinfo reads them: oneDNN's `_is_mkldnn_bf16_supported` answers True on any
    # AVX-512 core, where it runs bf16 by conversion (measured on an Intel Xeon with AVX-512 but no AVX512-BF16:
    # a bf16 GEMM at 22 GFLOP/s against fp32's 90; scripts/learner_gflops.py)
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps:
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    try:  # a torch without cpuinfo's capabilities: oneDNN's check (a private op; without it: not known, no warning)
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def hardware_facts(device) -> HardwareFacts:
    """The facts of this machine for a learner on ``device`` (a torch device or its name)."""
    import torch

    dev = torch.device(device)
    flags = _cpu_flags()
    int8 = next((name for flag, name in INT8_FLAGS.items() if flag in flags), "")
    if not int8 and not flags and platform.machine().lower() in ("arm64", "aarch64"):
        int8 = "dotprod"  # Apple silicon (no /proc/cpuinfo): every M-series core has the dot-product instructions
    fast = bf16_is_fast(dev)
    if dev.type == "cuda":
        isa = torch.cuda.get_device_name(dev) if fast else ""
    else:
        isa = next((name for flag, name in BF16_FLAGS.items() if flag in flags), "oneDNN bf16") if fast else ""
    return HardwareFacts(device=dev.type, bf16_units=fast, bf16_isa=isa, int8_isa=int8,
                         int8_gemm=hasattr(torch, "_int_mm"))  # hold_int8 checks that it multiplies right


def _learner(cfg, facts: HardwareFacts) -> tuple[str, str, str]:
    """(learner precision "fp32" | "bf16", why, a warning or "") from ``run.precision`` and the facts."""
    asked = cfg.run.precision
    emulated = (f"this {facts.device.upper() if facts.device == 'cpu' else 'GPU'} has no bf16 units "
                f"({BF16_CPU if facts.device == 'cpu' else 'Ampere or later'}): emulated, slower than fp32")
    if asked == "fp32":
        return "fp32", "run.precision fp32", ""
    if asked == "bf16":
        if facts.bf16_units:
            return "bf16", f"run.precision bf16; {facts.bf16_isa}", ""
        return "bf16", f"run.precision bf16, forced: {emulated}", f"run.precision bf16: {emulated}"
    if not cfg.run.bf16:
        return "fp32", "run.bf16 false", ""
    if getattr(cfg, "ref_backend", "auto") == "onnxruntime":
        return "fp32", "ref_backend onnxruntime: the fp32 engine reference needs an fp32 learner for KL(0) = 0", ""
    if facts.bf16_units:
        return "bf16", f"bf16 units: {facts.bf16_isa}", ""
    if facts.device == "cuda":
        return "fp32", "this GPU has no native bf16 (Ampere or later)", ""
    return "fp32", f"this CPU has no bf16 units: {BF16_CPU}", ""


def _engine(cfg, facts: HardwareFacts, job: str) -> tuple[str, str]:
    """(rollout.quantize "none" | "int8", why) from ``rollout.quantize`` and the facts."""
    asked, backend = cfg.rollout.quantize, cfg.rollout.backend
    if asked != "auto":
        return asked, f"rollout.quantize {asked}"
    if cfg.run.precision == "fp32":
        return "none", "run.precision fp32"
    if not cfg.lora.enabled:
        return "none", "full fine-tuning: every push would re-quantize the whole model"
    if job != "ppo":
        return "none", f"LoRA, but {job}'s student probe has no int8 side"
    if backend == "tensorrt":
        return "none", "LoRA, but TensorRT's int8 path is weight-only Q/DQ with fp32 matmuls and has not run on a GPU"
    if backend != "onnxruntime":
        return "none", f"the {backend} backend has no int8 engine"
    if not facts.int8_isa:
        return "none", "LoRA, but this CPU has no int8 dot-product units (VNNI, AMX-int8, arm64 dotprod)"
    return "int8", f"LoRA: frozen base, onnxruntime int8 matmuls on {facts.int8_isa}"


def _int8_base(cfg, facts: HardwareFacts, job: str, quantize: str, processes: int) -> str:
    """Why an ``auto`` LoRA base is held in int8 on this run ("": it is not): a CPU learner without bf16 units, one
    process, PPO's int8 engine (the learner then runs the engine's own int8 arithmetic by int8 GEMMs)."""
    if (cfg.run.precision != "auto" or not cfg.run.bf16 or getattr(cfg, "ref_backend", "auto") == "onnxruntime"
            or facts.device != "cpu" or facts.bf16_units or quantize != "int8" or job != "ppo" or processes > 1
            or not facts.int8_gemm):
        return ""
    return f"no bf16 units ({BF16_CPU}): the base as the int8 engine holds it, int8 GEMMs on {facts.int8_isa}"


def resolve_precision(cfg, facts: HardwareFacts, job: str = "ppo", processes: int = 1) -> Precision:
    """The precision of ``cfg``'s learner and engine on hardware ``facts`` (``job``: "ppo" | "distill";
    ``processes``: the run's learner processes); explicit settings win over ``auto`` (the module docstring has the
    rules)."""
    learner, why, warning = _learner(cfg, facts)
    lora = cfg.lora.enabled
    base = cfg.lora.base_dtype
    if lora and base != "auto":  # an explicit base precision is the LoRA learner's precision
        learner, why, warning = base, f"lora.base_dtype {base}", warning if base == "bf16" else ""
    quantize, engine_why = _engine(cfg, facts, job)
    if lora and base == "auto" and learner == "fp32":
        int8_why = _int8_base(cfg, facts, job, quantize, processes)
        learner, why = ("int8", int8_why) if int8_why else (learner, why)
    if learner == "int8" and (job != "ppo" or facts.device != "cpu" or processes > 1):
        raise RefitError("lora.base_dtype int8 is built for refit ppo with one CPU learner process (torch._int_mm's "
                         f"CPU route, the engine's manifest read there); this is {job} on {facts.device} with "
                         f"{processes} process(es): use lora.base_dtype fp32 or bf16")
    return Precision(learner=learner, base_dtype=learner if lora else "fp32", quantize=quantize, learner_why=why,
                     engine_why=engine_why, lora=lora, warning=warning)


def with_precision(cfg, p: Precision):
    """``cfg`` with the ``auto`` fields made ``p``'s values: ``run.precision``, ``lora.base_dtype``,
    ``rollout.quantize``; under bf16 autocast a PPO run's pushes are checked on the probe batch (the rollout's fp32
    engine log-probs and the learner's bf16 old log-probs differ by rounding: ``probe_on_rollout`` false)."""
    out = replace(cfg, run=replace(cfg.run, precision=p.run_precision), lora=replace(cfg.lora, base_dtype=p.base_dtype),
                  rollout=replace(cfg.rollout, quantize=p.quantize))
    if p.autocast and getattr(out, "probe_on_rollout", False):
        out = replace(out, probe_on_rollout=False)
    return out


def mixed_bf16(cfg) -> bool:
    """Whether ``cfg``'s learner runs full fine-tuning under bf16 autocast over fp32 master weights (``run.precision``
    bf16, resolved or forced, without LoRA): the update's forward, the old log-probs and the PyTorch reference."""
    return cfg.run.precision == "bf16" and not cfg.lora.enabled


def autocast(cfg, device):
    """The bf16 autocast context of ``cfg``'s learner forwards on ``device`` (disabled unless :func:`mixed_bf16`)."""
    import torch

    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mixed_bf16(cfg))


def settle_precision(cfg, device, log=print, job: str = "ppo", facts: HardwareFacts | None = None,
                     processes: int = 1):
    """``cfg`` resolved on this machine (:func:`resolve_precision`, :func:`with_precision`), its line logged (and a
    warning when bf16 is forced where it is emulated); what a job's setup calls once."""
    p = resolve_precision(cfg, facts or hardware_facts(device), job, processes)
    if p.warning:
        warnings.warn(p.warning, stacklevel=2)
    out = with_precision(cfg, p)
    log(p.line(job, getattr(out, "correction", None) == "tis" if job == "ppo" else None))
    return out


__all__ = ["HardwareFacts", "Precision", "autocast", "bf16_is_fast", "hardware_facts", "mixed_bf16", "resolve_precision",
           "settle_precision", "with_precision"]
