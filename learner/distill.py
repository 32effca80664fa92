"""The distillation cycle: supervised KD, sequence-level KD and on-policy GKD, generation on engines.

    export (or reuse) a teacher engine and a student engine; check one shared vocabulary
    -> every step s: 1. batch tokens, by a seeded draw u_s ~ U[0, 1) from (seed, s):
                        u_s < lmbda  -> "student": the STUDENT ENGINE samples responses (on-policy, GKD)
                        else seq_kd  -> "teacher": the TEACHER ENGINE samples responses with
                                        ``return_topk=teacher_topk`` (Kim & Rush 2016)
                        else         -> "dataset": prompt + completion from the data set (supervised KD)
                     2. teacher targets, exactly ONE teacher pass per batch (logged as ``teacher/passes``):
                        topk_kl: the teacher engine's top-k log-probs, from ``score(topk=k)`` -- or, in
                                 seq_kd, from the generation pass itself (no second pass);
                        ce:      the teacher's tokens themselves (seq_kd only, lmbda=0);
                        jsd / forward_kl / reverse_kl: full-vocabulary teacher logits from the PyTorch
                                 teacher (an engine returns log-probs of given tokens and a top-k, never
                                 the full (B, T, V) logits), hence not combinable with seq_kd
                     3. loss on the PyTorch student's logits (learner.distill_losses), one AdamW step
                     4. every ``sync_every`` steps push the student weights into the student engine and
                        score a fixed probe batch on both sides (stop on disagreement, as in PPO)
                     5. every ``eval_every`` steps: held-out KL to the teacher and task accuracy
                     6. checkpoint every ``save_steps`` steps (atomic); metrics.jsonl / TensorBoard

Held-out KL (``eval/kl_to_teacher``): forward KL(teacher || student) per token, full vocabulary, at
temperature 1 (the models' own distributions), on responses the teacher engine sampled once at
setup (temperature 1, fixed seed) for ``eval_size`` held-out prompts; both sides in PyTorch
(teacher logits computed once and cached, student logits at each evaluation), masked token mean.
Accuracy (``eval/accuracy``): greedy exact match through the student engine on the same prompts.

Departures from TRL's GKDTrainer: seq_kd draws its tokens and the top-k targets from ONE teacher
generation pass (TRL generates, then runs the teacher again); ``loss=ce`` is the paper's SeqKD
(cross-entropy on teacher tokens), not JSD; the student samples from an engine whose weights lag
by at most ``sync_every - 1`` updates. Every random choice of step s is derived from
``(seed, s)``, so ``--resume`` reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from export.checkpoint import load_model, load_tokenizer, model_info
from export.errors import RefitError
from export.padding import check_left_padded, check_right_padded, pad_batch
from export.weight_map import canonical_params
from learner import distill_losses as D
from learner import losses as L
from learner.checkpoint import latest_checkpoint, resume_latest, save_checkpoint
from learner.config import FULL_VOCAB_LOSSES, DistillConfig, save_config
from learner.cycle import ensure_engine, make_engine, pick_device, step_prompt_indices
from learner.distributed import DistContext, init_from_env, reduce_stats
from learner.metrics import MetricsLog, plot_metrics, read_metrics
from learner.policy import response_forward
from learner.ppo import learner_view
from rollout.engine import check_version
from rollout.types import SamplingParams

PLOT_PANELS = {"loss": ["loss"], "held-out KL to teacher": ["eval/kl_to_teacher"], "accuracy": ["eval/accuracy"],
               "batch source, teacher passes": ["teacher/passes", "student/generated", "batch/from_teacher"],
               "time per phase (s)": ["time/batch", "time/teacher", "time/update", "time/weight_push"]}


@dataclass
class DistillBatch:
    """One training batch, whichever source made it. Padding rule of :mod:`rollout.types`."""

    prompt_ids: torch.Tensor  # (B, Tp) int64, left-padded (decoder-only) / native side (T5)
    prompt_mask: torch.Tensor  # (B, Tp) int64
    response_ids: torch.Tensor  # (B, Tr) int64, right-padded with pad_id
    response_mask: torch.Tensor  # (B, Tr) float32, 1 up to and including the stop token
    source: str  # "dataset" | "student" | "teacher"
    is_seq2seq: bool
    teacher_topk_logprobs: torch.Tensor | None = None  # (B, Tr, k) teacher top-k log-probs at the loss temperature
    teacher_topk_ids: torch.Tensor | None = None  # (B, Tr, k) int64
    teacher_logits: torch.Tensor | None = None  # (B, Tr, V) float32 PyTorch teacher logits (temperature 1)

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


class CountingEngine:
    """An Engine (composition) that counts ``generate`` and ``score`` calls: the teacher-pass counter."""

    def __init__(self, inner):
        self.inner, self.generate_calls, self.score_calls = inner, 0, 0

    def generate(self, prompts, sampling):
        self.generate_calls += 1
        return self.inner.generate(prompts, sampling)

    def score(self, *args, **kw):
        self.score_calls += 1
        return self.inner.score(*args, **kw)

    def __getattr__(self, name):  # update_weights, weights_version, close: the inner engine's own
        return getattr(self.inner, name)


@dataclass
class EvalSet:
    """Held-out prompts, their teacher-sampled responses and the cached teacher logits."""

    pairs: list[tuple[str, str]]  # (prompt, reference answer)
    prompt_ids: list[list[int]]
    batch: object  # RolloutBatch sampled by the teacher engine at setup
    teacher_logits: torch.Tensor  # (E, Tr, V) PyTorch teacher, temperature 1


@dataclass
class Run:
    """Everything the cycle holds (built by :func:`setup`)."""

    cfg: DistillConfig
    run_dir: Path
    tok: object
    student: torch.nn.Module  # trained, PyTorch
    teacher_model: torch.nn.Module | None  # PyTorch teacher; kept only for full-vocabulary losses
    student_engine: object
    teacher: CountingEngine  # the teacher ENGINE
    optimizer: torch.optim.Optimizer
    scheduler: object
    prompt_ids: list[list[int]]  # training prompts
    completion_ids: list[list[int]]  # training completions + EOS
    eval: EvalSet
    is_seq2seq: bool
    pad_id: int
    prompt_side: str
    start_step: int = 0
    expected_version: int = 0
    probe: object = None
    dist: DistContext = field(default_factory=DistContext)  # [dist] this process's rank (torchrun); 1 = plain


# ----------------------------------------------------------------------------- data and checks


def load_examples(cfg: DistillConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) (prompt, completion) pairs; held-out prompts never appear in train."""
    if cfg.dataset_file:
        p = Path(cfg.dataset_file)
        if not p.exists():
            raise RefitError(f"dataset file {p} does not exist")
        rows = [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
        if any("prompt" not in r or "completion" not in r for r in rows):
            raise RefitError(f"dataset file {p}: every line needs 'prompt' and 'completion'")
        pairs = [(r["prompt"], r["completion"]) for r in rows]
        held = pairs[-cfg.eval_size:]
    else:
        from learner.tasks import TASKS

        kw = {"max_operand": cfg.max_operand} if cfg.task == "addition" else {}
        examples = TASKS[cfg.task](cfg.num_prompts, seed=cfg.seed, **kw)
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


def _engine(cfg: DistillConfig, model_dir: str, engine_dir: str, name: str, rows: int, max_len: int, log):
    """The teacher's or the student's engine; with ``rollout_workers > 1`` a RayEnginePool of that many."""
    run_dir = Path(cfg.output_dir)
    if cfg.backend == "torch":
        return make_engine(cfg, model_dir, run_dir, gpu_share=0.5, max_len=max_len)
    path = Path(engine_dir) if engine_dir else run_dir / f"{name}_engine"
    ensure_engine(Path(model_dir), path, rows, max_len, log, backend=cfg.backend)
    return make_engine(cfg, path, run_dir, gpu_share=0.5, threads=cfg.engine_threads or None)


# ----------------------------------------------------------------------------- setup


def _eval_set(cfg: DistillConfig, tok, teacher_engine, teacher_model, held, seq2seq: bool) -> EvalSet:
    ids = [tok(p, add_special_tokens=False).input_ids for p, _ in held]
    batch = teacher_engine.generate(ids, SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                                                        seed=cfg.seed * 1_000_003 + 977))
    with torch.no_grad():
        logits = response_forward(teacher_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                  seq2seq).logits.cpu()
    return EvalSet(list(held), ids, batch, logits)


