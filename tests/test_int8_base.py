"""The LoRA base held in int8 on the learner (``lora.base_dtype int8``, refit.learner.run.lora.hold_int8): the int8
GEMM route against the engine's arithmetic in PyTorch (refit.core.int8.int8_linear, exact integer products) and a
hand computation, the held twins against the engine's own initializers, the held model against the quantized
reference, its input gradient against the straight-through fp32 one, and the final model it saves."""

from __future__ import annotations

import pytest
import torch

from refit.core.int8 import Int8Linear, Int8MatmulFn, dequantize, fast_int8, int8_linear, matmul_modules, quantize_weight
from refit.core.manifest import Manifest

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not fast_int8(), reason="this torch has no CPU torch._int_mm")]

QWEN_05B = {"hidden": 896, "ffn": 4864, "kv": 128}  # Qwen2.5-0.5B's published widths (2 KV heads of 64)


@pytest.fixture(scope="module")
def int8_dirs(tmp_path_factory, model_dirs):
    from conftest import BuiltOnce
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    root = tmp_path_factory.mktemp("int8base")
    opts = ExportOptions(max_batch=16, max_len=128, quantize="int8")
    return BuiltOnce(lambda g: build(model_dirs[g], root / g, opts=opts, log=lambda *_: None))


@pytest.mark.parametrize("k, n, lead", [(QWEN_05B["hidden"], QWEN_05B["ffn"], (3, 17)),  # gate/up
                                        (QWEN_05B["ffn"], QWEN_05B["hidden"], (2, 9)),  # down: K past a 1024 chunk
                                        (QWEN_05B["hidden"], QWEN_05B["kv"], (1,)),  # k/v, one row
                                        (7, 3, (4, 5))])
def test_int8_gemm_route_is_the_engine_arithmetic(k, n, lead):
    """``Int8MatmulFn`` (torch._int_mm) gives the very numbers of ``int8_linear`` (the engine's arithmetic with exact
    integer products in float64 chunks), bias or none, any leading shape; no rows give no rows."""
    g = torch.Generator().manual_seed(k + n)
    q, s = quantize_weight(torch.randn(k, n, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    x = torch.randn(*lead, k, generator=g) * 3
    x[..., 0] = 40.0  # an outlier column, as real activations have: the other codes of its rows get small
    for b in (bias, None):
        assert torch.equal(Int8MatmulFn.apply(x, q, s, b), int8_linear(x, q, s, b))
    assert Int8MatmulFn.apply(torch.zeros(0, k), q, s, bias).shape == (0, n)


def test_int8_input_gradient_by_hand():
    """Where ``g * scale`` is already int8 codes (each row's max |.| is 127), the int8 input gradient is exact:
    ``g @ (q * scale)^T`` by hand in int64. On random values: the straight-through fp32 gradient within int8's
    rounding (a relative error of about 1%)."""
    g = torch.Generator().manual_seed(0)
    k, n = 5, 4
    q = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
    q[0] = 127  # every column's max |w| is 127: scale 1
    s = torch.ones(n)
    grad = torch.randint(-127, 128, (3, n), generator=g).float()
    grad[:, 1] = 127.0
    x = torch.randn(3, k, requires_grad=True)
    Int8MatmulFn.apply(x, q, s, None).backward(grad)
    want = [[sum(int(grad[m, j]) * int(q[i, j]) for j in range(n)) for i in range(k)] for m in range(3)]
    assert x.grad.tolist() == [[float(v) for v in row] for row in want]

    k, n = QWEN_05B["hidden"], QWEN_05B["ffn"]
    q, s = quantize_weight(torch.randn(k, n, generator=g) * 0.05)
    x = torch.randn(2, 6, k, generator=g).requires_grad_()
    up = torch.randn(2, 6, n, generator=g)
    Int8MatmulFn.apply(x, q, s, None).backward(up)
    ref = up @ dequantize(q, s).t()
    assert float((x.grad - ref).norm() / ref.norm()) < 0.02
    assert float(torch.nn.functional.cosine_similarity(x.grad.flatten(), ref.flatten(), 0)) > 0.999


def _lora(model_dir, r=4, target=("all-linear",)):
    from refit.core.hf_folder import load_model
    from refit.learner.run.config import LoraSection
    from refit.learner.run.lora import apply_lora

    return apply_lora(load_model(model_dir), LoraSection(r=r, alpha=2.0 * r, target_modules=target,
                                                         base_dtype="fp32"), seed=0)


def _engine_twins(engine_dir, manifest):
    """{fp32 engine weight: (int8 (K, N), scale (N,))} read from the engine's own ONNX initializers."""
    import onnx
    from onnx import numpy_helper

    out = {}
    for graph, twins in manifest.quantization.weights.items():
        proto = onnx.load(str(engine_dir / f"{graph}.onnx"))
        inits = {t.name: t for t in proto.graph.initializer}
        for w, tw in twins.items():
            out[w] = tuple(torch.from_numpy(numpy_helper.to_array(inits[n]).copy()) for n in (tw.weight, tw.scale))
    return out


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-qwen2"])  # Conv1D + a tied head; Linear with q/k/v biases
def test_held_base_is_the_engine_twins_and_computes_as_the_reference(arch, model_dirs, int8_dirs):
    """Every layer the engine quantizes is held as an Int8Linear whose twin is the engine's initializer, bit for bit;
    no fp32 weight of theirs stays (a tied head's embedding does); the held policy's logits are the int8 reference's
    (``reference_model`` over the fp32 policy: exact integer products); the adapter's gradient is the one through
    the dequantized weights (straight through the activations' rounding) within int8's rounding."""
    from refit.core.int8 import reference_model
    from refit.learner.run.lora import hold_int8, holds_int8

    m = Manifest.read(int8_dirs[arch])
    fp32, held = _lora(model_dirs[arch]), _lora(model_dirs[arch])
    want = {o for g, twins in matmul_modules(fp32.get_base_model(), m).items() for ms in twins.values() for o in ms}
    assert hold_int8(held, m) == len(want) > 0 and holds_int8(held)
    base = held.get_base_model()
    got = {n for n, mod in base.named_modules() if isinstance(mod, Int8Linear)}
    assert got == want
    engine = _engine_twins(int8_dirs[arch], m)
    fp32_mods = matmul_modules(fp32.get_base_model(), m)
    for graph, twins in fp32_mods.items():
        for w, owners in twins.items():
            for owner in owners:
                mod = base.get_submodule(owner)
                assert torch.equal(mod.q, engine[w][0]) and torch.equal(mod.scale, engine[w][1]), owner
                assert not list(mod.parameters())  # the fp32 weight released
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    from refit.learner.run.policy import vocab_size

    assert vocab_size(held) == fp32.config.vocab_size and isinstance(head, Int8Linear)
    assert head.weight.shape == (fp32.config.vocab_size, fp32.config.hidden_size if arch != "tiny-gpt2" else
                                 fp32.config.n_embd)
    assert head._weight is None  # reading it kept no fp32 copy of the head (a learner's int8 base holds none)
    if getattr(head, "tied_embedding", False):
        assert embed.weight.dtype == torch.float32 and embed.weight.requires_grad is False
    ids = torch.randint(0, fp32.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = reference_model(fp32.get_base_model(), m)
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5)

    qdq = _lora(model_dirs[arch])  # the straight-through reference: fp32 arithmetic over the dequantized weights
    with torch.no_grad():
        for owner in want:
            src = qdq.get_base_model().get_submodule(owner)
            w = dequantize(base.get_submodule(owner).q, base.get_submodule(owner).scale)  # (K, N)
            (src.weight.copy_(w.t() if isinstance(src, torch.nn.Linear) else w))
    grads = []
    for model in (held, qdq):
        with torch.no_grad():  # a trained adapter (B != 0), the same in both, so every adapter weight has a gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
        model.zero_grad()
        torch.log_softmax(model(input_ids=ids).logits, -1)[..., 1].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad]))
    assert float(torch.nn.functional.cosine_similarity(grads[0], grads[1], 0)) > 0.99


