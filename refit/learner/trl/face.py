"""The surface every TRL trainer shares: ``train``, ``evaluate``, ``save_model``, ``add_callback`` /
``pop_callback`` / ``remove_callback``, ``state``, ``args``, ``model`` (the trained policy after ``train``),
``processing_class``.
A trainer says how its job runs (:meth:`TrainerFace._run`); the rest is here."""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from refit.core.errors import RefitError
from refit.learner.run.final import ADAPTER
from refit.learner.trl.best import best_eval, load_best, mark
from refit.learner.trl.checkpoints import load_state, restored_rate, resume_point, save_args, write_view
from refit.learner.trl.common import tokenizer_of, trained_model
from refit.learner.trl.events import Events


@dataclass(frozen=True)
class TrainOutput:
    """What TRL's ``train()`` returns (transformers.TrainOutput's fields)."""

    global_step: int  # optimizer steps taken
    training_loss: float  # the mean of the logged loss over the run's steps
    metrics: dict  # the final log row (train_runtime, train_loss, ...)


# TRL 1.16 trainer arguments (beyond the config) that Refit does not build: what it does instead
NOT_BUILT = {
    "data_collator": "prompts are batched by the job",
    "compute_metrics": "held-out KL to the teacher and accuracy",
    "optimizers": "AdamW with optim.* settings",
    "preprocess_logits_for_metrics": "not available",
    "formatting_func": "prompt / completion or messages columns",
    "reward_processing_classes": "a classifier folder's own tokenizer",
    "quantization_config": "bitsandbytes is CUDA's; a LoRA base is held in fp32 or bf16 (model_init_kwargs dtype) and "
                           "the engine's base in int8 (rollout.quantize)",
    **dict.fromkeys(("tools", "rollout_func", "environment_factory"),
                    "generation is one engine pass per prompt, without tool calls, environments or a custom rollout "
                    "function"),
}


