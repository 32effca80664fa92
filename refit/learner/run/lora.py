"""LoRA on the learner, through PEFT: the policy is a ``PeftModel`` over a frozen base; what a push carries.

``apply_lora`` wraps the loaded base with PEFT's LoRA (``lora`` section: r, alpha, dropout, target_modules, init)
and freezes the base: no gradient, no optimizer state for it. ``adapter_tensors`` is what reaches the engine on a
push: per target layer PEFT's ``lora_A`` (r, K) and ``scaling * lora_B`` (N, r) under the names the engine's
manifest gives (refit.core.manifest_sections ``lora_push_names``), a few MB where the base is GB. The reference on a
LoRA run is the same model with the adapter off (:class:`AdapterOff` in PyTorch; ``OrtEngine.adapter_off`` on the
engine), so the base is held once on each side.

``lora.base_dtype bf16`` holds the frozen base in bf16 on the learner (:func:`hold_base`): half its memory, its
matmuls in bf16; the adapter stays fp32. The engine is exported from the same bf16-rounded base
(``ExportOptions.round_weights``) and computes in fp32, so the probe compares it with the learner's weights computed
in fp32 (:func:`fp32_compute`, exact), while the training forward's bf16 arithmetic differs from the engine's by
rounding, which the importance-sampling correction (TIS) takes up; the reference is the policy with its adapter off
in PyTorch, computing as the policy does, so KL(0) stays 0.

``lora.base_dtype int8`` (:func:`hold_int8`) holds the base as the int8 engine holds it: each layer the engine's
manifest quantizes becomes a :class:`refit.core.int8.Int8Linear` over the same twin, its fp32 weight released, and
the forward runs the engine's int8 arithmetic by int8 GEMMs (the input gradient too, straight through the rounding),
so the learner's log-probs are the engine's to fp32 rounding; the reference is the policy with its adapter off, as
for bf16. The final model (:func:`merged_state`) is the base dequantized (the numbers the run multiplied by) with the
adapter merged.

Refused in one line: target modules that match nothing (PEFT's own message), a rank larger than a targeted layer's
smaller side (the update would be full rank and cost more than the layer), an ``init`` that does not leave the
policy equal to the base at step 0 (KL(0) = 0 is the contract; PiSSA/OLoRA also rewrite the base, which the
engine holds as exported).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from refit.core.errors import RefitError
from refit.core.int8 import Int8Linear, dequantize, fast_int8, module_kn, quantized_owners, set_module
from refit.core.manifest_sections import lora_push_names
from refit.core.contract import DTYPES, peft_lora_model
from refit.learner.run.config import LoraSection
from refit.learner.run.precision import bf16_is_fast


def apply_lora(model: torch.nn.Module, lora: LoraSection, seed: int = 0):
    """``model`` (the base, loaded) wrapped as a PEFT ``PeftModel`` with a fresh adapter, the base frozen. The
    adapter's random init (PEFT's ``lora_A``) is drawn from ``seed`` alone, not from the process's random state,
    so a run and its resumed or repeated twin start from the same adapter."""
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = peft_lora_model(model, lora.target_modules, lora.r, lora.alpha, lora.dropout, lora.init)
    layers = {n: m for n, m in peft_model.base_model.model.named_modules() if isinstance(m, LoraLayer)}
    too_wide = [(n, m.in_features, m.out_features) for n, m in layers.items()
                if lora.r > min(m.in_features, m.out_features)]
    if too_wide:
        n, k, o = too_wide[0]
        raise RefitError(f"lora: r = {lora.r} is larger than layer {n} ({k} -> {o}); a rank above "
                         f"min(in, out) = {min(k, o)} is no longer low-rank (lower lora.r or the target_modules)")
    base = lora.base_dtype
    if base == "auto":  # a direct caller (the API, a test); a job's setup resolves it first (refit.learner.run.precision)
        base = "bf16" if bf16_is_fast(next(model.parameters()).device) else "fp32"
    if base in ("bf16", "fp16"):  # int8: the caller holds it once the engine's manifest is known (hold_int8)
        hold_base(peft_model, DTYPES[base])
    return peft_model


LOW_PRECISION = (torch.bfloat16, torch.float16)


@torch.no_grad()
def hold_base(model, dtype: torch.dtype) -> None:
    """The frozen base of LoRA ``model`` held in ``dtype`` (bf16): its parameters cast in place, the adapter left in
    fp32, buffers (rotary frequencies) as they are. The training forward then runs the base's matmuls in ``dtype``
    (PEFT casts the adapter's input to fp32 and its output back); :func:`fp32_compute` runs the same weights in fp32
    (the probe against the engine, which holds the same rounded base: ExportOptions.round_weights)."""
    device = next(model.parameters()).device
    if not bf16_is_fast(device):
        warnings.warn(f"lora.base_dtype {dtype}: this {device.type} has no bf16 matmul units (AVX512-BF16/AMX, "
                      "Ampere+): its bf16 matmuls are emulated, slower than fp32; the base's memory is still halved",
                      stacklevel=3)
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


@torch.no_grad()
def hold_int8(model, manifest) -> int:
    """The frozen base of LoRA ``model`` held as its int8 engine holds it (``lora.base_dtype int8``): every linear layer
    whose weight the engine quantizes (``manifest``'s ``quantization``; refit.core.int8.quantized_owners, the set the
    export gate's reference replaces) replaced in place by :class:`refit.core.int8.Int8Linear` over the same int8 twin (the same
    ``quantize_weight``), its fp32 weight released (a tied output head's stays: the embedding reads it). The forward
    and the input gradient then run the engine's arithmetic by int8 GEMMs (:class:`refit.core.int8.Int8MatmulFn`); the
    adapter stays fp32 beside it. Returns how many layers were replaced; one line when the engine is not int8 or a
    layer it quantizes trains."""
    quant = manifest.quantization
    if not fast_int8():
        raise RefitError("lora.base_dtype int8: this torch has no CPU int8 GEMM (torch._int_mm); use lora.base_dtype "
                         "fp32")
    if quant is None or quant.scheme != "int8":
        raise RefitError("lora.base_dtype int8 holds the base as the int8 engine does: the engine must be exported "
                         "with --quantize int8 (rollout.quantize int8, or auto on a CPU with int8 units)")
    base = getattr(model, "module", model).get_base_model()
    embed = base.get_input_embeddings()
    owners = quantized_owners(base, manifest)
    for owner in owners:
        m = base.get_submodule(owner)
        if any(p.requires_grad for p in m.parameters()):
            raise RefitError(f"lora.base_dtype int8: {owner} trains (modules_to_save or full fine-tuning); only a "
                             "frozen layer can be held in int8")
        new = Int8Linear(module_kn(m), None if m.bias is None else m.bias.detach().clone())
        new.conv1d = not isinstance(m, torch.nn.Linear)  # GPT-2's Conv1D holds (in, out): saved and merged so
        new.keep_weight = False  # a read of .weight (HF code, the final merge) keeps no fp32 copy of the layer
        # a head tied to the embeddings: the engine's head multiplies by the twin, its Gather reads the fp32 matrix
        new.tied_embedding = embed is not None and getattr(m, "weight", None) is embed.weight
        set_module(base, owner, new)
    # what stays of the checkpoint's tensors (the embedding, norms) gets memory of its own: loaded by safetensors they
    # are views of one file mapping, which the released fp32 weights would otherwise keep resident with them
    for p in [*base.parameters(), *base.buffers()]:
        if not p.requires_grad:
            p.data = p.data.clone()
    return len(owners)


def source_weight(module) -> torch.Tensor:
    """A base layer's weight in its own module's layout (Linear (out, in), Conv1D (in, out)); an int8 one's
    (:func:`hold_int8`) dequantized, ``q * scale``: the numbers the run multiplied by."""
    if isinstance(module, Int8Linear):
        return dequantize(*module.twins()) if getattr(module, "conv1d", False) else module.weight
    return module.weight


def holds_int8(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a LoRA policy) holds int8 layers (:func:`hold_int8`)."""
    return any(isinstance(m, Int8Linear) for m in getattr(model, "module", model).modules())


def holds_low_precision(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a LoRA policy, or a reference sharing its parameters) holds bf16/fp16 weights."""
    return any(p.dtype in LOW_PRECISION for p in model.parameters())


@contextmanager
def fp32_compute(model: torch.nn.Module):
    """Inside the block ``model`` computes in fp32 over its bf16/fp16 parameters: each module that owns such
    parameters gets fp32 copies of them for its own forward only (a forward pre-hook swaps them in, a forward hook
    swaps them back), so one module's weights are upcast at a time, never a second copy of the model. For no-grad
    forwards (the probe): the copies are not the parameters the optimizer holds."""
    owners = [m for m in model.modules()
              if any(p is not None and p.dtype in LOW_PRECISION for p in m._parameters.values())]

    def swap_in(mod, _args):
        held = {k: p for k, p in mod._parameters.items() if p is not None and p.dtype in LOW_PRECISION}
        for k, p in held.items():
            mod._parameters[k] = torch.nn.Parameter(p.detach().float(), requires_grad=False)
        mod.__dict__["_refit_low"] = held

    def swap_back(mod, _args, _out):
        mod._parameters.update(mod.__dict__.pop("_refit_low", {}))

    handles = [h for m in owners for h in (m.register_forward_pre_hook(swap_in), m.register_forward_hook(swap_back))]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in owners:  # a forward that raised midway: its module's own parameters back
            m._parameters.update(m.__dict__.pop("_refit_low", {}))


def is_lora(model) -> bool:
    """True for a PEFT model (a LoRA policy), also inside a DDP wrapper."""
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """What a push carries for a LoRA ``model``: ``{<module>.lora_A: (r, K), <module>.lora_B: scaling * (N, r)}``
    for every adapted layer, in fp32 (the scaled B is a fresh tensor; A is the parameter itself)."""
    from peft.tuners.lora import LoraLayer

    model = getattr(model, "module", model)
    out = {}
    for name, m in model.base_model.model.named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            a_name, b_name = lora_push_names(name)
            out[a_name] = m.lora_A["default"].weight.detach()
            out[b_name] = (m.lora_B["default"].weight.detach().float() * m.scaling["default"])
    return out


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The adapter's parameters by PEFT's state-dict names (what a checkpoint holds of a LoRA policy)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(getattr(model, "module", model))


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    """Put :func:`trainable_state`'s tensors back into ``model``; one line when they do not fit it."""
    from peft import set_peft_model_state_dict

    res = set_peft_model_state_dict(getattr(model, "module", model), state)
    missing = [k for k in getattr(res, "missing_keys", []) if "lora_" in k]
    if missing:
        raise RefitError(f"checkpoint's adapter lacks {len(missing)} of this run's LoRA tensors, e.g. {missing[:2]} "
                         "(was it written with other lora settings?)")


@contextmanager
def adapter_dropout(model):
    """LoRA dropout on (PEFT's ``lora_dropout`` modules in train mode) inside the block: the update's forward. The
    policy stays in eval mode everywhere else, so scoring, the probe and the engine see no dropout."""
    from peft.tuners.lora import LoraLayer

    drops = [d for m in getattr(model, "module", model).modules() if isinstance(m, LoraLayer)
             for d in m.lora_dropout.values()] if is_lora(model) else []
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


@torch.no_grad()
def merged_state(model) -> dict[str, torch.Tensor]:
    """The base's state dict, by its own HF names, with every adapter merged in (``W + scaling * B A``, PEFT's
    ``get_delta_weight``): what ``merge_and_unload`` would save, computed beside the model (which is left as it
    is: still a PEFT model, its base untouched). Fresh tensors for the merged layers only."""
    merged = merged_tensors(model)
    out = {}
    base = getattr(model, "module", model).get_base_model()
    head = base.get_output_embeddings()
    tied = head is not None and getattr(base.config.get_text_config(), "tie_word_embeddings", False)
    int8 = {n: m for n, m in base.named_modules() if isinstance(m, Int8Linear)}
    for name, m in int8.items():  # an int8 base (lora.base_dtype int8): its weights dequantized, as the run multiplied
        clean = name.replace(".base_layer", "")  # by them; a tied head stays the embedding's (saved tied, one matrix)
        if not (tied and m is head):
            out[f"{clean}.weight"] = merged.get(f"{clean}.weight", source_weight(m).contiguous())
        if m.bias is not None:
            out[f"{clean}.bias"] = m.bias
    for key, t in base.state_dict().items():
        if ".lora_" in key or key.rpartition(".")[0] in int8:
            continue
        clean = key.replace(".base_layer.", ".")
        t = merged.get(clean, t)
        out[clean] = t.float() if t.dtype in LOW_PRECISION else t  # a bf16 base: saved as the fp32 model it ran as
    return out


def save_adapter(model, folder) -> None:
    """The adapter as a PEFT folder (``PeftModel.from_pretrained`` loads it over the base): its own tensors only. An
    adapter on the output head (``all-linear lm_head``) would make PEFT write the frozen embedding matrices too
    (``save_embedding_layers``: vocab x hidden, 545 MB at Qwen2.5-0.5B) although the base folder holds them."""
    getattr(model, "module", model).save_pretrained(str(folder), save_embedding_layers=False)


def adapts_tied_head(model) -> bool:
    """True when an adapter sits on an output head tied to the input embeddings (``all-linear lm_head`` on GPT-2,
    Qwen2.5-0.5B, Llama 3.2): merged, the head is no longer the embedding, so the merged model must be saved untied
    (its config's ``tie_word_embeddings`` off, both matrices written); saved tied, its config would claim one matrix
    over two, and a loader that honours the flag re-ties the head and loses the adapter's part of it."""
    from peft.tuners.lora import LoraLayer

    base = getattr(model, "module", model).get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if not isinstance(head, LoraLayer) or embed is None:
        return False
    held = head.get_base_layer()  # an int8 base (hold_int8) remembers the tie its fp32 weight had
    return getattr(held, "tied_embedding", False) or held.weight is embed.weight


@contextmanager
def untied(config):
    """``config`` (and its text config) with ``tie_word_embeddings`` off inside the block, restored after."""
    configs = {id(c): c for c in (config, config.get_text_config())}.values()
    old = [(c, getattr(c, "tie_word_embeddings", None)) for c in configs]
    try:
        for c, _ in old:
            c.tie_word_embeddings = False
        yield
    finally:
        for c, v in old:
            c.tie_word_embeddings = v


@torch.no_grad()
def merged_tensors(model) -> dict[str, torch.Tensor]:
    """``{<module>.weight: W + scaling * B A}`` of every adapted layer by its HF name: what an engine that takes no
    adapter inputs (TensorRT: a refit of the targeted layers, refit/rollout/tensorrt/engine.py) is pushed on a LoRA run.
    Fresh tensors, the size of the targeted layers; the base is left as it is."""
    from peft.tuners.lora import LoraLayer

    model = getattr(model, "module", model)
    out = {}
    for name, m in model.get_base_model().named_modules():
        if isinstance(m, LoraLayer) and "default" in m.lora_A:
            w = source_weight(m.get_base_layer())
            if w.dtype in LOW_PRECISION:  # a bf16 base (lora.base_dtype): merged in fp32, the adapter's update kept
                out[f"{name}.weight"] = w.float() + m.get_delta_weight("default").float()
            else:
                out[f"{name}.weight"] = (w + m.get_delta_weight("default").to(w.dtype)).contiguous()
    return out


class AdapterOff(torch.nn.Module):
    """The base of a LoRA ``model`` as a model of its own: calls run ``model`` with its adapter disabled (PEFT's
    ``disable_adapter``). PPO's PyTorch reference on a LoRA run: the base held once, no copy."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "peft_model", getattr(model, "module", model))  # not a submodule: no params of its own

    @property
    def config(self):
        return self.peft_model.config

    def parameters(self, recurse: bool = True):
        return self.peft_model.parameters(recurse)

    def get_base_model(self):
        return self.peft_model.get_base_model()

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)
