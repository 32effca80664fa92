"""The distillation cycle: supervised KD, sequence-level KD and on-policy GKD, generation on engines.

    export (or reuse) a teacher engine and a student engine; check one shared vocabulary
    -> every step s: 1. batch tokens, by a seeded draw u_s ~ U[0, 1) from (seed, s), in the order of TRL's
                        GKDTrainer.training_step (one draw; the teacher never generates on a student step):
                        u_s <= lmbda -> "student": the STUDENT ENGINE samples responses (on-policy, GKD)
                        elif seq_kd  -> "teacher": the TEACHER ENGINE samples responses (Kim & Rush 2016) and
                                        returns its scores from the same pass: every token's log-prob at each
                                        generated position (return_topk=V) for jsd / forward_kl / reverse_kl,
                                        its top-k (return_topk=teacher_topk) for topk_kl
                        else         -> "dataset": prompt + completion from the data set (supervised KD)
                     2. teacher targets, exactly ONE teacher pass per batch (logged as ``teacher/passes``):
                        topk_kl: the teacher engine's top-k log-probs, from ``score(topk=k)`` -- or, in
                                 seq_kd, from the generation pass itself (no second pass);
                        ce:      the teacher's tokens themselves (seq_kd only, lmbda=0);
                        jsd / forward_kl / reverse_kl: full-vocabulary teacher logits: on a teacher batch the
                                 generation pass's (log-probs x sampling temperature = logits up to a constant
                                 per position, so any loss temperature is exact; no second pass), otherwise
                                 from the PyTorch teacher's forward
                     3. loss on the PyTorch student's logits (refit.learner.losses.distill), one AdamW step
                     4. every ``sync_every`` steps push the student weights into the student engine and
                        score a fixed probe batch on both sides (stop on disagreement, as in PPO)
                     5. every ``eval_every`` steps: held-out KL to the teacher and task accuracy
                     6. checkpoint every ``save_steps`` steps (atomic); metrics.jsonl / TensorBoard

Held-out KL (``eval/kl_to_teacher``): forward KL(teacher || student) per token, full vocabulary, at
temperature 1 (the models' own distributions), on responses the teacher engine sampled once at
setup (temperature 1, fixed seed) for ``eval_size`` held-out prompts; both sides in PyTorch
(teacher logits computed once and cached, student logits at each evaluation), masked token mean.
Accuracy (``eval/accuracy``): greedy exact match through the student engine on the same prompts.

Departures from TRL's GKDTrainer: seq_kd takes its tokens and the teacher's scores from ONE teacher
generation pass (TRL generates, then runs the teacher again on the same sequences: the same numbers, up to the
engine's parity with PyTorch); ``loss=ce`` is the paper's SeqKD
(cross-entropy on teacher tokens), not JSD; the student samples from an engine whose weights lag
by at most ``sync_every - 1`` updates. Every random choice of step s is derived from
``(seed, s)``, so ``--resume`` reproduces the uninterrupted run.
"""


from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from refit.core.hf_folder import LEARNER_ATTN, load_model
from refit.core.errors import RefitError
from refit.core.padding import pad_batch
from refit.learner import losses as D
from refit.learner.distill.batch import (DistillBatch, check_teacher_student, draws_student, load_examples,
                                        logits_from_generation)
from refit.learner.distill.config import FULL_VOCAB_LOSSES, DistillConfig
from refit.learner.distill.evaluate import EvalSet, exact_match, make_eval_set, summary
from refit.learner.run.activations import learner_kernels
from refit.learner.run.chat import encode_prompts, end_of_turn_ids, stop_ids_of
from refit.learner.run.checkpoint import resume_latest, save_checkpoint
from refit.learner.run.data import prompt_indices
from refit.learner.run.distributed import DistContext, reduce_stats
from refit.learner.run.engines import CountingEngine, engine_for_model, pick_device
from refit.learner.run.lora import apply_lora
from refit.learner.run.precision import autocast as precision_autocast, settle_precision
from refit.learner.run.final import write_final
from refit.learner.run.optim import adamw, neftune, schedule
from refit.learner.run.loop import Job, StepHooks, check_finite, due, run_job
from refit.learner.run.policy import response_forward
from refit.learner.run.sync import Contract, WeightSync, make_probe, push_checkpoint
from refit.rollout.engine import Engine
from refit.rollout.types import SamplingParams