def setup(cfg: DistillConfig, resume: bool, log=print, dist: DistContext | None = None) -> Run:
    """Engines, models, optimizer, eval set and probe. Ranks > 0 of a torchrun job hold only the student
    and its optimizer: rank 0 makes every batch (engines, teacher) and shares it."""
    from transformers import get_scheduler

    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_info, s_info, tok = check_teacher_student(cfg.teacher_model_dir, cfg.student_model_dir)
    train, held = load_examples(cfg)
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p, _ in train]
    completion_ids = [tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id] for _, c in train]
    if any(len(p) == 0 for p in prompt_ids) or any(not p for p, _ in held):
        raise RefitError("a prompt tokenizes to nothing (empty prompt)")
    eval_ids = [tok(p, add_special_tokens=False).input_ids for p, _ in held]
    max_len = max(len(p) for p in prompt_ids + eval_ids) + cfg.max_new_tokens + 8
    rows = max(cfg.batch_size, cfg.eval_size, cfg.probe_size)
    dist = dist or DistContext()
    device = dist.device or pick_device(cfg.device)
    seq2seq = s_info.kind == "seq2seq"
    if not dist.is_main:  # [dist] the student, its optimizer and schedule; no engines, no teacher
        student = load_model(cfg.student_model_dir, s_info).to(device)
        optimizer, scheduler = _optimizer(cfg, student, get_scheduler)
        run = Run(cfg, run_dir, tok, student, None, None, None, optimizer, scheduler, prompt_ids, completion_ids,
                  None, seq2seq, s_info.pad_id, s_info.padding_side, dist=dist)
        if resume:
            run.start_step = resume_latest(run_dir, student, None, optimizer, scheduler)[1]["step"]
        dist.wrap(student)
        return run
    teacher_engine = CountingEngine(_engine(cfg, cfg.teacher_model_dir, cfg.teacher_engine_dir, "teacher", rows,
                                            max_len, log))
    student_engine = _engine(cfg, cfg.student_model_dir, cfg.student_engine_dir, "student", rows, max_len, log)
    teacher_model = load_model(cfg.teacher_model_dir, t_info).to(device).requires_grad_(False)
    eval_set = _eval_set(cfg, tok, teacher_engine, teacher_model, held, seq2seq)
    teacher_engine.generate_calls = 0  # the eval set is drawn once; the counters are per training batch
    student = load_model(cfg.student_model_dir, s_info).to(device)
    optimizer, scheduler = _optimizer(cfg, student, get_scheduler)
    run = Run(cfg, run_dir, tok, student, teacher_model if cfg.loss in FULL_VOCAB_LOSSES else None, student_engine,
              teacher_engine, optimizer, scheduler, prompt_ids, completion_ids, eval_set, seq2seq, s_info.pad_id,
              s_info.padding_side, dist=dist)
    if resume:
        ck, state = resume_latest(run_dir, student, None, optimizer, scheduler)
        run.start_step = state["step"]
        student_engine.update_weights(canonical_params(student)[0])
        log(f"refit distill: resumed from {ck} (step {run.start_step}, student engine weights pushed)")
    dist.wrap(student)  # [dist] DDP (a no-op for one process)
    run.expected_version = student_engine.weights_version
    probe_rows = prompt_ids[:min(cfg.probe_size, len(prompt_ids))]
    run.probe = student_engine.generate(probe_rows, SamplingParams(max_new_tokens=cfg.max_new_tokens, greedy=True))
    return run


