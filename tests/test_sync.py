"""The sync room (refit.learner.run.sync) in its own terms: what it reads of an engine is what the Engine protocol
declares, on every backend, and the weights version is the engine's (a push raises it, a failed push leaves it, the
room reads it and counts nothing of its own; an overlapped push is numbered by the engine's rule)."""

from __future__ import annotations

import pytest
import torch

from conftest import corrupting
from refit.core.errors import RefitError
from refit.core.hf_folder import load_model
from refit.core.manifest import Manifest
from refit.learner.ppo.overlap import RolloutAhead
from refit.learner.run.engines import CountingEngine
from refit.learner.run.sync import Contract, WeightSync
from refit.rollout.engine import Engine, LoopEngine
from refit.rollout.hf_backend import HFGenerateEngine
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.ray_pool import RayEnginePool
from refit.rollout.tensorrt.engine import TrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
DECLARED = sorted(n for n in vars(Engine) if not n.startswith("_"))  # the protocol's members, read from it


def test_the_protocol_declares_what_the_learner_reads():
    """The names the learner reads of an engine (the sync room: the version, the manifest's dtype, whether pushes
    carry an adapter; PPO's reference: the adapter-off view) are the protocol's own."""
    assert DECLARED == ["adapter", "adapter_off", "close", "generate", "manifest", "score", "update_weights",
                        "weights_version"]
    for name in ("manifest", "adapter", "weights_version", "adapter_off"):
        assert (getattr(Engine, name).__doc__ or "").strip(), f"Engine.{name} has no docstring"


@pytest.mark.parametrize("cls", [TrtEngine, RayEnginePool, OrtEngine, TorchEngine, HFGenerateEngine])
def test_every_backend_class_has_the_declared_names(cls):
    """Statically, on the class: TensorRT needs a GPU and Ray a cluster to make one (their runtime paths run in
    tests/test_tensorrt.py's stand-in and tests/test_scaleout.py); a value set in ``__init__`` has its class default
    (LoopEngine's, or the pool's own)."""
    missing = [n for n in DECLARED if not hasattr(cls, n)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    if issubclass(cls, LoopEngine):
        assert cls.manifest is None and cls.adapter is None  # what an engine over a PyTorch model says


def test_every_backend_instance_is_an_engine(model_dirs, engine_dirs, one_torch_thread):
    """At run time on the tiny fixtures: onnxruntime (an engine folder: its manifest; no adapter inputs), the torch
    reference and the hf baseline (a PyTorch model: no manifest, fp32), and the teacher's counting wrapper (the inner
    engine's); an engine without adapter inputs refuses the adapter-off view in one line."""
    ort = OrtEngine(engine_dirs["tiny-gpt2"], threads=1)
    ref, hf = TorchEngine(model_dirs["tiny-gpt2"]), HFGenerateEngine(model_dirs["tiny-gpt2"])
    counted = CountingEngine(ort)
    for eng in (ort, ref, hf, counted):
        assert isinstance(eng, Engine), type(eng).__name__
        assert eng.adapter is None and isinstance(eng.weights_version, int)
        with pytest.raises(RefitError, match="adapter_off"):
            eng.adapter_off()
    assert isinstance(ort.manifest, Manifest) and ort.manifest.dtype == "fp32" and counted.manifest is ort.manifest
    assert ref.manifest is None and hf.manifest is None
    ort.close()


@pytest.fixture
def pushed_setup(model_dirs, engine_dirs, one_torch_thread, tmp_path):
    """(engine, a model moved off the exported weights, the probe batch, the room) on tiny-gpt2."""
    eng = OrtEngine(engine_dirs["tiny-gpt2"], threads=1)
    model = load_model(model_dirs["tiny-gpt2"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    probe = eng.generate(PROMPTS, SamplingParams(max_new_tokens=4, greedy=True))
    yield eng, model, probe, WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-4), tmp_path)
    eng.close()


def test_the_version_is_the_engines(pushed_setup, model_dirs):
    """A push raises the engine's version and the room reads that one; a push the engine refuses leaves both; a
    push the engine takes but the probe rejects has raised it: the room agrees, and the line names it."""
    eng, model, probe, sync = pushed_setup
    assert eng.weights_version == sync.version == 0
    assert sync.push(model) < 1e-4
    assert eng.weights_version == sync.version == 1
    with pytest.raises(RefitError, match="not engine weights"):  # another geometry's names: refused before any change
        sync.push(load_model(model_dirs["tiny-llama"]))
    assert eng.weights_version == sync.version == 1
    eng.update_weights = corrupting(eng.update_weights)  # the engine takes the push with one weight damaged
    with pytest.raises(RefitError, match="weights_version 2, on the probe batch"):
        sync.push(model)
    assert eng.weights_version == sync.version == 2
    del eng.update_weights
    rollout_checked = WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-4, check_on_rollout=True),
                                 sync.run_dir)
    assert rollout_checked.push(model) is None and rollout_checked.unchecked  # checked by the next rollout
    assert eng.weights_version == rollout_checked.version == 3


def test_an_overlapped_push_is_numbered_by_the_engines_rule(pushed_setup):
    """Queued on the engine's thread, a push is numbered next_version(engine's) at once (the staleness check needs
    no wait); collected, the room reads the engine again, which gave it that number. An engine that does not take the
    number is refused in one line by the room's job."""
    eng, model, probe, _ = pushed_setup
    ahead = RolloutAhead(eng)
    sync = WeightSync(eng, probe, Contract(temperature=1.0, probe_tol=1e-4), _.run_dir, ahead=ahead)
    stats, timings = {}, {}
    try:
        sync.after_update(model, due=True, last=False, stats=stats, timings=timings)
        assert sync.version == 1 and "probe/max_abs_logprob_diff" not in stats  # queued: logged on the next row
        sync.after_update(model, due=False, last=False, stats=stats, timings=timings)  # collects it
        assert eng.weights_version == sync.version == 1 and stats["probe/max_abs_logprob_diff"] < 1e-4
        assert timings["time/push_engine"] > 0 and timings["time/probe_engine"] > 0
        eng.update_weights = lambda named, version=None: None  # a push the engine silently drops
        with pytest.raises(RefitError, match="weights_version 1 after the push numbered 2"):
            sync.after_update(model, due=True, last=True, stats=stats, timings=timings)
    finally:
        ahead.close()
