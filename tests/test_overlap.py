"""Generation overlapped with the update (rollout.max_staleness, refit.learner.ppo.overlap): the staleness bound,
k=0 unchanged, resume with a rollout in flight, KL at step 0."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo, setup, train_step
from refit.learner.run.metrics import read_metrics

GOLDEN = Path(__file__).parent / "data" / "ppo-k0-metrics.json"
WALL_CLOCK = ("time/", "tokens_per_s")  # the only fields two runs may differ in


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """An overlapped run splits torch's threads with the engine (setup sets the learner's share): restore them."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cfg(model_dirs, engine_dirs, out, **kw):
    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]), output_dir=str(out),
                steps=4, batch_size=4, num_generations=2, advantage_estimator="grpo", num_mini_batches=1,
                num_ppo_epochs=1, response_length=4, save_steps=2, probe_size=4, progress=False, tensorboard=False,
                plots=False, max_operand=9, num_prompts=32, learning_rate=1e-3, export_final=False,
                reward="refit.learner.examples.tasks:length_reward", engine_threads=1)
    base.update(kw)
    return PPOConfig.from_flat(**base)


def _same(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics rows: the same steps and fields, equal values but for wall-clock."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb), (ra["step"], set(ra) ^ set(rb))
        for k, v in ra.items():
            if not k.startswith(WALL_CLOCK) and v is not None:
                assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (ra["step"], k, v, rb[k])


def test_k0_is_the_synchronous_loop_unchanged(model_dirs, engine_dirs, tmp_path):
    """max_staleness 0 (the default) logs what the loop logged before overlap existed: the metrics of a fixed-seed
    run were recorded with the code before this change (tests/data/ppo-k0-metrics.json, REFIT_RECORD_GOLDEN=1
    rewrites it); no overlap field appears."""
    cfg = _cfg(model_dirs, engine_dirs, tmp_path)
    assert cfg.rollout.max_staleness == 0 and cfg.correction == "none"
    rows = read_metrics(run_ppo(cfg, log=lambda *_: None))
    if os.environ.get("REFIT_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    _same(json.loads(GOLDEN.read_text()), rows)
    assert not any(k.startswith("rollout/") or k in ("time/generate", "time/push_wait") for k in rows[-1])