def _optimizer(cfg: DistillConfig, student, get_scheduler):
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return optimizer, get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps,
                                    num_training_steps=cfg.steps)


# ----------------------------------------------------------------------------- one step


def draws_student(cfg: DistillConfig, step: int) -> bool:
    """GKD's coin: True with probability lmbda, a pure function of (seed, step)."""
    return random.Random(cfg.seed * 1_000_003 + step).random() < cfg.lmbda


def dataset_batch(run: Run, idx: list[int]) -> DistillBatch:
    ids, mask = pad_batch([run.prompt_ids[i] for i in idx], run.pad_id, run.prompt_side)
    resp, rmask = pad_batch([run.completion_ids[i][:run.cfg.max_new_tokens] for i in idx], run.pad_id, "right")
    return DistillBatch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(resp),
                        torch.from_numpy(rmask).float(), "dataset", run.is_seq2seq)


def make_batch(run: Run, step: int) -> tuple[DistillBatch, dict[str, float]]:
    """Step 1: the batch's tokens (and, from a teacher generation, its top-k); generation stats."""
    cfg = run.cfg
    idx = step_prompt_indices(len(run.prompt_ids), cfg.batch_size, step, cfg.seed)
    prompts = [run.prompt_ids[i] for i in idx]
    seed = cfg.seed * 1_000_003 + step
    t0 = time.perf_counter()
    if draws_student(cfg, step):
        out = run.student_engine.generate(prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                                  temperature=cfg.temperature, seed=seed))
        check_version(out, run.expected_version)
        source = "student"
    elif cfg.seq_kd:
        out = run.teacher.generate(prompts, SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                           temperature=cfg.temperature, seed=seed,
                                                           return_topk=cfg.teacher_topk))
        source = "teacher"
    else:
        return dataset_batch(run, idx), {}
    dt = time.perf_counter() - t0
    batch = DistillBatch(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, source,
                         out.is_seq2seq, out.topk_logprobs, out.topk_ids)
    return batch, {f"{source}/tokens_per_s": float(out.response_mask.sum()) / max(dt, 1e-9)}


