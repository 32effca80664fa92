"""The run layer both jobs share: data positions, step bookkeeping, the finite check, engine versions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from refit.core.errors import RefitError
from refit.learner.run.data import prompt_indices
from refit.learner.run.loop import check_finite, due, last_step
from refit.rollout.engine import next_version


def test_prompt_positions_continue_across_batch_sizes():
    """Resuming at a data position with another batch size continues the same prompt stream."""
    whole = prompt_indices(7, 0, 20, seed=3)
    assert prompt_indices(7, 0, 6, 3) + prompt_indices(7, 6, 4, 3) + prompt_indices(7, 10, 10, 3) == whole
    for epoch in range(2):  # each epoch is a permutation of all prompts
        assert sorted(whole[7 * epoch:7 * (epoch + 1)]) == list(range(7))
    assert whole[:7] != whole[7:14]  # and epochs are shuffled differently


def test_due_and_last_step():
    assert [s for s in range(1, 8) if due(s, 3, 7)] == [3, 6, 7]
    cfg = SimpleNamespace(run=SimpleNamespace(steps=10, max_steps_this_run=0))
    assert last_step(cfg, 4) == 10
    cfg.run.max_steps_this_run = 3
    assert last_step(cfg, 4) == 7 and last_step(cfg, 9) == 10


def test_check_finite_names_the_bad_values_and_the_last_checkpoint(tmp_path):
    check_finite({"a": 1.0, "b": -2.0}, "loss", tmp_path)
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "state.json").write_text("{}")
    with pytest.raises(RefitError, match=r"non-finite loss at step 5 \(b=nan, c=inf\).*step_000004"):
        check_finite({"a": 1.0, "b": math.nan, "c": math.inf}, "loss at step 5", tmp_path)


def test_next_version_counts_up_or_restores_but_never_goes_back():
    assert next_version(0, None) == 1 and next_version(0, 3) == 3 and next_version(3, 3) == 3
    with pytest.raises(RefitError, match="older than"):
        next_version(4, 2)
