"""TRL's checkpoint-N folders as a view of Refit's checkpoints (refit.learner.trl.checkpoints), read back with
transformers' own functions (get_last_checkpoint, TrainerState.load_from_json, from_pretrained, the optimizer's and
scheduler's load_state_dict); trainer.state restored on resume (refit.learner.trl.events). The end-to-end run, under
TRL 1.16 and on Refit: tests/trl_scripts/grpo_checkpoints.py (tests/test_trl_scripts.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState, get_scheduler
from transformers.trainer_utils import get_last_checkpoint

from refit.core.errors import RefitError
from refit.learner.run.checkpoint import save_checkpoint
from refit.learner.trl import GRPOConfig
from refit.learner.trl.checkpoints import refit_checkpoint, restored_rate, resume_point, views, write_view
from refit.learner.trl.events import Events

PER = 2  # optimizer steps a Refit step: checkpoint-N shows step_{N / 2}


@pytest.fixture
def trained(chat_model_dir):
    """A tiny model, its tokenizer, AdamW with state after one step, and a linear schedule over 4 steps."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(chat_model_dir))
    tok = AutoTokenizer.from_pretrained(str(chat_model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=4)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sched.step()
    return model, tok, opt, sched


def _state(global_step: int) -> TrainerState:
    s = TrainerState()
    s.global_step, s.max_steps = global_step, 8
    s.log_history = [{"loss": 0.5 / k, "learning_rate": 1e-3, "step": k} for k in range(1, global_step + 1)]
    return s


def _save(run_dir, step, trained, keep=0, args=None, with_optimizer=True):
    model, tok, opt, sched = trained
    save_checkpoint(run_dir, step, model, tok, None, opt, sched, {"kl_coef": 0.0}, keep=keep)
    return write_view(run_dir, step, _state(step * PER), args or GRPOConfig(output_dir=str(run_dir)),
                      with_optimizer=with_optimizer)


def test_a_view_holds_trls_files_and_transformers_reads_them(trained, tmp_path):
    model, tok, opt, sched = trained
    view = _save(tmp_path, 1, trained)
    assert view == tmp_path / "checkpoint-2" and get_last_checkpoint(str(tmp_path)) == str(view)
    source = refit_checkpoint(tmp_path, 1) / "policy"
    assert os.stat(view / "model.safetensors").st_ino == os.stat(source / "model.safetensors").st_ino  # one file
    loaded = AutoModelForCausalLM.from_pretrained(str(view)).state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items() if k in loaded)
    assert AutoTokenizer.from_pretrained(str(view)).chat_template == tok.chat_template
    state = TrainerState.load_from_json(str(view / "trainer_state.json"))
    assert state.global_step == 2 and [r["step"] for r in state.log_history] == [1, 2]
    opt2 = torch.optim.AdamW(AutoModelForCausalLM.from_pretrained(str(view)).parameters(), lr=1e-3)
    opt2.load_state_dict(torch.load(view / "optimizer.pt", weights_only=False))  # transformers' own loading
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    sched2 = get_scheduler("linear", opt2, num_warmup_steps=0, num_training_steps=4)
    sched2.load_state_dict(torch.load(view / "scheduler.pt", weights_only=False))
    assert sched2.last_epoch == 1 and sched2.get_last_lr() == sched.get_last_lr() == [pytest.approx(7.5e-4)]
    assert restored_rate(tmp_path, 1) == pytest.approx(7.5e-4)  # what the first step after a resume uses
    rng = torch.load(view / "rng_state.pth", weights_only=False)  # transformers' _load_rng_state keys
    assert set(rng) >= {"python", "numpy", "cpu"} and torch.equal(rng["cpu"], torch.load(
        refit_checkpoint(tmp_path, 1) / "trainer.pt", weights_only=False)["rng"]["torch"])
    assert isinstance(torch.load(view / "training_args.bin", weights_only=False), GRPOConfig)
    assert json.loads((view / "refit_checkpoint.json").read_text()) == {"step": 1, "path": "checkpoints/step_000001"}


def test_save_only_model_leaves_the_optimizer_out_of_the_view(trained, tmp_path):
    view = _save(tmp_path, 1, trained, with_optimizer=False)
    assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(os.listdir(view))
    assert (refit_checkpoint(tmp_path, 1) / "trainer.pt").is_file()  # Refit's own checkpoint keeps them


