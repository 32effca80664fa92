"""The learner's fp32 CPU linear layers through oneDNN (refit/learner/run/matmul.py, ``run.cpu_matmul``).

Against independent references: each layer's output and gradients (input, weight, bias) against the same product
in float64; whole models at published widths (Qwen2.5-0.5B: GQA, tied 151936-row head; GPT-2 small: Conv1D), with a
LoRA adapter and in full fine-tuning, against the same model on torch's own BLAS (log-probs and every trained
gradient). Plus: what is switched and what is not, the fallbacks (bf16, tracing for export), and the settings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from refit.core.errors import RefitError
from refit.learner.builtin.published import published_config
from refit.learner.run.matmul import DnnConv1D, DnnLinear, onednn_available, resolve, restore, use_cpu_matmul

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear op")


def _errors(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("trained", [True, False])
def test_layer_matches_float64(kind, trained):
    """Qwen2.5-0.5B's MLP widths (896 -> 4864), bias on: the switched layer's output and its gradients for the input,
    weight and bias are as close to the float64 product as torch's BLAS route is (both ~1e-7 relative)."""
    torch.manual_seed(0)
    k, n = 896, 4864
    layer = torch.nn.Linear(k, n) if kind == "linear" else Conv1D(n, k)
    with torch.no_grad():
        layer.bias.normal_()
    layer.requires_grad_(trained)
    x = torch.randn(3, 50, k, requires_grad=True)
    g = torch.randn(3, 50, n)
    w64 = (layer.weight if kind == "linear" else layer.weight.t()).detach().double()
    x64 = x.detach().double()
    y64 = x64 @ w64.t() + layer.bias.detach().double()
    gx64, gw64, gb64 = g.double() @ w64, g.double().reshape(-1, n).t() @ x64.reshape(-1, k), g.double().sum((0, 1))

    def run():
        x.grad = None
        layer.zero_grad()
        y = layer(x)
        y.backward(g)
        gw = layer.weight.grad if kind == "linear" or not trained else layer.weight.grad.t()
        return y.detach(), x.grad.clone(), (gw.clone() if trained else None), (layer.bias.grad.clone() if trained
                                                                                else None)

    blas = run()
    assert use_cpu_matmul(layer) == 1 and type(layer) is (DnnLinear if kind == "linear" else DnnConv1D)
    dnn = run()
    for got, want, ref in zip(dnn, blas, (y64, gx64, gw64, gb64)):
        if ref is None or (got is None and want is None):
            continue
        assert _errors(got, ref) < 1e-6 and _errors(want, ref) < 1e-6
    assert dnn[0].dtype == torch.float32 and not torch.equal(dnn[0], torch.zeros_like(dnn[0]))


def _logprobs(model, ids):
    out = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(out, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _step(model, ids):
    """Log-probs, and the gradient of their sum for every trained parameter."""
    model.zero_grad(set_to_none=True)
    lp = _logprobs(model, ids)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name, lora", [("Qwen2.5 0.5B", True), ("GPT-2 small", True), ("GPT-2 small", False)],
                         ids=["qwen2.5-0.5b-lora", "gpt2-lora", "gpt2-full"])
def test_model_equals_blas(name, lora, one_torch_thread):
    """A published geometry cut to one layer, with a non-zero LoRA adapter (the base frozen) or fully trained (GPT-2:
    its tied head and embedding trained through both routes): the
    switched model's log-probs within 2e-5 of the BLAS model's and every trained gradient within 1e-4 of its size;
    ``restore`` gives back the BLAS model bit for bit."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(published_config(name, n_layers=1), attn_implementation="eager").eval()
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 init_lora_weights=False))
    names = [n for n, _ in model.state_dict().items()]
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    lp_blas, g_blas = _step(model, ids)
    switched = use_cpu_matmul(model)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    assert switched == len(linears) > 0 and all(type(m) in (DnnLinear, DnnConv1D) for m in linears)
    assert list(model.state_dict()) == names
    lp_dnn, g_dnn = _step(model, ids)
    assert (lp_dnn - lp_blas).abs().max() < 2e-5
    assert g_dnn.keys() == g_blas.keys() and len(g_dnn) > 0
    for n in g_blas:
        assert (g_dnn[n] - g_blas[n]).abs().max() <= 1e-4 * g_blas[n].abs().max() + 1e-7, n
    assert restore(model) == switched
    assert torch.equal(_step(model, ids)[0], lp_blas)


def test_other_dtypes_and_tracing_take_the_layers_own_forward():
    """A bf16 layer (a bf16 LoRA base) and a 1-D input compute as nn.Linear does, bit for bit; an ONNX export of a switched layer
    traces plain MatMul/Gemm, not oneDNN's op."""
    import io

    import onnx

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    want = F.linear(x, layer.weight, layer.bias)
    use_cpu_matmul(layer)
    assert torch.equal(layer(x), want)
    one = torch.nn.Linear(64, 32)
    v = torch.randn(64)
    want1 = one(v)
    use_cpu_matmul(one)
    assert torch.equal(one(v), want1)  # a 1-D input (F.linear takes it; oneDNN's op wants rows)
    fp32 = torch.nn.Linear(64, 32)
    use_cpu_matmul(fp32)
    buf = io.BytesIO()
    torch.onnx.export(fp32, (torch.randn(4, 64),), buf, dynamo=False)
    ops = {n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node}
    assert ops & {"Gemm", "MatMul"} and not any("mkldnn" in o.lower() for o in ops)


def test_settings():
    assert resolve("auto", "cuda") == "blas" and resolve("onednn", "cuda") == "blas"
    assert resolve("blas", "cpu") == "blas" and resolve("onednn", "cpu") == "onednn"
    layer = torch.nn.Linear(8, 8)
    assert use_cpu_matmul(layer, "blas") == 0 and type(layer) is torch.nn.Linear
    with pytest.raises(RefitError, match="run.cpu_matmul 'mkl'"):
        resolve("mkl", "cpu")


def test_switched_layers_are_still_found_by_the_int8_reference():
    """The int8 reference (refit.core.int8) finds the layers it quantizes by kind: a switched GPT-2 Conv1D and Linear
    are still a (K, N) weight to it."""
    from refit.core.int8 import module_kn

    conv, lin = Conv1D(24, 16), torch.nn.Linear(16, 24)
    use_cpu_matmul(conv), use_cpu_matmul(lin)
    assert type(conv) is DnnConv1D and torch.equal(module_kn(conv), conv.weight)
    assert type(lin) is DnnLinear and torch.equal(module_kn(lin), lin.weight.t())


def test_bf16_is_fast_reads_the_cpus_bf16_flags():
    """bf16 counts as fast on a CPU only with AVX512-BF16 or AMX-BF16 (the kernel's /proc/cpuinfo flags, read here
    independently); oneDNN's own check says yes on any AVX-512 core, where bf16 runs by conversion, 4x slower."""
    from pathlib import Path

    from refit.learner.run.lora import bf16_is_fast

    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.read_text().splitlines() if ln.startswith("flags")),
                     []))
    assert bf16_is_fast("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})
