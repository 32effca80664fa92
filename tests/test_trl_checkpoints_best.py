"""transformers' checkpoint fields on the facade: ``stateful_callbacks`` written at each save and restored on resume
with ``restore_callback_states_from_checkpoint`` (compared with transformers' own ``TrainerState.load_from_json`` and
``Trainer._load_callback_state``), and best-model tracking with ``load_best_model_at_end`` (refit.learner.trl.best):
best_metric / best_model_checkpoint, the best view kept from rotation (compared with transformers'
``rotate_checkpoints``), the final model, save_model and the final engine holding the best checkpoint's weights."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import rotate_checkpoints

from refit.core.errors import RefitError
from refit.learner.trl import GRPOConfig, GRPOTrainer
from refit.learner.trl.best import track
from refit.learner.trl.checkpoints import rotate


class Counter(TrainerCallback, ExportableState):
    """An ExportableState callback: the steps it saw, and its state at on_train_begin (after any restore)."""

    def __init__(self, every: int = 1):
        self.every, self.seen, self.at_begin = every, 0, None

    def on_train_begin(self, args, state, control, **kw):
        self.at_begin = self.state()

    def on_step_end(self, args, state, control, **kw):
        self.seen += 1

    def state(self) -> dict:
        return {"args": {"every": self.every}, "attributes": {"seen": self.seen}}


def _dataset(n: int):
    import datasets

    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i % 7}+{i % 5}="}]}
                                       for i in range(n)])


def _same(completions, **kwargs):
    return [0.0 for _ in completions]  # each evaluation alike: EarlyStoppingCallback counts each after the first


def _peak(completions, trainer_state, **kwargs):
    """Highest at global step 2 (what the evaluation after optimizer step 2 sees), the length term for advantages."""
    return [-float(trainer_state.global_step - 2) ** 2 - len(c[0]["content"]) / 1000 for c in completions]


def _args(out, engine, max_steps, **kw):
    refit = {"model.engine_dir": str(engine), "log.plots": False, "export_final": False, "rollout.probe_size": 2}
    return GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      max_steps=max_steps, learning_rate=1e-2, logging_steps=1, save_steps=1, eval_strategy="steps",
                      eval_steps=1, metric_for_best_model="reward", use_cpu=True, disable_tqdm=True,
                      **{**kw, "refit": {**refit, **kw.get("refit", {})}})


def _trainer(model, engine, out, max_steps, callbacks, reward=_same, **kw):
    return GRPOTrainer(model=str(model), reward_funcs=[reward], args=_args(out, engine, max_steps, **kw),
                       train_dataset=_dataset(8), eval_dataset=_dataset(2), callbacks=callbacks)


def _states(callbacks) -> list:
    return [(type(cb).__name__, cb.state()) for cb in callbacks if isinstance(cb, ExportableState)]


def test_callback_states_survive_a_resume_with_the_flag_as_transformers_restores_them(chat_model_dir,
                                                                                      chat_engine_dir, tmp_path):
    out = tmp_path / "run"
    first = _trainer(chat_model_dir, chat_engine_dir, out, 2, [Counter(3), EarlyStoppingCallback(100)])
    first.train()
    saved = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["Counter"] == {"args": {"every": 3}, "attributes": {"seen": 2}}
    stopper = saved["EarlyStoppingCallback"]["attributes"]
    assert stopper == {"early_stopping_patience_counter": 1}  # the second evaluation did not improve
    assert set(saved["TrainerControl"]["args"]) >= {"should_save", "should_training_stop"}

    # the reference: transformers' own restore of that trainer_state.json into fresh callbacks
    args = _args(out, chat_engine_dir, 3, restore_callback_states_from_checkpoint=True)
    ref = SimpleNamespace(args=args, control=TrainerControl(),
                          state=TrainerState.load_from_json(str(out / "checkpoint-2" / "trainer_state.json")),
                          callback_handler=CallbackHandler([Counter(), EarlyStoppingCallback(100)], None, None, None,
                                                           None))
    Trainer._load_callback_state(ref)
    given = [Counter(), EarlyStoppingCallback(100)]
    second = _trainer(chat_model_dir, chat_engine_dir, out, 3, given, restore_callback_states_from_checkpoint=True)
    second.train(resume_from_checkpoint=True)
    counter = next(cb for cb in second.callbacks if isinstance(cb, Counter))
    assert counter is not given[0] and counter.at_begin == {"args": {"every": 3}, "attributes": {"seen": 2}}
    assert counter.seen == 3  # restored, then one more step
    ours = [(type(cb).__name__, cb.at_begin if isinstance(cb, Counter) else None) for cb in second.callbacks]
    theirs = [(type(cb).__name__, cb.state() if isinstance(cb, Counter) else None)
              for cb in ref.callback_handler.callbacks]
    assert ours == theirs  # the same classes in the same order, the same restored state
    stopper = next(cb for cb in second.callbacks if isinstance(cb, EarlyStoppingCallback))
    assert stopper.early_stopping_patience_counter == 2  # transformers restored 1; step 3 did not improve

    # without the flag: fresh callbacks, as passed, as transformers (its _load_callback_state returns at once)
    fresh = [Counter(), EarlyStoppingCallback(100)]
    third = _trainer(chat_model_dir, chat_engine_dir, out, 4, fresh)
    third.train(resume_from_checkpoint=True)
    assert third.callbacks == fresh and fresh[0].at_begin == Counter().state() and fresh[0].seen == 1
    assert fresh[1].early_stopping_patience_counter == 1  # from 0: step 4 did not beat the restored best_metric
    saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["Counter"]["attributes"] == {"seen": 1}  # what the callbacks hold at the save


def test_load_best_model_at_end_leaves_the_best_checkpoints_weights(chat_model_dir, chat_engine_dir, tmp_path):
    from refit.export.onnx_export import weights_hash
    from refit.core.manifest import Manifest

    out = tmp_path / "run"
    seen = []

    class Views(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            seen.append(sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")))

    trainer = _trainer(chat_model_dir, chat_engine_dir, out, 3, [Views()], reward=_peak, load_best_model_at_end=True,
                       save_total_limit=1, refit={"export_final": True})
    assert trainer.args.greater_is_better is True
    trainer.train()
    evals = {r["step"]: r["eval_reward"] for r in trainer.state.log_history if "eval_reward" in r}
    assert max(evals, key=evals.get) == 2
    best = out / "checkpoint-2"
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(best) and state["best_global_step"] == 2
    assert state["best_metric"] == pytest.approx(evals[2])
    # save_total_limit=1 keeps the best: checkpoint-3 beside it while training, only it at the end (transformers)
    assert seen == [["checkpoint-1"], ["checkpoint-2"], ["checkpoint-2", "checkpoint-3"]]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2"]
    want = load_file(str(best / "model.safetensors"))
    last = load_file(str(out / "checkpoints" / "step_000003" / "policy" / "model.safetensors"))
    assert any(not (want[k] == last[k]).all() for k in want)  # step 3 trained on: the best is not the last
    for folder in (out / "final", tmp_path / "saved"):
        if folder.name == "saved":
            trainer.save_model(str(folder))
        got = load_file(str(folder / "model.safetensors"))
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
    model = trainer.model.state_dict()
    assert all((model[k] == want[k]).all() for k in want if k in model)
    engine = Manifest.read(out / "final_engine")  # exported again: the best weights, not the last step's
    assert engine.hashes.hf_weights_sha256 == weights_hash(out / "final")
    assert trainer.evaluate()["eval_reward"] == evals[2]


def test_rotation_keeps_the_best_view_as_transformers(tmp_path):
    """The views after Refit's rotation (only the newest `limit` Refit checkpoints left) against transformers'
    rotate_checkpoints over the same folders."""
    for limit, best in ((1, 2), (2, 2), (2, 6), (3, 4), (2, None)):
        ours, theirs = tmp_path / f"ours-{limit}-{best}", tmp_path / f"theirs-{limit}-{best}"
        for n in (2, 4, 6, 8):
            (theirs / f"checkpoint-{n}").mkdir(parents=True)
            (ours / f"checkpoint-{n}").mkdir(parents=True)
            (ours / f"checkpoint-{n}" / "refit_checkpoint.json").write_text(json.dumps({"step": n // 2}))
            if n // 2 > 4 - limit:
                (ours / "checkpoints" / f"step_{n // 2:06d}").mkdir(parents=True)
        rotate_checkpoints(str(theirs), limit, os.path.join(str(theirs), f"checkpoint-{best}") if best else None)
        rotate(ours, limit, os.path.join(str(ours), f"checkpoint-{best}") if best else None)
        names = sorted(p for p in os.listdir(ours) if p.startswith("checkpoint-"))
        assert names == sorted(os.listdir(theirs)), (limit, best)


def test_settings_and_a_metric_not_logged_are_one_line():
    with pytest.raises(RefitError, match="metric_for_best_model='loss' .transformers' default.*logs no eval_loss"):
        GRPOConfig(output_dir="o", load_best_model_at_end=True, eval_strategy="steps")
    with pytest.raises(RefitError, match="eval_strategy and save_strategy to match"):
        GRPOConfig(output_dir="o", load_best_model_at_end=True, metric_for_best_model="reward")
    with pytest.raises(RefitError, match="save_steps to be a multiple of eval_steps"):
        GRPOConfig(output_dir="o", load_best_model_at_end=True, metric_for_best_model="reward", eval_strategy="steps",
                   eval_steps=3, save_steps=4)
    assert GRPOConfig(output_dir="o", metric_for_best_model="eval_kl_to_teacher").greater_is_better is True
    assert GRPOConfig(output_dir="o", metric_for_best_model="x_loss").greater_is_better is False
    with pytest.raises(RefitError, match=r"metric_for_best_model='rewards': eval_rewards is not among the "
                                         r"evaluation's metrics \(eval_reward, eval_reward_std\)"):
        track(TrainerState(), GRPOConfig(output_dir="o", metric_for_best_model="rewards"),
              {"eval_reward": 1.0, "eval_reward_std": 0.0, "epoch": 1.0})
    s, a = TrainerState(global_step=4), GRPOConfig(output_dir="o", metric_for_best_model="kl", greater_is_better=False)
    assert track(s, a, {"eval_kl": 0.5}) and (s.best_metric, s.best_global_step) == (0.5, 4)
    s.global_step = 6
    assert not track(s, a, {"eval_kl": 0.7}) and s.best_global_step == 4
