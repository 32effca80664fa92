"""Shared fixtures: tiny HF checkpoints built locally (no hub) and their exported engine folders.

Built once per test session; every test that needs a model or an engine uses these. Also the one
list of test architectures and the one parity tolerance table (``from conftest import ...``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# GPT-2 and Llama: decoder-only, prompts left-padded; T5, BART and Marian: encoder-decoder, encoder input
# right-padded (BART: learned positions from offset 2; Marian: sinusoidal positions, scaled embeddings, the pad
# id as decoder start; both: final_logits_bias). Every family of refit.bench.export_families: tests/test_export.py.
ARCHS = ["tiny-gpt2", "tiny-llama", "tiny-t5", "tiny-bart", "tiny-marian"]
FP16_ARCHS = ["tiny-llama"]  # the fp16 export (:func:`fp16_engine_dir`)

# Parity tolerance: backend -> engine dtype -> atol (rtol 0) on log-probs against the fp32 PyTorch
# reference. A backend with no row here fails tests/test_parity.py; a dtype with no entry is not run.
ATOL = {
    "torch": {"fp32": 1e-5},  # the reference's cached/chunked passes against one uncached HF forward
    "hf": {"fp32": 1e-5},  # the same HF model under transformers' generate()
    "onnxruntime": {"fp32": 1e-4,  # the export parity gate's fp32 tolerance
                    "fp16": 1e-3},  # fp16 weights and activations vs the fp32 model: measured 2e-4 on CPU
    "tensorrt-stand-in": {"fp32": 1e-4, "fp16": 1e-3},  # ONNX Runtime under the TrtEngine code paths
    "tensorrt": {"fp32": 1e-3,  # TF32 off; GPU kernels
                 "fp16": 5e-2},  # as the former TensorRT-vs-ORT fp16 test; not yet measured against torch
}
PAD_ATOL = {"fp32": 1e-5, "fp16": 1e-3}  # one backend: a prompt alone vs inside a padded batch
TEXTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7"]  # four prompt lengths


class BuiltOnce(dict):
    """{geometry: folder}: each built on first use (``d["tiny-bart"]``) and kept for the session, so a
    test run exports only the families its tests ask for, each once."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, geometry: str):
        self[geometry] = self._make(geometry)
        return self[geometry]


@pytest.fixture(scope="session")
def tokenizer():
    from refit.learner.builtin.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """{geometry: checkpoint folder} for any geometry of refit.learner.builtin.models.GEOMETRIES (tiny GPT-2, ..., Marian)."""
    from refit.learner.builtin.models import build_model

    root = tmp_path_factory.mktemp("models")
    return BuiltOnce(lambda g: build_model(g, root / g, seed=0, tokenizer=tokenizer))


@pytest.fixture(scope="session")
def default_engine_dirs(tmp_path_factory, model_dirs):
    """{geometry: ONNX engine folder} exported (with the parity gate) from :func:`model_dirs` with the
    default options: the fused-attention decoder graph for decoder-only models, the plain one for seq2seq."""
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    root = tmp_path_factory.mktemp("engines")
    return BuiltOnce(lambda g: build(model_dirs[g], root / g, opts=ExportOptions(max_batch=16, max_len=128),
                                           log=lambda *_: None))


@pytest.fixture(scope="session")
def qdq_engine_dirs(tmp_path_factory, model_dirs):
    """{geometry: the TensorRT int8 export} (``--backend tensorrt --quantize int8``: int8 weights through
    DequantizeLinear, plain attention), exported and gated here on ONNX Runtime CPU; no TensorRT plans built."""
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    root = tmp_path_factory.mktemp("engines-qdq")
    opts = ExportOptions(backend="tensorrt", quantize="int8", attention="plain", max_batch=16, max_len=128)
    return BuiltOnce(lambda g: build(model_dirs[g], root / g, opts=opts, log=lambda *_: None))


@pytest.fixture(scope="session")
def fp16_engine_dir(tmp_path_factory, model_dirs):
    """tiny-llama exported in fp16 (weights and activations), standard-op graph (the TensorRT stand-in builds
    from it): the fp16 rows of the parity matrix. The fused fp16 graph: tests/test_dtype.py."""
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    out = tmp_path_factory.mktemp("engines-fp16") / "tiny-llama"
    return build(model_dirs["tiny-llama"], out, opts=ExportOptions(dtype="fp16", max_batch=16, max_len=128,
                                                                   attention="plain"), log=lambda *_: None)