PLOT_PANELS = {"loss": ["loss"], "held-out KL to teacher": ["eval/kl_to_teacher"], "accuracy": ["eval/accuracy"],
               "batch source, teacher passes": ["teacher/passes", "student/generated", "batch/from_teacher"],
               "time per phase (s)": ["time/batch", "time/teacher", "time/update", "time/weight_push"]}


@dataclass
class Run:
    """Everything the cycle holds (built by :func:`setup`)."""

    cfg: DistillConfig
    run_dir: Path
    tok: PreTrainedTokenizerBase
    student: torch.nn.Module  # trained, PyTorch
    teacher_model: torch.nn.Module | None  # PyTorch teacher; kept only for full-vocabulary losses
    student_engine: Engine | None  # None on ranks > 0 of a torchrun job
    teacher: CountingEngine | None  # the teacher ENGINE; None on ranks > 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    prompt_ids: list[list[int]]  # training prompts
    completion_ids: list[list[int]]  # training completions + EOS
    eval: EvalSet | None  # None on ranks > 0
    is_seq2seq: bool
    pad_id: int
    prompt_side: str
    start_step: int = 0
    data_position: int = 0  # prompts consumed so far (the next step starts at this one)
    sync: WeightSync | None = None  # the student engine's pushes and their checks (rank 0; refit.learner.run.sync)
    stop_ids: tuple[int, ...] = ()  # the chat template's end-of-turn token(s): generation stops there too
    vocab_size: int = 0  # the teacher's (and student's) vocabulary: seq_kd's full-vocabulary generation pass
    dist: DistContext = field(default_factory=DistContext)  # [dist] this process's rank (torchrun); 1 = plain


def dataset_batch(prompts: list[list[int]], completions: list[list[int]], max_new_tokens: int, pad_id: int,
                  prompt_side: str, is_seq2seq: bool) -> DistillBatch:
    """A supervised batch from dataset rows: prompts padded on ``prompt_side``, completions cut to
    ``max_new_tokens`` and right-padded."""
    ids, mask = pad_batch(prompts, pad_id, prompt_side)
    resp, rmask = pad_batch([c[:max_new_tokens] for c in completions], pad_id, "right")
    return DistillBatch(prompt_ids=torch.from_numpy(ids), prompt_mask=torch.from_numpy(mask),
                        response_ids=torch.from_numpy(resp), response_mask=torch.from_numpy(rmask).float(),
                        source="dataset", is_seq2seq=is_seq2seq)


def make_batch(run: Run, step: int) -> tuple[DistillBatch, dict[str, float]]:
    """Step 1: the batch's tokens (and, from a teacher generation, its top-k); generation stats."""
    cfg = run.cfg
    idx = prompt_indices(len(run.prompt_ids), run.data_position, cfg.run.batch_size,
                         cfg.data.order_seed(cfg.run.seed))
    run.data_position += cfg.run.batch_size
    prompts = [run.prompt_ids[i] for i in idx]
    seed = cfg.run.seed * 1_000_003 + step
    t0 = time.perf_counter()
    if draws_student(cfg, step):
        out = run.student_engine.generate(prompts, cfg.sampling.params(cfg.max_new_tokens, seed=seed,
                                                                       stop_ids=run.stop_ids))
        run.sync.check_version(out)
        source = "student"
    elif cfg.seq_kd:  # the full-vocabulary losses take every token's log-prob from this pass (k = V)
        k = run.vocab_size if cfg.loss in FULL_VOCAB_LOSSES else cfg.teacher_topk
        out = run.teacher.generate(prompts, cfg.sampling.params(cfg.max_new_tokens, seed=seed, return_topk=k,
                                                                stop_ids=run.stop_ids))
        source = "teacher"
    else:
        return dataset_batch([run.prompt_ids[i] for i in idx], [run.completion_ids[i] for i in idx],
                             cfg.max_new_tokens, run.pad_id, run.prompt_side, run.is_seq2seq), {}
    dt = time.perf_counter() - t0
    batch = DistillBatch(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, response_ids=out.response_ids,
                         response_mask=out.response_mask, source=source, is_seq2seq=out.is_seq2seq,
                         teacher_topk_logprobs=out.topk_logprobs, teacher_topk_ids=out.topk_ids)
    if source == "teacher" and cfg.loss in FULL_VOCAB_LOSSES:  # the generation pass's scores, no second pass
        batch.teacher_logits = logits_from_generation(out.topk_logprobs, out.topk_ids, cfg.sampling.temperature)
        batch.teacher_topk_logprobs = batch.teacher_topk_ids = None
    return batch, {f"{source}/tokens_per_s": float(out.response_mask.sum()) / max(dt, 1e-9)}


