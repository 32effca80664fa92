"""PPO's prompts and what reward functions receive; the held-out evaluation through the engine.

Prompt sources, first match wins: ``data.dataset`` (a local file or ``save_to_disk`` folder with columns,
:mod:`refit.learner.run.dataset`), ``prompts_file`` (one prompt per line), the embedded ``task``.

Held-out evaluation (``eval_steps``): the eval split's prompts are generated GREEDILY through the policy
engine (the weights just pushed), scored by the same reward functions with their columns, and logged as
``eval/reward/mean`` and ``eval/reward/NAME/mean`` (metrics.jsonl, TensorBoard, curves.png).
"""

from __future__ import annotations

from typing import Any

from refit.learner.builtin.tasks import TASKS
from refit.learner.run.chat import completion_for
from refit.learner.run.data import decode_responses
from refit.learner.run.dataset import PromptSet, cap, load_prompt_dataset, text_file_prompts
from refit.rollout.types import RolloutBatch


def load_prompt_sets(cfg) -> tuple[PromptSet, PromptSet | None]:
    """(training prompts with their columns, held-out prompts or None)."""
    d = cfg.data
    if d.dataset:
        train, held = load_prompt_dataset(d.dataset, d.dataset_split, d.dataset_text_field or d.prompt_column,
                                          d.eval_split, d.eval_fraction, cfg.run.seed)
        return train, cap(held, cfg.eval_max_prompts, cfg.run.seed)
    if cfg.prompts_file:
        return text_file_prompts(cfg.prompts_file), None

    kw = {"max_operand": d.max_operand} if d.task == "addition" else {}
    return PromptSet(prompts=[e.prompt for e in TASKS[d.task](d.num_prompts, seed=cfg.run.seed, **kw)],
                     source=d.task), None


def reward_inputs(tok, batch: RolloutBatch, data: PromptSet, rows: list[int]) -> tuple[list, list, dict[str, Any]]:
    """(prompts, completions, keyword columns) for a reward call; ``rows[i]`` is the dataset row of batch row i.

    Completions are text for text prompts and ``[{"role": "assistant", "content": text}]`` for chat prompts
    (TRL); ``completion_ids`` are the response ids up to and including the stop token.
    """
    prompts = [data.prompts[r] for r in rows]
    texts = decode_responses(tok, batch)
    completions = [completion_for(p, t) for p, t in zip(prompts, texts)]
    ids = [[t for t, k in zip(r, m) if k] for r, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist())]
    return prompts, completions, {**data.take(rows), "completion_ids": ids}