@pytest.fixture(scope="session")
def trt_folders(tmp_path_factory):
    """kind -> :class:`tensorrt_standin.TrtFolders` ("stand-in" or "tensorrt"; the latter skips without it)."""
    from tensorrt_standin import TrtFolders

    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = TrtFolders(kind, tmp_path_factory.mktemp(f"trt-{kind}"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """:data:`TEXTS` as token ids: four lengths, so every batch of them is padded."""
    return [tokenizer(t).input_ids for t in TEXTS]


def tiny_distill_config(model_dirs, engine_dirs, out, **kw):
    """A small DistillConfig: teacher tiny-llama, student tiny-gpt2 (one tokenizer and vocabulary, two
    architectures); ``kw`` overrides any field."""
    from refit.learner.distill.config import DistillConfig

    base = dict(teacher_model_dir=str(model_dirs["tiny-llama"]), student_model_dir=str(model_dirs["tiny-gpt2"]),
                teacher_engine_dir=str(engine_dirs["tiny-llama"]), student_engine_dir=str(engine_dirs["tiny-gpt2"]),
                output_dir=str(out), steps=4, batch_size=8, eval_size=8, num_prompts=64, max_new_tokens=4,
                teacher_topk=8, probe_size=4, eval_every=100, save_steps=2, warmup_steps=0, learning_rate=1e-3,
                progress=False, tensorboard=False, plots=False, export_final=False)
    return DistillConfig.from_flat(**{**base, **kw})


def same_rows(a, b, tol: float) -> None:
    """Two RolloutBatches give the same tokens and mask, and both log-prob kinds within ``tol``."""
    import torch

    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=tol, rtol=0)
    torch.testing.assert_close(a.rollout_plain_logprobs, b.rollout_plain_logprobs, atol=tol, rtol=0)


def corrupting(push):
    """Wrap an engine's ``update_weights`` so every push carries noise on one MLP weight (probe tests)."""

    def corrupt(named):
        import torch

        bad = dict(named)
        k = next(n for n in bad if "mlp.c_fc.weight" in n)
        bad[k] = bad[k] + 0.5 * torch.randn(bad[k].shape, generator=torch.Generator().manual_seed(0))
        push(bad)

    return corrupt


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny GPT-2 whose tokenizer has a chat template (refit.learner.builtin.models.build_chat_tokenizer)."""
    from refit.learner.builtin.models import build_chat_tokenizer, build_model

    return build_model("tiny-gpt2", tmp_path_factory.mktemp("chat") / "tiny-gpt2-chat", seed=0,
                       tokenizer=build_chat_tokenizer())


@pytest.fixture(scope="session")
def chat_engine_dir(tmp_path_factory, chat_model_dir):
    """The ONNX engine of :func:`chat_model_dir`."""
    from refit.export.options import ExportOptions
    from refit.rollout.build import build

    return build(chat_model_dir, tmp_path_factory.mktemp("chat_engine") / "tiny-gpt2-chat",
                 opts=ExportOptions(max_batch=16, max_len=128), log=lambda *_: None)


@pytest.fixture(scope="session", autouse=True)
def fp32_learner_by_default():
    """The suite's learners compute in fp32 on any CPU: ``run.precision auto`` (refit.learner.run.precision) sees no
    bf16 units, so a box with AVX512-BF16/AMX (or a CUDA GPU) runs the expectations written for fp32 learners, as a
    box without does. The bf16 paths are tested by asking for them (``run.precision bf16``: tests/test_precision.py,
    tests/test_lora.py); the engine's int8 default follows the real CPU."""
    from dataclasses import replace

    from refit.learner.run import precision

    real = precision.hardware_facts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "hardware_facts", lambda device: replace(real(device), bf16_units=False, bf16_isa=""))
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is faster, and immune to a busy machine's oversubscription
    (measured: the rollout tests' calls took 40 s with 2 OpenMP threads on 2 shared cores, 6 s with 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_copy(tmp_path):
    """Copy a folder into this test's tmp dir (tests that modify an engine or model use this)."""

    def copy(src, name=None):
        dst = tmp_path / (name or os.path.basename(str(src)))
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def engine_dirs(default_engine_dirs):
    """{geometry: engine folder} most tests run on (a test module may override it, see test_tensorrt.py)."""
    return default_engine_dirs


@pytest.fixture(scope="session")
def plain_engine_dirs(tmp_path_factory, model_dirs, default_engine_dirs):
    """{geometry: engine folder with the standard-op (plain attention) decoder graph}: what TensorRT builds
    from. engine_dirs holds the default export, the fused-attention graph wherever it applies."""
    from refit.rollout.build import plain_twin

    root = tmp_path_factory.mktemp("plain-engines")

    def make(g):
        return plain_twin(model_dirs[g], default_engine_dirs[g], root / g, log=lambda *_: None)

    return BuiltOnce(make)


def quantized_reference(model_dir, manifest, pushed=None):
    """TorchEngine over the model of ``model_dir`` with its quantized layers as the engine computes them
    (refit/core/int8.reference_model: int8 rows x int8 weights, or matmuls by dequantized weights for Q/DQ),
    ``pushed`` (HF name -> tensor) loaded first. Returns (engine, the fp32 model)."""
    from refit.core.hf_folder import load_model
    from refit.core.int8 import reference_model
    from refit.rollout.torch_backend import TorchEngine

    model = load_model(model_dir)
    if pushed:
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for n, t in pushed.items():
                params[n].copy_(t)
    return TorchEngine(reference_model(model, manifest)), model
