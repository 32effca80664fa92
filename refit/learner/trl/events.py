"""TRL's view of a running job: transformers' ``TrainerCallback`` events with ``TrainerState`` and
``TrainerControl``, ``state.log_history`` under TRL's metric names, as the step hooks of
:func:`refit.learner.run.loop.run_job`.

Where the events fire (transformers' ``Trainer`` loop, which TRL's trainers run):

==================  ==========================================================================================
event               here
==================  ==========================================================================================
on_train_begin      before the job starts (``control.should_training_stop`` reset)
on_step_begin       before each Refit step (should_log / should_evaluate / should_save reset)
on_step_end         after it: ``state.global_step`` advanced by the step's optimizer steps
on_log              when logging is due (logging_steps, logging_first_step, the last step), with the row
                    appended to ``state.log_history``: each value the mean over the steps since the last row
on_evaluate         after a step that ran Refit's held-out evaluation (``eval_steps``), its metrics in TRL's names
                    (``eval_reward``, ``eval_kl_to_teacher``, ...) logged first, as transformers' evaluate()
on_save             after a checkpoint was written (ckpt.save_steps, or ``control.should_save``)
on_train_end        after the run; the final row (train_runtime, train_loss, ...) is logged first, as TRL does
==================  ==========================================================================================

``control.should_training_stop`` after on_step_end / on_log ends the run there (the model is written as after
the last step); ``control.should_save`` saves that step. One departure: a PPO step (one generation) makes
``num_iterations x steps_per_generation / gradient_accumulation_steps`` optimizer steps; on_step_begin and
on_step_end fire once around them and ``global_step`` advances by that many (one, with TRL's defaults).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import ExportableState

from refit.core.errors import RefitError
from refit.learner.run.loop import StepControl, StepHooks
from refit.learner.trl.best import track

# TRL's metric name <- Refit's (metrics.jsonl); reward-function names are mapped by prefix (rewards/NAME/mean)
GRPO_NAMES = {"reward": "reward/mean", "reward_std": "reward/std", "completions/mean_length": "response/length",
              "entropy": "policy/entropy", "clip_ratio/region_mean": "ppo/clipfrac", "grad_norm": "ppo/grad_norm",
              "frac_reward_zero_std": "advantage/zero_std_frac", "step_time": "time/step",
              "clip_ratio/low_mean": "ppo/clip_ratio/low_mean", "clip_ratio/high_mean": "ppo/clip_ratio/high_mean",
              "completions/clipped_ratio": "response/truncated_frac"}
DISTILL_NAMES = {"loss": "loss", "grad_norm": "grad_norm",
                 "completions/mean_length": "response/length", "step_time": "time/step"}
LAST = ("epoch", "learning_rate", "grad_norm")  # logged as their value at the log step, not a window mean


def grpo_row(m: dict, kl_coef: float, kl_in_loss: bool) -> dict[str, float]:
    """TRL GRPO / RLOO names for a PPO step's metrics ``m``. ``loss``: the policy-gradient loss plus
    ``kl_coef`` x the k3 term when the KL is in the loss (GRPO); ``kl``: that k3 term's token mean (GRPO) or the
    rollout's k1 token mean (RLOO's KL in the reward), logged when ``kl_coef`` is not 0, as TRL does."""
    row = {trl: m[ours] for trl, ours in GRPO_NAMES.items() if m.get(ours) is not None}
    for k, v in m.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "reward" and parts[2] in ("mean", "std"):
            row[f"rewards/{parts[1]}/{parts[2]}"] = v
    kl = m.get("ppo/kl_loss") if kl_in_loss else m.get("kl/k1")
    if "ppo/pg_loss" in m:
        row["loss"] = m["ppo/pg_loss"] + (kl_coef * kl if kl_in_loss and kl is not None else 0.0)
        if "ppo/entropy_coef" in m:  # the entropy bonus is on: TRL's policy_loss leaves it (and the aux loss) out
            row["policy_loss"] = row["loss"]
    if "ppo/loss" in m:  # every term of the loss, as TRL logs it (the entropy bonus, the router loss)
        row["loss"] = m["ppo/loss"]
    for name in ("entropy_coef", "aux_loss"):
        if f"ppo/{name}" in m:
            row[name] = m[f"ppo/{name}"]
    if kl_coef and kl is not None:
        row["kl"] = kl
    return row


def eval_row(evals: dict) -> dict[str, float]:
    """TRL's names for Refit's held-out evaluation (``eval/...``): ``eval_reward``, ``eval_reward_std``,
    ``eval_rewards/<func>/mean``, ``eval_completions/mean_length``; any other ``eval/X`` as ``eval_X``
    (distillation: ``eval_kl_to_teacher``, ``eval_accuracy``)."""
    out = {}
    for k, v in evals.items():
        name = k.removeprefix("eval/")
        parts = name.split("/")
        if name in ("reward/mean", "reward/std"):
            key = "eval_reward" + ("_std" if parts[1] == "std" else "")
        elif len(parts) == 3 and parts[0] == "reward":
            key = f"eval_rewards/{parts[1]}/{parts[2]}"
        else:
            key = "eval_completions/mean_length" if name == "response_length" else "eval_" + name
        out[key] = v
    return out


def distill_row(m: dict) -> dict[str, float]:
    """TRL DistillationTrainer / GKDTrainer names for a distillation step's metrics ``m``."""
    return {trl: m[ours] for trl, ours in DISTILL_NAMES.items() if m.get(ours) is not None}


