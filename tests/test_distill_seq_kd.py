"""Sequence-level KD as TRL's ``GKDTrainer(seq_kd=True)`` computes it, for any ``beta`` and ``lmbda``.

TRL 1.16 (trl/experimental/gkd/gkd_trainer.py): ``training_step`` draws once, ``random() <= lmbda`` -> the student
generates, ``elif seq_kd`` -> the teacher generates; ``compute_loss`` then runs the teacher on those sequences and
takes ``generalized_jsd_loss`` (temperature 1) over the completion tokens. Refit takes the teacher's scores from
its generation pass (``return_topk=V``: every token's log-prob at each generated position) instead of a second
pass. Here: that loss equals TRL's formula written out below (value and gradient, 1e-6); the generation pass's
scores equal scoring again (the teacher engine's ``score`` and the PyTorch teacher's forward); the draws are TRL's.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from refit.learner.distill.batch import draws_student
from refit.learner.distill.cycle import distill_loss, make_batch, setup, teacher_targets, train_step
from refit.learner.run.policy import response_forward

from conftest import tiny_distill_config

QUIET = dict(log=lambda *_: None)
SAMPLING_T = 0.9  # TRL's GKDConfig default: generation at 0.9, the loss at 1
TOL = 1e-5  # the teacher's log-probs, generation pass against a second pass


def _u(cfg, step: int) -> float:
    """The step's draw, as the job derives it from (seed, step)."""
    return random.Random(cfg.run.seed * 1_000_003 + step).random()


@pytest.fixture(scope="module")
def run(model_dirs, engine_dirs, tmp_path_factory):
    cfg = tiny_distill_config(model_dirs, engine_dirs, tmp_path_factory.mktemp("seq_kd"), seq_kd=True, lmbda=0.5,
                              beta=0.5, loss="jsd", temperature=SAMPLING_T, loss_temperature=1.0, sync_every=1)
    return setup(cfg, resume=False, **QUIET)


@pytest.fixture(scope="module")
def teacher_batch(run):
    """A teacher-generated batch as the job makes it, and the teacher engine's raw generate() output."""
    step = next(s for s in range(100, 200) if _u(run.cfg, s) > run.cfg.lmbda)
    seen = []
    inner = run.teacher.inner.generate
    run.teacher.inner.generate = lambda *a, **k: seen.append(inner(*a, **k)) or seen[-1]
    try:
        b, _ = make_batch(run, step)
    finally:
        run.teacher.inner.generate = inner
    (out,) = seen
    assert b.source == "teacher" and out.sampling.return_topk == run.vocab_size == out.topk_ids.shape[-1]
    assert b.response_mask.sum() > b.num_rows  # some rows longer than one token
    return b, out


