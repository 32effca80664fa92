"""transformers' best-model tracking over the facade's checkpoints (``metric_for_best_model``,
``greater_is_better``, ``load_best_model_at_end``).

What transformers 5's ``Trainer`` does under TRL 1.16, and where it is done here:

- the config's rules (``TrainingArguments.__post_init__``): with ``load_best_model_at_end`` the metric defaults to
  ``"loss"``, ``greater_is_better`` to ``not metric.endswith("loss")``, and the eval and save strategies must match
  with save_steps a multiple of eval_steps (:func:`settle`);
- at each evaluation during training, after on_evaluate (``_determine_best_metric``): the metric, ``eval_``
  prepended when missing, against ``state.best_metric`` (:func:`track`); a metric Refit does not log is one line;
- at each save (``_save_checkpoint``): ``best_model_checkpoint`` = ``OUTPUT_DIR/checkpoint-{best_global_step}``
  when that view exists (:func:`mark`), and the rotation by ``save_total_limit`` keeps it
  (:func:`refit.learner.trl.checkpoints.rotate`);
- at the end of ``train()`` (:func:`load_best`): OUTPUT_DIR/final gets the best view's weight files (the rest of
  final/, its tokenizer and generation config, as written) and OUTPUT_DIR/final_engine is exported again from it
  with its own options, so the model ``train()`` returns, ``save_model`` and the final engine are the best
  checkpoint's; with ``save_total_limit=1`` every other view is deleted (transformers' end of ``train()``).

Refit's held-out evaluation logs ``eval_reward``, ``eval_reward_std``, ``eval_rewards/<func>/mean``,
``eval_completions/mean_length`` (GRPO, RLOO) or ``eval_kl_to_teacher``, ``eval_accuracy`` (distillation), never an
``eval_loss``: transformers' default metric ``"loss"`` is refused at construction.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.integrity import atomic_folder
from refit.learner.run.final import export_final_again
from refit.learner.trl.checkpoints import PREFIX, views

# transformers' weight files (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, their shards and indexes): what _load_best_model reads
WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
LOGGED = ("GRPO / RLOO: eval_reward, eval_reward_std, eval_rewards/<func>/mean, eval_completions/mean_length; "
          "distillation: eval_kl_to_teacher, eval_accuracy")


def metric_key(args) -> str:
    """``metric_for_best_model`` as transformers looks it up: ``eval_`` prepended when missing."""
    m = args.metric_for_best_model
    return m if m.startswith("eval_") else f"eval_{m}"


def settle(a) -> None:
    """``TrainingArguments.__post_init__``'s rules for these fields, each broken one a line."""
    name = type(a).__name__
    default = a.load_best_model_at_end and a.metric_for_best_model is None
    if default:
        a.metric_for_best_model = "loss"
    if a.greater_is_better is None and a.metric_for_best_model is not None:
        a.greater_is_better = not a.metric_for_best_model.endswith("loss")
    if a.metric_for_best_model is not None and a.eval_strategy != "no" and metric_key(a) == "eval_loss":
        why = " (transformers' default with load_best_model_at_end)" if default else ""
        raise RefitError(f"{name}: metric_for_best_model={a.metric_for_best_model!r}{why}: Refit's held-out "
                         f"evaluation logs no eval_loss; name one it logs ({LOGGED})")
    if not a.load_best_model_at_end:
        return
    if a.eval_strategy != a.save_strategy:
        raise RefitError(f"{name}: load_best_model_at_end needs eval_strategy and save_strategy to match (as "
                         f"transformers), got eval_strategy={a.eval_strategy!r}, save_strategy={a.save_strategy!r}")
    every = a.eval_steps or a.logging_steps  # transformers: None or 0 falls back to logging_steps
    if a.eval_strategy == "steps" and every and a.save_steps % every:
        mixed = (every < 1) != (a.save_steps < 1)
        if mixed or round(a.save_steps * 1_000_000) % round(every * 1_000_000):
            raise RefitError(f"{name}: load_best_model_at_end needs save_steps to be a multiple of eval_steps (as "
                             f"transformers), got save_steps={a.save_steps}, eval_steps={every}")


def track(state, args, metrics: dict) -> bool:
    """transformers' ``_determine_best_metric`` after an evaluation during training: True when ``metrics`` hold a
    new best (``state.best_metric`` and ``best_global_step`` set)."""
    if args.metric_for_best_model is None:
        return False
    key = metric_key(args)
    if key not in metrics:
        have = ", ".join(k for k in metrics if k.startswith("eval_"))
        raise RefitError(f"metric_for_best_model={args.metric_for_best_model!r}: {key} is not among the evaluation's "
                         f"metrics ({have}); name one of them")
    better = operator.gt if args.greater_is_better else operator.lt
    if state.best_metric is None:
        state.best_metric = float("-inf") if args.greater_is_better else float("inf")
    if not better(metrics[key], state.best_metric):
        return False
    state.best_metric = metrics[key]
    if args.save_strategy == "steps":
        state.best_global_step = state.global_step
    return True


def mark(state, args) -> None:
    """``_save_checkpoint`` before it writes ``checkpoint-{state.global_step}``: ``best_model_checkpoint`` names
    the view of ``best_global_step`` when it exists or is the one being written."""
    if args.save_strategy != "steps" or not state.best_global_step:
        return
    path = os.path.join(args.output_dir, f"{PREFIX}{state.best_global_step}")
    if state.best_global_step == state.global_step or os.path.isdir(path):
        state.best_model_checkpoint = path


def best_eval(state, args) -> dict | None:
    """The evaluation row of ``state.log_history`` at ``best_global_step`` (what ``evaluate()`` of the best model
    gives: Refit's held-out evaluation is deterministic for the same weights), else None."""
    key = metric_key(args) if args.metric_for_best_model else None
    for row in reversed(state.log_history):
        if row.get("step") == state.best_global_step and key in row:
            return {k: v for k, v in row.items() if k != "step"}
    return None


def load_best(state, args, final_dir: Path | None, log=print) -> Path | None:
    """The end of ``train()``: with ``load_best_model_at_end`` and a best view, OUTPUT_DIR/final (when written) gets
    its weights and final_engine is exported again; with ``save_total_limit=1`` the other views are deleted. The
    folder the trained model loads from (final/, else the best view; None: no best, the run's own)."""
    best = Path(state.best_model_checkpoint) if state.best_model_checkpoint else None
    folder = None
    if args.load_best_model_at_end and best is not None:
        log(f"refit: loading the best model from {best} (score: {state.best_metric})")
        folder = best
        if final_dir is not None:
            _swap_weights(Path(final_dir), best)
            export_final_again(Path(final_dir).parent, log=log)
            folder = Path(final_dir)
    if best is not None and args.save_total_limit == 1:
        for view in views(Path(args.output_dir)):
            if not os.path.samefile(view, best):
                shutil.rmtree(view, ignore_errors=True)
    return folder


def _swap_weights(final: Path, best: Path) -> None:
    """``final``'s weight files replaced by ``best``'s (one rename: a failure leaves final/ as it was)."""
    with atomic_folder(final) as tmp:
        tmp.mkdir(parents=True)
        for f in sorted(final.iterdir()):
            if f.is_file() and not WEIGHT_FILE.match(f.name):
                shutil.copy2(f, tmp / f.name)
        for f in sorted(best.iterdir()):
            if f.is_file() and WEIGHT_FILE.match(f.name):
                shutil.copy2(f, tmp / f.name)