def test_the_views_follow_refits_rotation(trained, tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, trained, keep=2)  # save_total_limit 2 -> ckpt.keep_checkpoints 2
    assert [v.name for v in views(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_resume_point_takes_the_newest_view_and_refuses_others_in_one_line(trained, tmp_path):
    with pytest.raises(RefitError, match="no checkpoint-N folder in output_dir"):
        resume_point(tmp_path, True)
    _save(tmp_path, 1, trained)
    _save(tmp_path, 2, trained)
    assert resume_point(tmp_path, True) == (tmp_path / "checkpoint-4", 2)
    assert resume_point(tmp_path, str(tmp_path / "checkpoint-4")) == (tmp_path / "checkpoint-4", 2)
    with pytest.raises(RefitError, match="continues the newest checkpoint .*, checkpoint-4; to go back to checkpoint-2"):
        resume_point(tmp_path, str(tmp_path / "checkpoint-2"))
    with pytest.raises(RefitError, match="not a checkpoint folder"):
        resume_point(tmp_path, str(tmp_path / "checkpoints"))
    trl_own = tmp_path / "checkpoint-10"  # what TRL itself writes: no Refit checkpoint behind it
    trl_own.mkdir()
    _state(10).save_to_json(str(trl_own / "trainer_state.json"))
    with pytest.raises(RefitError, match="written by TRL itself cannot be continued"):
        resume_point(tmp_path, True)


def test_a_restored_state_keeps_its_log_history_and_logs_the_restored_rate(tmp_path):
    """Resumed at global step 4 of a linear schedule that ended there: step 5 logs the rate the optimizer held (0),
    step 6 the new schedule's; log_history runs 1..6; the final row counts this call's 2 steps."""
    ev = Events(GRPOConfig(output_dir=str(tmp_path), logging_steps=1, max_steps=6), [])
    old = _state(4)
    ev.restore(old, 0.0)
    hooks = ev.hooks(steps=6, per=1, row=lambda m: {"loss": m["l"]}, epoch_of=lambda s: s / 8,
                     lr_at=lambda n: 1e-3 * (1 - n / 6))
    for step, loss in ((5, 0.3), (6, 0.1)):
        hooks.before(step)
        hooks.after(step, {"l": loss})
    assert ev.end(4) == pytest.approx(0.2)
    rows = ev.state.log_history
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 6] and rows[:4] == _state(4).log_history
    assert [r["learning_rate"] for r in rows[4:6]] == [0.0, pytest.approx(1e-3 / 6)]
    assert rows[-1]["train_loss"] == pytest.approx(0.2)
    assert rows[-1]["train_samples_per_second"] == pytest.approx(8 / rows[-1]["train_runtime"])  # 2 steps x 4


def test_a_resume_of_another_refit_step_than_the_view_shows_is_one_line(tmp_path):
    ev = Events(GRPOConfig(output_dir=str(tmp_path), logging_steps=1, max_steps=6), [])
    ev.restore(_state(4), 0.0)  # the view shows Refit step 4 (per 1); the job resumed step 2 (a damaged newer one)
    hooks = ev.hooks(steps=6, per=1, row=dict, epoch_of=float, lr_at=float)
    with pytest.raises(RefitError, match="resumed its checkpoint of step 2, the checkpoint-4 view shows step 4"):
        hooks.before(3)


def test_save_settings_map_as_trl_and_stay_the_same_when_max_steps_grows():
    from refit.learner.trl import to_ppo_config

    def ckpt(**kw):
        c = to_ppo_config(GRPOConfig(output_dir="out", per_device_train_batch_size=8, num_generations=4, **kw), "m")
        return c.ckpt.save_steps, c.ckpt.keep_checkpoints

    assert ckpt(max_steps=4) == ckpt(max_steps=6) == (500, 0)  # TRL's save_steps 500; None keeps every checkpoint
    assert ckpt(max_steps=4, save_steps=2, save_total_limit=2) == (2, 2)
    assert ckpt(max_steps=4, save_total_limit=-1) == (500, 0)  # TRL: <= 0 deletes nothing


def test_training_args_bin_is_the_config_object_or_its_dict_when_it_does_not_pickle(tmp_path):
    from refit.learner.trl.checkpoints import save_args

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=4)
    save_args(args, tmp_path / "a.bin")
    assert torch.load(tmp_path / "a.bin", weights_only=False).max_steps == 4

    class Local(GRPOConfig):  # a script's own subclass inside a function: pickle cannot name it
        pass

    save_args(Local(output_dir=str(tmp_path), max_steps=6), tmp_path / "b.bin")
    got = torch.load(tmp_path / "b.bin", weights_only=False)
    assert isinstance(got, dict) and got["max_steps"] == 6 and got["output_dir"] == str(tmp_path)


def test_a_lora_runs_view_is_a_peft_adapter_folder(chat_model_dir, tmp_path):
    """A LoRA policy's checkpoint holds its adapter (as TRL's checkpoint of a PEFT model): PeftModel loads the view."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(chat_model_dir))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    save_checkpoint(tmp_path, 1, model, AutoTokenizer.from_pretrained(str(chat_model_dir)), None, opt, None,
                    {"kl_coef": 0.0}, keep=0)
    view = write_view(tmp_path, 1, _state(2), GRPOConfig(output_dir=str(tmp_path)))
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json"} <= set(os.listdir(view))
    assert not (view / "model.safetensors").exists()  # the adapter only, as TRL saves a PEFT model
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(chat_model_dir)), str(view))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)
