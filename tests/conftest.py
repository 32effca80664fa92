"""Shared fixtures: tiny HF checkpoints built locally (no hub) and their exported engine folders.

Built once per test session; every test that needs a model or an engine uses these.
"""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = ["tiny-gpt2", "tiny-llama", "tiny-t5"]


@pytest.fixture(scope="session")
def tokenizer():
    from export.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """{geometry: checkpoint folder} for tiny GPT-2, Llama and T5."""
    from export.models import build_model

    root = tmp_path_factory.mktemp("models")
    return {g: build_model(g, root / g, seed=0, tokenizer=tokenizer) for g in ARCHS}


@pytest.fixture(scope="session")
def engine_dirs(tmp_path_factory, model_dirs):
    """{geometry: ONNX engine folder} exported (with the parity gate) from :func:`model_dirs`."""
    from export.onnx_export import ExportOptions, export_onnx

    root = tmp_path_factory.mktemp("engines")
    return {g: export_onnx(d, root / g, ExportOptions(max_batch=16, max_len=128), log=lambda *_: None)
            for g, d in model_dirs.items()}


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