def teacher_targets(cfg: DistillConfig, b: DistillBatch, teacher_model: torch.nn.Module | None,
                    teacher: Engine) -> int:
    """Step 2: fill the teacher side of ``b`` for ``cfg.loss`` (full logits from the PyTorch ``teacher_model``, or
    the ``teacher`` engine's top-k), unless the teacher's generation pass already did (seq_kd); return the PyTorch
    teacher passes."""
    if cfg.loss in FULL_VOCAB_LOSSES and b.teacher_logits is None:
        with torch.no_grad():
            b.teacher_logits = response_forward(teacher_model, b.prompt_ids, b.prompt_mask, b.response_ids,
                                                b.is_seq2seq).logits.cpu()
        return 1
    if cfg.loss == "topk_kl" and b.teacher_topk_logprobs is None:
        r = teacher.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                              temperature=cfg.loss_temperature, topk=cfg.teacher_topk)
        b.teacher_topk_logprobs, b.teacher_topk_ids = r.topk_logprobs, r.topk_ids
    return 0


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out forward KL(teacher || student) (PyTorch, full vocab, T=1) and greedy accuracy (student engine)."""
    t0 = time.perf_counter()
    e = run.eval
    s_logits = response_forward(run.student, e.batch.prompt_ids, e.batch.prompt_mask, e.batch.response_ids,
                                run.is_seq2seq).logits.cpu()
    kl = D.exact_kl_from_logits(e.teacher_logits, s_logits, e.batch.response_mask)
    t1 = time.perf_counter()
    out = run.student_engine.generate(e.prompt_ids, SamplingParams(max_new_tokens=run.cfg.max_new_tokens,
                                                                   greedy=True, stop_ids=run.stop_ids))
    dt = time.perf_counter() - t1
    return {"eval/kl_to_teacher": float(D.masked_mean(kl, e.batch.response_mask)),
            "eval/accuracy": exact_match(run.tok, out, e.pairs),
            "eval/student_tokens_per_s": float(out.response_mask.sum()) / max(dt, 1e-9),
            "time/eval": time.perf_counter() - t0}


def teacher_accuracy(teacher: CountingEngine, eval_set: EvalSet, tok, max_new_tokens: int,
                     stop_ids: tuple[int, ...] = ()) -> float:
    """Greedy exact match of the teacher engine on the held-out prompts (not a training pass; not counted)."""
    out = teacher.inner.generate(eval_set.prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, greedy=True,
                                                                     stop_ids=stop_ids))
    return exact_match(tok, out, eval_set.pairs)


def setup(cfg: DistillConfig, resume: bool, log=print, dist: DistContext | None = None) -> Run:
    """Engines, models, optimizer, eval set and probe. Ranks > 0 of a torchrun job hold only the student
    and its optimizer: rank 0 makes every batch (engines, teacher) and shares it."""
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_info, s_info, tok = check_teacher_student(cfg.teacher.model_dir, cfg.student.model_dir)
    train, held = load_examples(cfg)
    turn = end_of_turn_ids(tok)  # a chat template's end of turn: completions end there, generation stops there
    stop_ids = stop_ids_of(tok, cfg.student.model_dir, s_info.eos_id)  # and at generation_config's other EOS ids
    what = cfg.data.dataset or cfg.dataset_file or cfg.data.task
    chat = cfg.data.chat_template_kwargs
    prompt_ids = encode_prompts(tok, [p for p, _ in train], s_info.max_positions, cfg.max_new_tokens, what, chat)
    end = turn[0] if turn else tok.eos_token_id
    completion_ids = [tok(c, add_special_tokens=False).input_ids + [end] for _, c in train]
    eval_ids = encode_prompts(tok, [p for p, _ in held], s_info.max_positions, cfg.max_new_tokens, f"{what} (eval)",
                              chat)
    max_len = max(len(p) for p in prompt_ids + eval_ids) + cfg.max_new_tokens + 8
    rows = max(cfg.run.batch_size, cfg.eval_size, cfg.rollout.probe_size)
    dist = dist or DistContext()
    device = dist.device or pick_device(cfg.run.device)
    cfg = settle_precision(cfg, device, log, "distill")  # run.precision, lora.base_dtype, rollout.quantize resolved
    seq2seq = s_info.kind == "seq2seq"
    if not dist.is_main:  # [dist] the student, its optimizer and schedule; no engines, no teacher
        student = student_model(cfg, s_info, device)
        optimizer, scheduler = _optimizer(cfg, student)
        run = Run(cfg=cfg, run_dir=run_dir, tok=tok, student=student, teacher_model=None, student_engine=None,
                  teacher=None, optimizer=optimizer, scheduler=scheduler, prompt_ids=prompt_ids,
                  completion_ids=completion_ids, eval=None, is_seq2seq=seq2seq, pad_id=s_info.pad_id,
                  prompt_side=s_info.padding_side, dist=dist)
        if resume:
            run.start_step = resume_latest(run_dir, student, None, optimizer, scheduler, lambda *_: None)[1]["step"]
        dist.wrap(student)
        return run
    engine = lambda name, model_dir, engine_dir, lora=None: engine_for_model(  # noqa: E731
        cfg, model_dir, engine_dir or run_dir / f"{name}_engine", rows, max_len, log, gpu_share=0.5, lora=lora)
    teacher_engine = CountingEngine(engine("teacher", cfg.teacher.model_dir, cfg.teacher.engine_dir))
    student_engine = engine("student", cfg.student.model_dir, cfg.student.engine_dir, cfg.lora)
    teacher_model = load_model(cfg.teacher.model_dir, t_info, attn=LEARNER_ATTN).to(device).requires_grad_(False)
    learner_kernels(teacher_model, cfg.run.cpu_matmul, device)  # oneDNN linears, the fused GELU
    eval_set = make_eval_set(cfg, teacher_engine, teacher_model, held, eval_ids, seq2seq, stop_ids)
    teacher_engine.generate_calls = 0  # the eval set is drawn once; the counters are per training batch
    student = student_model(cfg, s_info, device)
    optimizer, scheduler = _optimizer(cfg, student)
    run = Run(cfg=cfg, run_dir=run_dir, tok=tok, student=student,
              teacher_model=teacher_model if cfg.loss in FULL_VOCAB_LOSSES else None, student_engine=student_engine,
              teacher=teacher_engine, optimizer=optimizer, scheduler=scheduler, prompt_ids=prompt_ids,
              completion_ids=completion_ids, eval=eval_set, is_seq2seq=seq2seq, pad_id=s_info.pad_id,
              prompt_side=s_info.padding_side, stop_ids=stop_ids, dist=dist, vocab_size=t_info.vocab_size)
    # the probe batch: greedy from the engine as exported (the model folder's weights), before a resumed run pushes
    # its checkpoint, so it is the same batch in every process of the run and a resumed probe equals an uninterrupted one
    probe = make_probe(student_engine, prompt_ids, cfg.rollout, cfg.max_new_tokens, stop_ids)
    if resume:
        ck, state = resume_latest(run_dir, student, None, optimizer, scheduler, log)
        run.start_step = state["step"]
        run.data_position = state.get("data_position", run.start_step * cfg.run.batch_size)
        # the checkpoint's weights, under the version the engine had then
        push_checkpoint(student_engine, student, state.get("engine_weights_version"))
        log(f"refit distill: resumed from {ck} (step {run.start_step}, data position {run.data_position}, "
            f"student engine weights_version {student_engine.weights_version})")
    dist.wrap(student)  # [dist] DDP (a no-op for one process)
    # the probe scores at temperature 1: the student's own distribution, as the losses see it
    contract = Contract(temperature=1.0, probe_tol=cfg.rollout.probe_tol, label="student engine")
    run.sync = WeightSync(student_engine, probe, contract, run_dir)
    return run


def student_model(cfg: DistillConfig, info, device):
    """The student to train: the loaded model, or with ``lora.r > 0`` a LoRA adapter over it (the base frozen)."""
    student = load_model(cfg.student.model_dir, info, attn=LEARNER_ATTN).to(device)
    student = apply_lora(student, cfg.lora, cfg.run.seed) if cfg.lora.enabled else student
    learner_kernels(student, cfg.run.cpu_matmul, device)  # oneDNN linears, the fused GELU
    return student


def _optimizer(cfg: DistillConfig, student):
    optimizer = adamw([p for p in student.parameters() if p.requires_grad], cfg.optim)
    return optimizer, schedule(optimizer, cfg.optim, cfg.run.steps)


def distill_loss(loss: str, logits: torch.Tensor, b: DistillBatch, rows: slice, beta: float, temperature: float,
                 n_tokens: torch.Tensor):
    """Dispatch to :mod:`refit.learner.losses.distill`; ``logits`` (b, Tr, V) are the student's at temperature 1."""
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
    k, ga = ctx.world_size, cfg.optim.gradient_accumulation_steps
    if b.num_rows % (k * ga):
        raise RefitError(f"batch of {b.num_rows} rows must be divisible by world_size {k} x "
                         f"gradient_accumulation_steps {ga}")
    local = b.num_rows // k
    micro = local // ga
    model = ctx.policy_ddp if ctx.enabled else run.student
    n_tokens = b.response_mask.sum().clamp(min=1.0)  # the whole batch's: every rank holds it
    dev = next(run.student.parameters()).device
    autocast = precision_autocast(cfg, dev)  # bf16 autocast over fp32 master weights where run.precision resolved so
    # the student stays in eval mode: no dropout, as TRL's disable_dropout=True (and the engine has none)
    run.optimizer.zero_grad(set_to_none=True)
    total, acc = 0.0, {}
    for a in range(ga):
        rows = slice(ctx.rank * local + a * micro, ctx.rank * local + (a + 1) * micro)
        with ctx.no_sync(a == ga - 1):  # gradient sync on the last micro-batch (nothing for one process)
            # NEFTune (optim.neftune_noise_alpha): noisy input embeddings in this training forward only
            with autocast, neftune(run.student, cfg.optim.neftune_noise_alpha):  # float32 logits either way
                logits = response_forward(model, b.prompt_ids[rows], b.prompt_mask[rows], b.response_ids[rows],
                                          b.is_seq2seq).logits
            loss, stats = distill_loss(cfg.loss, logits, b, rows, cfg.beta, cfg.loss_temperature, n_tokens)
            (loss * k).backward()
        total += float(loss.detach())
        if b.teacher_topk_logprobs is not None and cfg.loss != "topk_kl":  # free diagnostic from the same pass
            stats["teacher_topk_kl"] = D.topk_kl_loss(logits.detach(), b.teacher_topk_logprobs[rows],
                                                      b.teacher_topk_ids[rows], b.response_mask[rows],
                                                      cfg.sampling.temperature)[0]
        for key, v in stats.items():
            acc.setdefault(key, []).append(float(v))
    stats = {f"distill/{key}": sum(v) if key in LOSS_STATS else sum(v) / len(v) for key, v in acc.items()}
    stats = reduce_stats(ctx, {"loss": total, **stats}, sums=("loss", *(f"distill/{x}" for x in LOSS_STATS)))
    grad_norm = torch.nn.utils.clip_grad_norm_(run.student.parameters(), cfg.optim.max_grad_norm)
    # the loss is the same on every rank, so every rank stops together
    check_finite({"loss": stats["loss"], "grad_norm": float(grad_norm)}, "loss or gradient", run.run_dir)
    run.optimizer.step()
    run.scheduler.step()
    return {**stats, "grad_norm": float(grad_norm), "lr": run.scheduler.get_last_lr()[0]}


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
    torch_passes = teacher_targets(run.cfg, b.check(), run.teacher_model, run.teacher)
    t2 = time.perf_counter()
    stats = update(run, run.dist.share(b))  # [dist] the batch to ranks > 0 (no-op for one process)
    t3 = time.perf_counter()
    if due(step, cfg.rollout.sync_every, cfg.run.steps):
        stats["probe/max_abs_logprob_diff"] = run.sync.push(run.student)
    t4 = time.perf_counter()
    gen, score = run.teacher.generate_calls - g0, run.teacher.score_calls - s0
    tokens = float(b.response_mask.sum())
    return {**stats, **gen_stats, "teacher/passes": gen + score + torch_passes, "teacher/engine_generate": gen,
            "teacher/engine_score": score, "teacher/torch_forward": torch_passes,
            "student/generated": int(b.source == "student"), "batch/from_teacher": int(b.source == "teacher"),
            "response/length": tokens / b.num_rows, "engine/weights_version": run.student_engine.weights_version,
            "time/batch": t1 - t0, "time/teacher": t2 - t1, "time/update": t3 - t2, "time/weight_push": t4 - t3,
            "tokens_per_s": tokens / max(t4 - t0, 1e-9), "time/step": t4 - t0}


