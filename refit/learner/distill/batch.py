"""Distillation data: the examples, the teacher/student compatibility check, and step 1 and 2 of a step --
the batch's tokens (dataset, student engine or teacher engine) and the teacher's targets for the loss."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from refit.core.hf_folder import load_tokenizer, model_info
from refit.core.errors import RefitError
from refit.core.padding import check_left_padded, check_right_padded
from refit.learner.distill.config import DistillConfig
from refit.learner.builtin.tasks import TASKS
from refit.learner.run.dataset import check_jsonl, load_prompt_dataset


@dataclass
class DistillBatch:
    """One training batch, whichever source made it. Padding rule of :mod:`refit.rollout.types`."""

    prompt_ids: torch.Tensor  # (B, Tp) int64, left-padded (decoder-only) / native side (encoder-decoder)
    prompt_mask: torch.Tensor  # (B, Tp) int64
    response_ids: torch.Tensor  # (B, Tr) int64, right-padded with pad_id
    response_mask: torch.Tensor  # (B, Tr) float32, 1 up to and including the stop token
    source: str  # "dataset" | "student" | "teacher"
    is_seq2seq: bool
    teacher_topk_logprobs: torch.Tensor | None = None  # (B, Tr, k) teacher top-k log-probs at the loss temperature
    teacher_topk_ids: torch.Tensor | None = None  # (B, Tr, k) int64
    # (B, Tr, V) float32 teacher logits up to a constant per position (the loss takes their softmax): the PyTorch
    # teacher's (temperature 1), or in seq_kd the teacher engine's generation pass, log-probs x sampling temperature
    teacher_logits: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.prompt_ids.shape[0])

    def check(self) -> "DistillBatch":
        """Raise ValueError (one line) unless shapes and the padding rule hold; return self."""
        b, tr = self.response_ids.shape
        if self.prompt_mask.shape != self.prompt_ids.shape or self.prompt_ids.shape[0] != b \
                or self.response_mask.shape != (b, tr):
            raise ValueError(f"DistillBatch: prompt {tuple(self.prompt_ids.shape)}/{tuple(self.prompt_mask.shape)} "
                             f"and response {(b, tr)}/{tuple(self.response_mask.shape)} disagree")
        (check_right_padded if self.is_seq2seq else check_left_padded)(self.prompt_mask)
        check_right_padded(self.response_mask)
        for name in ("teacher_topk_logprobs", "teacher_topk_ids", "teacher_logits"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape[:2]) != (b, tr):
                raise ValueError(f"DistillBatch.{name}: expected leading dims {(b, tr)}, got {tuple(t.shape)}")
        return self


def _completion_text(c) -> str:
    """A completion cell as text: text as is, or the content of a list of (assistant) messages."""
    if isinstance(c, list):
        return "".join(str(m.get("content", "")) for m in c if isinstance(m, dict))
    return "" if c is None else str(c)


def dataset_examples(cfg: DistillConfig) -> tuple[list[tuple], list[tuple]]:
    """(train, held-out) (prompt, completion text) pairs of ``data.dataset`` (refit.learner.run.dataset)."""
    d = cfg.data
    train, held = load_prompt_dataset(d.dataset, d.dataset_split, d.dataset_text_field or d.prompt_column,
                                      d.eval_split, d.eval_fraction, cfg.run.seed)
    needed = cfg.lmbda < 1.0 and not cfg.seq_kd
    if cfg.completion_column not in train.columns and needed:
        raise RefitError(f"dataset {train.source} has no column {cfg.completion_column!r} (columns: "
                         f"{', '.join(train.columns) or 'none'}); supervised-KD batches need completions (set "
                         "completion_column, or lmbda=1 / seq_kd)")
    pairs = lambda ps: [(p, _completion_text(c)) for p, c in  # noqa: E731
                        zip(ps.prompts, ps.columns.get(cfg.completion_column, [None] * len(ps)))]
    if held is None:
        rows = pairs(train)
        return rows[:-cfg.eval_size] or rows, rows[-cfg.eval_size:]
    return pairs(train), pairs(held)


def load_examples(cfg: DistillConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) (prompt, completion) pairs; held-out prompts never appear in train. A prompt is text,
    or a list of chat messages when it comes from a ``dataset`` (rendered with the chat template by the caller)."""
    if cfg.data.dataset:
        return dataset_examples(cfg)
    if cfg.dataset_file:
        p = Path(cfg.dataset_file)
        if not p.exists():
            raise RefitError(f"dataset file {p} does not exist")

        rows = check_jsonl(p, "dataset file")
        if any("prompt" not in r or "completion" not in r for r in rows):
            raise RefitError(f"dataset file {p}: every line needs 'prompt' and 'completion'")
        pairs = [(r["prompt"], r["completion"]) for r in rows]
        held = pairs[-cfg.eval_size:]
    else:
        kw = {"max_operand": cfg.data.max_operand} if cfg.data.task == "addition" else {}
        examples = TASKS[cfg.data.task](cfg.data.num_prompts, seed=cfg.run.seed, **kw)
        pairs = list({e.prompt: (e.prompt, e.answer) for e in examples}.values())  # distinct, in draw order
        held = pairs[:cfg.eval_size]
    held_prompts = {p for p, _ in held}
    train = [pc for pc in pairs if pc[0] not in held_prompts]
    if not train:
        raise RefitError(f"no training examples left after holding out {len(held)} prompts "
                         f"({len(pairs)} distinct); lower eval_size or add data")
    return train, held