def teacher_targets(run: Run, b: DistillBatch) -> int:
    """Step 2: fill the teacher side of ``b`` for the configured loss; return the PyTorch teacher passes."""
    cfg = run.cfg
    if cfg.loss in FULL_VOCAB_LOSSES:
        with torch.no_grad():
            b.teacher_logits = response_forward(run.teacher_model, b.prompt_ids, b.prompt_mask, b.response_ids,
                                                b.is_seq2seq).logits.cpu()
        return 1
    if cfg.loss == "topk_kl" and b.teacher_topk_logprobs is None:
        r = run.teacher.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                              temperature=cfg.loss_temperature, topk=cfg.teacher_topk)
        b.teacher_topk_logprobs, b.teacher_topk_ids = r.topk_logprobs, r.topk_ids
    return 0


def distill_loss(loss: str, logits: torch.Tensor, b: DistillBatch, rows: slice, beta: float, temperature: float,
                 n_tokens: torch.Tensor):
    """Dispatch to :mod:`learner.distill_losses`; ``logits`` (b, Tr, V) are the student's at temperature 1."""
    dev = logits.device
    m, ids = b.response_mask[rows].to(dev), b.response_ids[rows].to(dev)
    if loss == "ce":
        return D.teacher_token_ce_loss(logits, ids, m, temperature, num_tokens=n_tokens)
    if loss == "topk_kl":
        return D.topk_kl_loss(logits, b.teacher_topk_logprobs[rows].to(dev), b.teacher_topk_ids[rows].to(dev), m,
                              temperature, num_tokens=n_tokens)
    t = b.teacher_logits[rows].to(dev)
    if loss == "jsd":
        return D.generalized_jsd_loss(logits, t, m, beta, temperature, num_tokens=n_tokens)
    fn = D.forward_kl_loss if loss == "forward_kl" else D.reverse_kl_loss
    return fn(logits, t, m, temperature, num_tokens=n_tokens)


LOSS_STATS = ("jsd", "forward_kl", "reverse_kl", "teacher_token_ce", "topk_kl")  # token sums / global count


