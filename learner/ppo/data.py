"""PPO's prompts and what reward functions receive; the held-out evaluation through the engine.

Prompt sources, first match wins: ``data.dataset`` (a local file or ``save_to_disk`` folder with columns,
:mod:`learner.run.dataset`), ``prompts_file`` (one prompt per line), the embedded ``task``.

Held-out evaluation (``eval_steps``): the eval split's prompts are generated GREEDILY through the policy
engine (the weights just pushed), scored by the same reward functions with their columns, and logged as
``eval/reward/mean`` and ``eval/reward/NAME/mean`` (metrics.jsonl, TensorBoard, curves.png).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from learner.ppo.rewards import TrainerState, as_rewards, score_rewards
from learner.run.chat import completion_for
from learner.run.data import decode_responses
from learner.run.dataset import PromptSet, cap, load_prompt_dataset, text_file_prompts
from rollout.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from learner.ppo.cycle import Run


def load_prompt_sets(cfg) -> tuple[PromptSet, PromptSet | None]:
    """(training prompts with their columns, held-out prompts or None)."""
    d = cfg.data
    if d.dataset:
        train, held = load_prompt_dataset(d.dataset, d.dataset_split, d.dataset_text_field or d.prompt_column,
                                          d.eval_split, d.eval_fraction, cfg.run.seed)
        return train, cap(held, cfg.eval_max_prompts, cfg.run.seed)
    if cfg.prompts_file:
        return text_file_prompts(cfg.prompts_file), None
    from learner.examples.tasks import TASKS

    kw = {"max_operand": d.max_operand} if d.task == "addition" else {}
    return PromptSet([e.prompt for e in TASKS[d.task](d.num_prompts, seed=cfg.run.seed, **kw)], {}, d.task), None


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


def trainer_state(run: Run, step: int, evaluating: bool = False) -> TrainerState:
    """TRL's view of the run at the rollout of ``step`` (or at the evaluation after ``step``): the optimizer
    steps taken before it and the passes over the training prompts."""
    cfg, n = run.cfg, max(1, len(run.prompts))
    per = cfg.num_ppo_epochs * cfg.num_mini_batches  # optimizer steps per rollout
    done = step if evaluating else max(step - 1, 0)  # rollouts whose update is in the weights
    return TrainerState(global_step=done * per, max_steps=cfg.run.steps * per, epoch=run.data_position / n,
                        num_train_epochs=cfg.run.steps * cfg.run.batch_size / n, step=step)


def evaluate(run: Run, step: int = 0) -> dict[str, float]:
    """Greedy generation of the held-out prompts through the engine; their reward means (rank 0)."""
    cfg, t0 = run.cfg, time.perf_counter()
    if run.eval_set is None or not cfg.eval_steps:
        return {}
    chunk = max(1, cfg.run.batch_size * cfg.num_generations)  # what the engine was sized for
    sampling = SamplingParams(max_new_tokens=cfg.response_length, greedy=True, stop_ids=run.stop_ids)
    prompts, completions, extra, tokens = [], [], {}, 0.0
    for i in range(0, len(run.eval_ids), chunk):
        rows = list(range(i, min(i + chunk, len(run.eval_ids))))
        out = run.engine.generate([run.eval_ids[r] for r in rows], sampling)
        p, c, x = reward_inputs(run.tok, out, run.eval_set, rows)
        prompts, completions, tokens = prompts + p, completions + c, tokens + float(out.response_mask.sum())
        for k, v in x.items():
            extra.setdefault(k, []).extend(v)
    hooks = run.reward_log.kwargs(trainer_state(run, step, evaluating=True))
    total, stats = score_rewards(as_rewards(run.reward_fn), prompts, completions, {**extra, **hooks},
                                 prefix="eval/reward")
    logged, _ = run.reward_log.flush(prefix="eval/")
    return {"eval/reward/mean": float(total.mean()), **stats, **logged, "eval/response_length": tokens / len(prompts),
            "time/eval": time.perf_counter() - t0}