def test_final_model_of_an_int8_base(model_dirs, int8_dirs, tmp_path):
    """final/ of an int8 base holds the dequantized base (the numbers the run multiplied by) with the adapter
    merged, in each module's own layout (GPT-2's Conv1D (in, out)), the tied head tied; it loads by from_pretrained."""
    from transformers import AutoModelForCausalLM

    from refit.learner.run.lora import hold_int8, merged_state

    arch = "tiny-gpt2"
    model = _lora(model_dirs[arch])
    hold_int8(model, Manifest.read(int8_dirs[arch]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    state = merged_state(model)
    assert not any(k.endswith((".q", ".scale")) or "lora_" in k or "base_layer" in k for k in state)
    layer = model.get_base_model().transformer.h[0].attn.c_attn  # Conv1D (in, out), adapted
    held = layer.base_layer
    want = dequantize(held.q, held.scale) + layer.get_delta_weight("default")
    torch.testing.assert_close(state["transformer.h.0.attn.c_attn.weight"], want, rtol=0, atol=0)
    assert torch.equal(state["transformer.h.0.attn.c_attn.bias"], held.bias)
    model.get_base_model().save_pretrained(str(tmp_path), state_dict=state)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.transformer.h[0].attn.c_attn.weight, want, rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # saved tied, as it ran


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_held_base_releases_the_checkpoint_mapping(model_dirs, int8_dirs, tmp_path):
    """safetensors loads a checkpoint as views of one file mapping; once the base is held in int8, what stays of it
    (the embedding, norms, biases) owns its memory, so the mapping, the fp32 weights with it, is gone."""
    import gc
    import shutil

    from refit.learner.run.lora import hold_int8

    arch = "tiny-qwen2"
    folder = shutil.copytree(model_dirs[arch], tmp_path / "private")  # a path no other test maps
    model = _lora(folder)

    def mapped() -> bool:
        return str(folder) in open("/proc/self/maps").read()

    assert mapped()
    hold_int8(model, Manifest.read(int8_dirs[arch]))
    gc.collect()
    assert not mapped()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(model(input_ids=ids).logits).all()  # the kept tensors still hold the checkpoint's values