def train_and_evaluate(run: Run, step: int) -> dict[str, float]:
    """:func:`train_step`, plus the held-out evaluation every ``eval_every`` steps (rank 0)."""
    m = train_step(run, step)
    if run.dist.is_main and due(step, run.cfg.eval_every, run.cfg.run.steps):
        m.update(evaluate(run))
    return m


def save(run: Run, step: int) -> Path:
    state = {"data_position": run.data_position, "engine_weights_version": run.student_engine.weights_version}
    return save_checkpoint(run.run_dir, step, run.student, run.tok, None, run.optimizer, run.scheduler, state,
                           run.cfg.ckpt.keep_checkpoints)


def _postfix(m: dict) -> dict:
    src = "student" if m["student/generated"] else "teacher" if m["batch/from_teacher"] else "data"
    return {"loss": f"{m['loss']:.3f}", "src": src}


def initial(run: Run) -> dict[str, float]:
    """The held-out figures at step 0, and the teacher's own accuracy on them (the ceiling the student aims at)."""
    return {**evaluate(run), "eval/teacher_accuracy": teacher_accuracy(run.teacher, run.eval, run.tok,
                                                                       run.cfg.max_new_tokens, run.stop_ids)}


def final(run: Run) -> None:
    """The student out as OUTPUT_DIR/final (from_pretrained) and OUTPUT_DIR/final_engine (refit.learner.run.final)."""
    cfg = run.cfg
    if cfg.export_final:
        max_len = max(len(p) for p in run.prompt_ids) + cfg.max_new_tokens + 8
        rows = max(cfg.run.batch_size, cfg.eval_size)
        write_final(run.run_dir, run.student, run.tok, None, cfg.rollout.backend, rows, max_len, run.stop_ids)