def update(run: Run, b: DistillBatch) -> dict[str, float]:
    """Step 3: one optimizer step over ``gradient_accumulation_steps`` micro-batches (token mean of the batch).

    Under torchrun (K ranks, every rank holding the whole batch ``b``) rank r runs rows
    ``[r*B/K, (r+1)*B/K)``: losses are normalised by the batch's token count as in one process, and
    multiplied by K before ``backward`` because DDP averages gradients; so the synced gradient, the
    clipping and the optimizer step are those of one process. Loss-like stats (token sums) are added
    over micro-batches and ranks, the others (accuracies, tail masses) averaged.
    """
    cfg, ctx = run.cfg, run.dist
    k, ga = ctx.world_size, cfg.gradient_accumulation_steps
    if b.num_rows % (k * ga):
        raise RefitError(f"batch of {b.num_rows} rows must be divisible by world_size {k} x "
                         f"gradient_accumulation_steps {ga}")
    local = b.num_rows // k
    micro = local // ga
    model = ctx.policy_ddp if ctx.enabled else run.student
    n_tokens = b.response_mask.sum().clamp(min=1.0)  # the whole batch's: every rank holds it
    # the student stays in eval mode: no dropout, as TRL's disable_dropout=True (and the engine has none)
    run.optimizer.zero_grad(set_to_none=True)
    total, acc = 0.0, {}
    for a in range(ga):
        rows = slice(ctx.rank * local + a * micro, ctx.rank * local + (a + 1) * micro)
        with ctx.no_sync(a == ga - 1):  # gradient sync on the last micro-batch (nothing for one process)
            logits = response_forward(model, b.prompt_ids[rows], b.prompt_mask[rows], b.response_ids[rows],
                                      b.is_seq2seq).logits
            loss, stats = distill_loss(cfg.loss, logits, b, rows, cfg.beta, cfg.loss_temperature, n_tokens)
            (loss * k).backward()
        total += float(loss.detach())
        if b.teacher_topk_logprobs is not None and cfg.loss != "topk_kl":  # free diagnostic from the same pass
            stats["teacher_topk_kl"] = D.topk_kl_loss(logits.detach(), b.teacher_topk_logprobs[rows],
                                                      b.teacher_topk_ids[rows], b.response_mask[rows],
                                                      cfg.temperature)[0]
        for key, v in stats.items():
            acc.setdefault(key, []).append(float(v))
    stats = {f"distill/{key}": sum(v) if key in LOSS_STATS else sum(v) / len(v) for key, v in acc.items()}
    stats = reduce_stats(ctx, {"loss": total, **stats}, sums=("loss", *(f"distill/{x}" for x in LOSS_STATS)))
    grad_norm = torch.nn.utils.clip_grad_norm_(run.student.parameters(), cfg.max_grad_norm)
    total = stats["loss"]  # the same on every rank, so every rank stops together
    if total != total or total in (float("inf"), float("-inf")) or not torch.isfinite(grad_norm):
        raise RefitError(f"non-finite loss or gradient ({total}, grad norm {float(grad_norm)}); nothing from this "
                         f"step was saved, last checkpoint: {latest_checkpoint(run.run_dir)}")
    run.optimizer.step()
    run.scheduler.step()
    return {**stats, "grad_norm": float(grad_norm), "lr": run.scheduler.get_last_lr()[0]}


def probe_check(run: Run) -> float:
    """Score the fixed probe batch on the student engine and the learner; stop the run on disagreement."""
    p = run.probe
    eng = run.student_engine.score(p.prompt_ids, p.prompt_mask, p.response_ids, p.response_mask).logprobs
    mine = learner_view(run.student, None, p, 1.0)[0]
    diff = float(((eng - mine).abs() * p.response_mask).max())
    if not diff <= run.cfg.probe_tol:
        raise RefitError(f"parity probe failed after weight push (student engine weights_version "
                         f"{run.student_engine.weights_version}): max |logprob diff| {diff:.3e} > "
                         f"{run.cfg.probe_tol:g}; the engine did not take the new weights. Last checkpoint: "
                         f"{latest_checkpoint(run.run_dir)}")
    return diff


def train_step(run: Run, step: int) -> dict[str, float]:
    """One batch, one teacher pass, one update, and the weight push when due; returns the step's metrics."""
    cfg = run.cfg
    if not run.dist.is_main:  # [dist] ranks > 0: rank 0's batch, this rank's rows of the update, no metrics
        update(run, run.dist.share(None))
        return {}
    g0, s0 = run.teacher.generate_calls, run.teacher.score_calls
    t0 = time.perf_counter()
    b, gen_stats = make_batch(run, step)
    t1 = time.perf_counter()
    torch_passes = teacher_targets(run, b.check())
    t2 = time.perf_counter()
    stats = update(run, run.dist.share(b))  # [dist] the batch to ranks > 0 (no-op for one process)
    t3 = time.perf_counter()
    if step % cfg.sync_every == 0 or step == cfg.steps:
        run.student_engine.update_weights(canonical_params(run.student)[0])
        run.expected_version = run.student_engine.weights_version
        stats["probe/max_abs_logprob_diff"] = probe_check(run)
    t4 = time.perf_counter()
    gen, score = run.teacher.generate_calls - g0, run.teacher.score_calls - s0
    tokens = float(b.response_mask.sum())
    return {**stats, **gen_stats, "teacher/passes": gen + score + torch_passes, "teacher/engine_generate": gen,
            "teacher/engine_score": score, "teacher/torch_forward": torch_passes,
            "student/generated": int(b.source == "student"), "batch/from_teacher": int(b.source == "teacher"),
            "response/length": tokens / b.num_rows, "engine/weights_version": run.student_engine.weights_version,
            "time/batch": t1 - t0, "time/teacher": t2 - t1, "time/update": t3 - t2, "time/weight_push": t4 - t3,
            "tokens_per_s": tokens / max(t4 - t0, 1e-9), "time/step": t4 - t0}