class Events:
    """The callbacks, ``state`` and ``control`` of one trainer, and the hooks that drive them from a run."""

    def __init__(self, args, callbacks: list, processing_class=None):
        self.args = args
        self.callbacks: list = []
        for cb in callbacks or []:
            self.add(cb)
        self.state = TrainerState()
        self.state.log_history = []
        self.control = TrainerControl()
        self.processing_class = processing_class
        self.model = None  # the policy the callbacks are shown (the model object given in; the trained one at the end)
        self.eval_in_train = True  # a held-out evaluation during the run is logged and fires on_evaluate
        self.last_eval: dict | None = None  # the last held-out evaluation, in TRL's names (evaluate() returns it)
        self.save_asked = False  # the last step's control.should_save (a callback asked for its checkpoint)
        self.resumed: tuple[int, float] | None = None  # (global_step, learning rate) of the checkpoint resumed

    # -------------------------------------------------------------- the callback list (transformers' semantics)

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        for cb in list(self.callbacks):
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove(self, callback) -> None:
        if not isinstance(callback, type):
            self.callbacks.remove(callback)  # ValueError when absent, as transformers
        else:
            self.pop(callback)

    def fire(self, event: str, **kw) -> TrainerControl:
        """``event`` on every callback in order; a returned control replaces the current one (transformers'
        CallbackHandler rules, with its resets)."""
        c = self.control
        if event == "on_train_begin":
            c.should_training_stop = False
        elif event == "on_step_begin":
            c.should_log = c.should_evaluate = c.should_save = False
        elif event in ("on_log", "on_save", "on_evaluate"):
            setattr(c, {"on_log": "should_log", "on_save": "should_save", "on_evaluate": "should_evaluate"}[event],
                    False)
        for cb in self.callbacks:
            out = getattr(cb, event)(self.args, self.state, c, model=self.model,
                                     processing_class=self.processing_class, optimizer=None, lr_scheduler=None,
                                     train_dataloader=None, eval_dataloader=None, **kw)
            if out is not None:
                c = out
        self.control = c
        return c

    # -------------------------------------------------------------- stateful callbacks (transformers' ExportableState)

    def exportable(self) -> list:
        """The callbacks whose state a checkpoint keeps (ExportableState ones), then ``control``, as transformers."""
        return [cb for cb in self.callbacks + [self.control] if isinstance(cb, ExportableState)]

    def record_states(self) -> None:
        """``state.stateful_callbacks`` as ``_save_checkpoint`` updates it: each callback's ``state()`` by class name
        (several of one class: a list, in order) over what it held. One departure: several of one class are written
        as their current states (transformers appends them to the list at each save, and restores its first ones)."""
        now = TrainerState(stateful_callbacks=self.exportable()).stateful_callbacks
        self.state.stateful_callbacks = {**(self.state.stateful_callbacks or {}), **now}

    def restore_states(self) -> None:
        """transformers' ``_load_callback_state`` with ``restore_callback_states_from_checkpoint``: each callback
        (and ``control``) whose class name ``state.stateful_callbacks`` holds is replaced by a new one of its class
        built from the stored ``args`` and ``attributes``, appended after the others, as transformers does."""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        current, restored = self.callbacks + [self.control], []
        for name, data in (self.state.stateful_callbacks or {}).items():
            same = [cb for cb in current if type(cb).__name__ == name]
            for cb, d in zip(same, data if isinstance(data, list) else [data]):
                new = type(cb)(**d.get("args", {}))
                for k, v in d.get("attributes", {}).items():
                    setattr(new, k, v)
                if isinstance(cb, TrainerControl):
                    self.control = new
                else:
                    restored.append(new)
                    self.remove(type(new))
        for cb in restored:
            self.add(cb)

    # -------------------------------------------------------------- one train() call

    def restore(self, state, learning_rate: float) -> None:
        """``train(resume_from_checkpoint=...)``: ``state`` (a checkpoint's ``TrainerState``, its log_history
        included) becomes ``self.state``, as transformers restores it; ``learning_rate``: the rate the restored
        optimizer holds, which the first step after it uses (its schedule's rate at the checkpoint, under the
        max_steps it was written with), as TRL logs it."""
        self.state = state
        self.resumed = (state.global_step, learning_rate)

    def hooks(self, *, steps: int, per: int, row: Callable[[dict], dict], epoch_of: Callable[[int], float],
              lr_at: Callable[[int], float]) -> StepHooks:
        """The step hooks of one run of ``steps`` Refit steps of ``per`` optimizer steps each. ``row``: a step's
        Refit metrics -> TRL-named values; ``epoch_of``: Refit step -> epochs done; ``lr_at``: optimizer steps
        taken -> the learning rate of the next (:func:`refit.learner.trl.common.lr_schedule`): a row's
        ``learning_rate`` is the rate its last optimizer step used, as TRL logs it."""
        s, a = self.state, self.args
        s.max_steps, s.train_batch_size = steps * per, a.per_device_train_batch_size
        s.logging_steps = max(1, _steps(a.logging_steps, s.max_steps))
        s.save_steps = max(1, _steps(a.save_steps, s.max_steps))
        s.num_train_epochs = epoch_of(steps)
        window: list[dict] = []
        self._window, self._t0, self._losses = window, time.perf_counter(), []
        self._initial_step = s.global_step  # past 0 after restore(): this call's steps are counted from here
        resumed = self.resumed

        def before(step: int) -> None:
            if resumed is not None and step - 1 != resumed[0] // per and s.global_step == self._initial_step:
                raise RefitError(f"resume_from_checkpoint: Refit resumed its checkpoint of step {step - 1}, the "
                                 f"checkpoint-{resumed[0]} view shows step {resumed[0] // per} (its newest intact "
                                 "checkpoint differs); continue with the checkpoint it resumed, or start afresh")
            s.global_step = (step - 1) * per  # a resumed run starts past 0
            self.fire("on_step_begin")

        def after(step: int, m: dict) -> StepControl:
            s.global_step, s.epoch = step * per, epoch_of(step)
            trl = row(m)
            trl["epoch"] = s.epoch
            after_resume = resumed is not None and s.global_step - 1 == resumed[0]
            trl["learning_rate"] = resumed[1] if after_resume else lr_at(s.global_step - 1)
            if "loss" in trl:
                self._losses.append(trl["loss"])
            window.append(trl)
            c = self.fire("on_step_end")
            first = step * per <= per and a.logging_first_step
            crossed = (s.global_step - per) // s.logging_steps < s.global_step // s.logging_steps
            if a.logging_strategy == "steps" and (first or crossed or step == steps):
                c.should_log = True
            if c.should_log:
                self.log(_mean(window))
                window.clear()
            evals = {k: v for k, v in m.items() if k.startswith("eval/")}
            if evals:
                self.last_eval = {**eval_row(evals), "epoch": s.epoch}
                if self.eval_in_train:
                    self.evaluated(dict(self.last_eval))
                    track(s, a, self.last_eval)  # after on_evaluate, as transformers' _determine_best_metric
            c = self.control
            self.save_asked = bool(c.should_save)
            return StepControl(save=bool(c.should_save), stop=bool(c.should_training_stop), metrics=trl)

        def saved(step: int) -> None:
            self.fire("on_save")

        return StepHooks(before=before, after=after, saved=saved)

    def log(self, logs: dict[str, float]) -> None:
        """transformers' ``Trainer.log``: the row, with ``step``, into ``log_history``; then on_log."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.fire("on_log", logs=logs)

    def evaluated(self, metrics: dict[str, float]) -> None:
        """transformers' evaluate(): the metrics logged (a log_history row, on_log), then on_evaluate."""
        self.log(metrics)
        self.fire("on_evaluate", metrics=metrics)

    def begin(self, model=None) -> None:
        self.model = model
        self.fire("on_train_begin")

    def end(self, samples_per_step: int) -> float:
        """The final row (TRL's train_runtime, train_loss, ...) logged, then on_train_end; returns train_loss."""
        s = self.state
        if self._window and self.args.logging_strategy == "steps":
            self.log(_mean(self._window))  # a run stopped between log steps
            self._window.clear()
        runtime = time.perf_counter() - self._t0
        loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
        steps = max(s.global_step - self._initial_step, 1)  # this call's steps (transformers: since the resume)
        self.log({"train_runtime": runtime, "train_samples_per_second": samples_per_step * steps / runtime,
                  "train_steps_per_second": steps / runtime, "total_flos": 0.0, "train_loss": loss,
                  "epoch": s.epoch})
        self.fire("on_train_end")
        return loss


def _steps(value: float, total: int) -> int:
    return int(value * total + 0.999999) if 0 < value < 1 else int(value)


def _mean(rows: list[dict]) -> dict[str, Any]:
    """A log row over ``rows``: each value's mean over the rows that have it (TRL averages its metrics over the
    logging window), epoch / learning_rate / grad_norm as at the last row."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = vals[-1] if k in LAST else sum(vals) / len(vals)
    return out