def check_teacher_student(teacher_dir: str, student_dir: str):
    """One RefitError line unless teacher and student share kind, vocabulary size and tokenizer."""
    if not teacher_dir or not student_dir:
        raise RefitError("teacher_model_dir and student_model_dir are both required (or neither: embedded default)")
    t, s = model_info(teacher_dir), model_info(student_dir)
    if t.vocab_size != s.vocab_size:
        raise RefitError(f"teacher/student vocabulary mismatch: teacher vocab_size {t.vocab_size} ({teacher_dir}) "
                         f"!= student vocab_size {s.vocab_size} ({student_dir}); logit distillation needs one "
                         "vocabulary")
    if t.kind != s.kind or t.padding_side != s.padding_side:
        raise RefitError(f"teacher is {t.kind} ({t.padding_side}-padded prompts), student is {s.kind} "
                         f"({s.padding_side}-padded): distillation here needs one model kind")
    t_tok, s_tok = load_tokenizer(teacher_dir, t), load_tokenizer(student_dir, s)
    if t_tok.get_vocab() != s_tok.get_vocab():
        raise RefitError(f"teacher and student tokenizers differ ({teacher_dir} vs {student_dir}): token ids "
                         "would not mean the same thing")
    return t, s, s_tok



def draws_student(cfg: DistillConfig, step: int) -> bool:
    """GKD's coin, drawn as TRL's ``GKDTrainer.training_step`` draws it: ``u <= lmbda`` -> the student generates,
    else (``elif seq_kd``) the teacher does, else the data set's completion; one draw a step, ``u`` a pure function
    of (seed, step)."""
    return random.Random(cfg.run.seed * 1_000_003 + step).random() <= cfg.lmbda


def logits_from_generation(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The teacher's full distributions from its generation pass, as logits for the loss.

    ``topk_logprobs`` / ``topk_ids`` (B, Tr, V): the engine's ``return_topk=V`` output, every token's
    ``log_softmax(z / temperature)`` sorted by value, with its id. Returns (B, Tr, V) float32 in vocabulary order,
    ``log_softmax(z / temperature) * temperature = z - temperature * log Z``: the logits ``z`` shifted by a constant
    per position, so ``softmax(. / T)`` of it is the teacher's distribution at any loss temperature ``T``, as a
    second teacher pass would give it. Masked positions (log-probs 0, ids pad) come out finite.
    """
    b, tr, k = topk_ids.shape
    out = torch.zeros(b, tr, k, dtype=torch.float32)
    return out.scatter_(-1, topk_ids, topk_logprobs.float()).mul_(temperature)
