"""Held-out evaluation of a distillation run and its summary.

``eval/kl_to_teacher``: forward KL(teacher || student) per token, full vocabulary, at temperature 1,
on responses the teacher engine sampled once at setup for the held-out prompts; both sides in
PyTorch (teacher logits cached). ``eval/accuracy``: greedy exact match through the student engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from refit.learner.run.metrics import read_metrics
from refit.learner.run.policy import response_forward
from refit.rollout.types import RolloutBatch, SamplingParams


@dataclass
class EvalSet:
    """Held-out prompts, their teacher-sampled responses and the cached teacher logits."""

    pairs: list[tuple[str, str]]  # (prompt, reference answer)
    prompt_ids: list[list[int]]
    batch: RolloutBatch  # sampled by the teacher engine at setup
    teacher_logits: torch.Tensor  # (E, Tr, V) PyTorch teacher, temperature 1


def make_eval_set(cfg, teacher_engine, teacher_model, held, ids: list[list[int]], seq2seq: bool,
                  stop_ids: tuple[int, ...] = ()) -> EvalSet:
    """The held-out prompts' (``ids``: rendered, tokenized) teacher samples (temperature 1, fixed seed) and their
    cached teacher logits."""
    batch = teacher_engine.generate(ids, SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                                                        seed=cfg.run.seed * 1_000_003 + 977, stop_ids=stop_ids))
    with torch.no_grad():
        logits = response_forward(teacher_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                  seq2seq).logits.cpu()
    return EvalSet(pairs=list(held), prompt_ids=ids, batch=batch, teacher_logits=logits)



def exact_match(tok, batch, pairs: list[tuple[str, str]]) -> float:
    """Fraction of rows whose decoded response (stop token and padding removed) equals the answer."""
    stops, hits = batch.stop_set(), 0
    for (_, answer), ids, m in zip(pairs, batch.response_ids.tolist(), batch.response_mask.tolist()):
        hits += tok.decode([t for t, k in zip(ids, m) if k and t not in stops], skip_special_tokens=True).strip() \
            == answer.strip()
    return hits / max(len(pairs), 1)


def summary(run_dir: Path) -> dict:
    """Start/end held-out KL and accuracy, teacher passes per batch, throughput: from metrics.jsonl."""
    rows = read_metrics(run_dir)
    evals = [r for r in rows if r.get("eval/kl_to_teacher") is not None]
    train = [r for r in rows if r["step"] > 0]
    if not evals or not train:
        return {"run_dir": str(run_dir), "steps": train[-1]["step"] if train else 0}
    mean = lambda k: sum(r[k] for r in train) / len(train)  # noqa: E731
    gen = [r["student/tokens_per_s"] for r in train if r.get("student/tokens_per_s") is not None]
    return {"run_dir": str(run_dir), "steps": train[-1]["step"],
            "kl_start": evals[0]["eval/kl_to_teacher"], "kl_end": evals[-1]["eval/kl_to_teacher"],
            "accuracy_start": evals[0]["eval/accuracy"], "accuracy_end": evals[-1]["eval/accuracy"],
            "teacher_accuracy": next((r["eval/teacher_accuracy"] for r in rows if "eval/teacher_accuracy" in r), None),
            "teacher_passes_per_batch": mean("teacher/passes"), "max_teacher_passes": max(r["teacher/passes"]
                                                                                          for r in train),
            "student_generated_frac": mean("student/generated"),
            "student_tokens_per_s": evals[-1]["eval/student_tokens_per_s"],
            "student_tokens_per_s_onpolicy": sum(gen) / len(gen) if gen else None,
            "train_time_s": round(sum(r["time/step"] + r.get("time/eval", 0.0) for r in train), 2),
            "max_probe_diff": max((r.get("probe/max_abs_logprob_diff") or 0.0) for r in train)}