# ----------------------------------------------------------------------------- evaluation and the loop


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out forward KL(teacher || student) (PyTorch, full vocab, T=1) and greedy accuracy (student engine)."""
    t0 = time.perf_counter()
    e = run.eval
    s_logits = response_forward(run.student, e.batch.prompt_ids, e.batch.prompt_mask, e.batch.response_ids,
                                run.is_seq2seq).logits.cpu()
    kl = L.exact_kl_from_logits(e.teacher_logits, s_logits, e.batch.response_mask)
    t1 = time.perf_counter()
    out = run.student_engine.generate(e.prompt_ids, SamplingParams(max_new_tokens=run.cfg.max_new_tokens,
                                                                   greedy=True))
    dt = time.perf_counter() - t1
    return {"eval/kl_to_teacher": float(L.masked_mean(kl, e.batch.response_mask)),
            "eval/accuracy": exact_match(run.tok, out, e.pairs),
            "eval/student_tokens_per_s": float(out.response_mask.sum()) / max(dt, 1e-9),
            "time/eval": time.perf_counter() - t0}


def exact_match(tok, batch, pairs: list[tuple[str, str]]) -> float:
    """Fraction of rows whose decoded response (stop token and padding removed) equals the answer."""
    stops, hits = batch.stop_set(), 0
    for (_, answer), ids, m in zip(pairs, batch.response_ids.tolist(), batch.response_mask.tolist()):
        hits += tok.decode([t for t, k in zip(ids, m) if k and t not in stops], skip_special_tokens=True).strip() \
            == answer.strip()
    return hits / max(len(pairs), 1)


def teacher_accuracy(run: Run) -> float:
    """Greedy exact match of the teacher engine on the held-out prompts (not a training pass; not counted)."""
    out = run.teacher.inner.generate(run.eval.prompt_ids, SamplingParams(max_new_tokens=run.cfg.max_new_tokens,
                                                                         greedy=True))
    return exact_match(run.tok, out, run.eval.pairs)


def run_distill(cfg: DistillConfig, resume: bool = False, log=print) -> Path:
    """Run the cycle; return the run folder (metrics.jsonl, tb/, curves.png, checkpoints/, summary.json).

    Under ``torchrun --nproc-per-node K`` rank 0 drives the engines and the teacher, evaluates, pushes
    weights and writes metrics, checkpoints, plots and the summary; every rank runs its rows of each update.
    """
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dist = init_from_env(cfg.device)  # [dist] torchrun's RANK/WORLD_SIZE; one process: nothing changes
    main = dist.is_main
    if main:
        log("refit distill: resolved config\n" + save_config(cfg, run_dir / "config.yaml").rstrip())
    t_start = time.perf_counter()
    run = setup(cfg, resume, log, dist=dist)
    metrics = MetricsLog(run_dir, cfg.tensorboard, resume_step=run.start_step if resume else None) if main else None
    if main and not resume:
        metrics.log(0, {**evaluate(run), "eval/teacher_accuracy": teacher_accuracy(run)})
    last = cfg.steps if not cfg.max_steps_this_run else min(cfg.steps, run.start_step + cfg.max_steps_this_run)
    bar = None
    if cfg.progress and main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=run.start_step, desc="distill", dynamic_ncols=True)
    try:
        for step in range(run.start_step + 1, last + 1):
            m = train_step(run, step)
            if not main:  # [dist]
                continue
            if step % cfg.eval_every == 0 or step == cfg.steps:
                m.update(evaluate(run))
            metrics.log(step, m)
            if step % cfg.save_steps == 0 or step == cfg.steps:
                save_checkpoint(run_dir, step, run.student, run.tok, None, run.optimizer, run.scheduler,
                                {"data_position": step * cfg.batch_size,
                                 "engine_weights_version": run.student_engine.weights_version}, cfg.keep_checkpoints)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", src=("student", "teacher", "data")[
                    0 if m["student/generated"] else 1 if m["batch/from_teacher"] else 2])
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        # the student's engine first: with rollout_workers > 1 the teacher's pool (made first) owns Ray
        for engine in (run.student_engine, run.teacher):
            if engine is not None:
                engine.close()
        dist.close()  # [dist] waits for every rank, leaves the process group
    if not main:
        return run_dir
    if cfg.plots:
        plot_metrics(run_dir, PLOT_PANELS)
    s = summary(run_dir)
    s["wall_s_this_process"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=1))
    return run_dir


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