def trl_generalized_jsd(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                        beta: float) -> torch.Tensor:
    """TRL's ``generalized_jsd_loss`` (Agarwal et al. 2024, eq. 1), written out in probabilities, float64:
    P teacher, Q = softmax(student logits) (TRL's GKD loss: temperature 1), M = beta P + (1 - beta) Q;
    beta 0: KL(P||Q), beta 1: KL(Q||P), else beta KL(P||M) + (1 - beta) KL(Q||M); summed over the vocabulary,
    averaged over the completion tokens (``labels != -100``, reduction batchmean)."""
    log_q = torch.log_softmax(student_logits.double(), -1)
    log_p = teacher_logprobs.double()
    p, q = log_p.exp(), log_q.exp()
    if beta == 0:
        per = (p * (log_p - log_q)).sum(-1)
    elif beta == 1:
        per = (q * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        per = beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    keep = mask.bool()
    return per[keep].sum() / keep.sum()


def teacher_logprobs_at_1(out) -> torch.Tensor:
    """The teacher's log-probs at temperature 1 from its generate() output (every token, sorted by value, at the
    sampling temperature): put back in vocabulary order (the inverse permutation) and re-tempered."""
    at_t = out.topk_logprobs.double().gather(-1, out.topk_ids.argsort(-1))  # log softmax(z / T) in id order
    return torch.log_softmax(at_t * out.sampling.temperature, -1)  # log softmax(z)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_on_teacher_sequences_is_trls_generalized_jsd(run, teacher_batch, beta):
    b, out = teacher_batch
    with torch.no_grad():
        z = response_forward(run.student, b.prompt_ids, b.prompt_mask, b.response_ids, b.is_seq2seq).logits
    mine = z.clone().requires_grad_(True)
    loss, _ = distill_loss("jsd", mine, b, slice(None), beta, run.cfg.loss_temperature, b.response_mask.sum())
    loss.backward()
    ref_z = z.double().requires_grad_(True)
    ref = trl_generalized_jsd(ref_z, teacher_logprobs_at_1(out), out.response_mask, beta)
    ref.backward()
    assert float(ref.detach()) > 1e-3  # a real divergence (teacher and student differ)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mine.grad.double(), ref_z.grad, atol=1e-6, rtol=1e-6)


def test_a_step_on_teacher_sequences_trains_on_trls_loss_and_gradient(run, teacher_batch):
    """Through the student's parameters: the job's forward on the padded batch, against one unpadded row at a
    time (prompt + completion, the logits that predict each completion token), value and gradient (4 rows)."""
    b, out = teacher_batch
    rows = slice(0, 4)
    student = copy.deepcopy(run.student)
    z = response_forward(student, b.prompt_ids[rows], b.prompt_mask[rows], b.response_ids[rows], b.is_seq2seq).logits
    loss, _ = distill_loss("jsd", z, b, rows, 0.5, 1.0, b.response_mask[rows].sum())
    mine = torch.autograd.grad(loss, list(student.parameters()))
    logits, targets = [], []
    for i in range(4):
        p = b.prompt_ids[i][b.prompt_mask[i].bool()]
        n = int(b.response_mask[i].sum())
        ids = torch.cat([p, b.response_ids[i, :n]])[None]
        logits.append(student(input_ids=ids).logits[0, len(p) - 1: len(p) - 1 + n])
        targets.append(teacher_logprobs_at_1(out)[i, :n])
    z_ref = torch.cat(logits)[None]
    ref = trl_generalized_jsd(z_ref, torch.cat(targets)[None], torch.ones(z_ref.shape[:2]), 0.5)
    theirs = torch.autograd.grad(ref, list(student.parameters()))
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-6, rtol=1e-6)
    for g, r in zip(mine, theirs):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_generation_pass_scores_equal_scoring_again(run, teacher_batch):
    """The teacher's distributions taken from its generation pass (no second pass) against a second pass: the
    teacher engine's ``score`` of the same sequences (every token, temperature 1) and the PyTorch teacher's forward
    (the job's own route for batches it did not generate), to 1e-5 (measured 1e-6; the export gate's fp32 tolerance
    is 1e-4); and the loss."""
    b, _ = teacher_batch
    keep = b.response_mask.bool()
    reused = torch.log_softmax(b.teacher_logits, -1)[keep]  # loss temperature 1
    scored = run.teacher.inner.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, temperature=1.0,
                                     topk=run.vocab_size).topk_logprobs  # k = V: vocabulary order
    torch.testing.assert_close(reused, scored[keep], atol=TOL, rtol=0)
    again = copy.copy(b)
    again.teacher_logits = None
    assert teacher_targets(run.cfg, again, run.teacher_model, run.teacher) == 1  # one PyTorch teacher pass
    torch.testing.assert_close(reused, torch.log_softmax(again.teacher_logits, -1)[keep], atol=TOL, rtol=0)
    with torch.no_grad():
        z = response_forward(run.student, b.prompt_ids, b.prompt_mask, b.response_ids, b.is_seq2seq).logits
    n = b.response_mask.sum()
    torch.testing.assert_close(distill_loss("jsd", z, b, slice(None), 0.5, 1.0, n)[0],
                               distill_loss("jsd", z, again, slice(None), 0.5, 1.0, n)[0], atol=1e-5, rtol=0)


def test_lmbda_draws_as_trl(run):
    """One draw a step, ``u <= lmbda`` -> the student engine generates (and the PyTorch teacher scores), else the
    teacher engine generates and its pass is the only teacher pass; never the data set (TRL's elif order)."""
    u = _u(run.cfg, 7)
    assert draws_student(dataclasses.replace(run.cfg, lmbda=u), 7)  # <=, as TRL's random.random() <= self.lmbda
    steps = range(1, 4)  # seed 0: u = 0.134, 0.956, 0.238 -> student, teacher, student
    want = [_u(run.cfg, s) <= run.cfg.lmbda for s in steps]
    assert 0 < sum(want) < len(want)
    calls = {"student": 0, "teacher": 0, "torch": 0}
    for name, eng in (("student", run.student_engine), ("teacher", run.teacher.inner)):
        gen = eng.generate
        eng.generate = lambda *a, _g=gen, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _g(*a, **k)
    run.teacher_model.register_forward_hook(lambda *_: calls.__setitem__("torch", calls["torch"] + 1))
    for step, student in zip(steps, want):
        before = dict(calls)
        m = train_step(run, step)
        got = {k: calls[k] - before[k] for k in calls}
        assert got == ({"student": 1, "teacher": 0, "torch": 1} if student else
                       {"student": 0, "teacher": 1, "torch": 0}), (step, got)
        assert (m["student/generated"], m["batch/from_teacher"]) == (int(student), int(not student))
        assert m["teacher/passes"] == 1 and m["loss"] > 0