class TrainerFace(ABC):
    """A TRL trainer's public surface over one Refit job (subclasses: the GRPO/RLOO and distillation trainers)."""

    def _refuse(self, **given) -> None:
        """One line for the first trainer argument given (not None; ``optimizers``: not ``(None, None)``) that Refit
        does not build (:data:`NOT_BUILT`), before any work."""
        for what, v in given.items():
            if what == "optimizers" and tuple(v or (None, None)) == (None, None):
                continue
            if v is not None:
                raise RefitError(f"{type(self).__name__}: {what} is not supported (Refit: {NOT_BUILT[what]})")

    def __init__(self, args, callbacks, processing_class, model):
        self.args = args
        self.given_model = model if not isinstance(model, (str, Path)) else None  # trained in place, as TRL
        if processing_class is None and self.given_model is not None and hasattr(self.given_model, "config"):
            processing_class = tokenizer_of(self.given_model)
        self.processing_class = processing_class
        self.events = Events(args, list(callbacks or []), processing_class)
        self.result = None  # refit.learner.api.RunResult after train()
        self._model = self.given_model

    # transformers.Trainer's callback methods
    def add_callback(self, callback) -> None:
        self.events.add(callback)

    def pop_callback(self, callback):
        return self.events.pop(callback)

    def remove_callback(self, callback) -> None:
        self.events.remove(callback)

    @property
    def callbacks(self) -> list:
        return list(self.events.callbacks)

    @property
    def state(self):
        """transformers' ``TrainerState``: global_step (optimizer steps), epoch, max_steps, log_history."""
        return self.events.state

    @property
    def control(self):
        return self.events.control

    @property
    def model(self):
        """The policy: after ``train()`` the trained one (a model object given in is updated in place)."""
        return self._model

    @abstractmethod
    def _run(self, hooks, resume: bool):
        """Run the job with ``hooks``; return its :class:`refit.learner.api.RunResult`."""

    @abstractmethod
    def _hooks(self):
        """The :class:`refit.learner.run.loop.StepHooks` of this trainer's job (:meth:`Events.hooks`)."""

    def _samples_per_step(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Run the job with the callbacks. ``resume_from_checkpoint``: True continues from OUTPUT_DIR's newest
        ``checkpoint-N`` (a path: that folder, which must be the newest), ``trainer.state`` restored from its
        ``trainer_state.json`` (:mod:`refit.learner.trl.checkpoints`)."""
        out = Path(self.args.output_dir)
        self.events.resumed = None
        if self.args.load_best_model_at_end and getattr(getattr(self.config, "lora", None), "r", 0):
            raise RefitError(f"{type(self).__name__}: load_best_model_at_end with peft_config is not supported (Refit "
                             "writes final/ from the trained adapter); train without it")
        if resume_from_checkpoint:  # False / None / "": a fresh run, as transformers
            view, step = resume_point(out, resume_from_checkpoint)
            state = load_state(view)
            if state.best_model_checkpoint is not None and not Path(state.best_model_checkpoint).is_dir():
                state.best_model_checkpoint = None  # transformers: "does not exist anymore. Ignoring it"
            self.events.restore(state, restored_rate(out, step))
            self.events.restore_states()  # restore_callback_states_from_checkpoint
        else:
            self.events.state.stateful_callbacks = {}
            self.events.record_states()  # transformers' TrainerState(stateful_callbacks=...) of a fresh train()
        hooks = self._hooks()
        hooks = replace(hooks, saved=self._saved(hooks.saved))
        self.events.begin(self._model)
        self.result = self._run(hooks, bool(resume_from_checkpoint))
        best = load_best(self.state, self.args, self.result.final_dir)  # load_best_model_at_end
        self._model = trained_model(self.result.run_dir, self.result.final_dir or best, self.given_model)
        if best is not None:
            self.events.last_eval = best_eval(self.state, self.args) or self.events.last_eval
        self.events.model = self._model
        loss = self.events.end(self._samples_per_step())
        return TrainOutput(global_step=self.state.global_step, training_loss=loss,
                           metrics=dict(self.state.log_history[-1]))

    def _saved(self, fire_on_save):
        """After Refit's checkpoint of a step: TRL's ``checkpoint-N`` view of it (save_strategy 'steps', or a
        callback's ``should_save``; 'no' writes none, as TRL, though Refit keeps its last-step checkpoint), then
        on_save."""
        def saved(step: int) -> None:
            if self.args.save_strategy == "steps" or self.events.save_asked:
                self.events.record_states()  # transformers' _save_checkpoint: the callbacks' states, the best view
                mark(self.state, self.args)
                write_view(Path(self.args.output_dir), step, self.state, self.args,
                           with_optimizer=not self.args.save_only_model)
            fire_on_save(step)
        return saved

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's ``evaluate()``: the held-out metrics of the trained model in TRL's names (``eval_reward``, ...;
        distillation: ``eval_kl_to_teacher``, ...), logged and passed to on_evaluate. Refit evaluates inside its
        run, at the last step always when the trainer has an ``eval_dataset`` (and every ``eval_steps`` with
        ``eval_strategy='steps'``): this returns that last evaluation, which saw the final weights (with
        ``load_best_model_at_end``: the best step's evaluation, which saw the weights the model now holds)."""
        name = type(self).__name__
        if eval_dataset is not None or metric_key_prefix != "eval":
            raise RefitError(f"{name}.evaluate: Refit evaluates the eval_dataset given to the trainer, under the "
                             "'eval_' prefix (pass eval_dataset to the trainer)")
        if self.events.last_eval is None:
            raise RefitError(f"{name}.evaluate: nothing evaluated yet; Refit evaluates inside train() (give the "
                             "trainer an eval_dataset, then call train())")
        metrics = {k: v for k, v in self.events.last_eval.items() if k not in (ignore_keys or ())}
        self.events.evaluated(dict(metrics))
        return metrics

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model where TRL's ``save_model`` puts it: ``output_dir`` gets the save_pretrained folder
        (OUTPUT_DIR/final, copied; a LoRA run: its PEFT adapter folder, final/adapter, as TRL saves a PEFT model)
        and ``training_args.bin``. None: OUTPUT_DIR/final itself (TRL writes OUTPUT_DIR; a Refit run folder is
        never also a model folder)."""
        if self.result is None or self.result.final_dir is None:
            raise RefitError("save_model: nothing trained yet (call train() first; export_final writes the model)")
        final = self.result.final_dir
        source = final / ADAPTER if (final / ADAPTER / "adapter_config.json").is_file() else final
        if output_dir and Path(output_dir).resolve() != final.resolve():
            shutil.copytree(source, output_dir, dirs_exist_ok=True)
            save_args(self.args, Path(output_dir) / "training_args.bin")

    def log(self, logs: dict[str, Any]) -> None:
        """transformers' ``Trainer.log``: a row into ``state.log_history`` and on_log."""
        self.events.log(dict(logs))