DISTILL_JOB = Job("distill", setup=setup, step=train_and_evaluate, save=save, postfix=_postfix, plot_panels=PLOT_PANELS,
                  # the student's engine first: with rollout_workers > 1 the teacher's pool (made first) owns Ray
                  engines=lambda run: [run.student_engine, run.teacher],
                  initial=initial, final=final)


def run_distill(cfg: DistillConfig, resume: bool = False, log=print, overwrite: bool = False,
                hooks: StepHooks | None = None) -> Path:
    """Run the cycle; return the run folder (metrics.jsonl, tb/, curves.png, checkpoints/, summary.json).

    Under ``torchrun --nproc-per-node K`` rank 0 drives the engines and the teacher, evaluates, pushes
    weights and writes metrics, checkpoints, plots and the summary; every rank runs its rows of each update.
    ``hooks``: a Python caller's view of each step (:class:`refit.learner.run.loop.StepHooks`).
    """
    t_start = time.perf_counter()
    run_dir, run = run_job(DISTILL_JOB, cfg, resume, log, overwrite, hooks)
    if run.dist.is_main:
        s = summary(run_dir)
        s["wall_s_this_process"] = round(time.perf_counter() - t_start, 1)
        (run_dir / "summary.json").write_text(json.dumps(s, indent=1))
    return run_dir
