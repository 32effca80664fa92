"""The learner half of a family-table row: 2 PPO steps and 2 distillation steps on an exported checkpoint
(refit/bench/families.py for the tiny families, refit/bench/real.py for the published geometries)."""

from __future__ import annotations

from pathlib import Path

from refit.learner.distill.config import DistillConfig
from refit.learner.distill.cycle import run_distill
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo
from refit.learner.run.metrics import read_metrics

# flat field names (refit.learner.run.config.from_flat maps them to their sections)
SMOKE = dict(steps=2, probe_size=4, progress=False, tensorboard=False, plots=False, save_steps=2, seed=0)


def _quiet(*_):
    pass


def ppo_smoke(rec: dict, root: Path, **overrides) -> dict:
    """Two PPO steps on the family's engine (a dense reward, so step 2's policy has moved); KL(0), the
    smallest and the last exact KL, the largest probe diff. ``overrides``: further flat config fields."""
    cfg = PPOConfig.from_flat(
        model_dir=rec["model_dir"], engine_dir=rec["engine_dir"], output_dir=str(root / "ppo"), batch_size=4,
        num_generations=2, advantage_estimator="gae", num_mini_batches=2, response_length=4, top_k=20, top_p=0.9,
        kl_estimator="exact",
        reward="refit.learner.builtin.tasks:length_reward", max_operand=9, num_prompts=32, **{**SMOKE, **overrides})
    rows = read_metrics(run_ppo(cfg, log=_quiet, overwrite=True))  # the bench's own folder, rerun
    return {"kl0": rows[0]["kl/exact"], "min_exact_kl": min(r["kl/exact"] for r in rows),
            "last_exact_kl": rows[-1]["kl/exact"],
            # pushes are checked on the next rollout (the last one on the probe batch): not every row has one
            "probe": max(r["probe/max_abs_logprob_diff"] for r in rows if "probe/max_abs_logprob_diff" in r),
            "steps": len(rows)}


def distill_smoke(rec: dict, root: Path, **overrides) -> dict:
    """Two distillation steps, the model its own teacher: held-out KL at step 0, the loss of each step."""
    cfg = DistillConfig.from_flat(
        teacher_model_dir=rec["model_dir"], student_model_dir=rec["model_dir"], teacher_engine_dir=rec["engine_dir"],
        student_engine_dir=rec["engine_dir"], output_dir=str(root / "distill"), batch_size=4, eval_size=4,
        num_prompts=32, max_new_tokens=4, teacher_topk=8, lmbda=0.5, eval_every=2, warmup_steps=0,
        **{**SMOKE, **overrides})
    rows = read_metrics(run_distill(cfg, log=_quiet, overwrite=True))
    steps = [r for r in rows if r["step"] > 0]
    return {"kl0": rows[0]["eval/kl_to_teacher"], "step1_loss": steps[0]["loss"],
            "probe": max(r["probe/max_abs_logprob_diff"] for r in steps), "steps": len(steps)}


def _run(stage, rec: dict, root: Path) -> dict | str:
    try:
        return stage(rec, root)
    except Exception as e:  # noqa: BLE001 - a failing family is a row of the table, not the end of the report
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
