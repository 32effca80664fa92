"""Rollout/learner mismatch: measure it every step, name its likely cause, explain negative KL.

Three causes are told apart by where the disagreement between the engine's untruncated
log-probs (``rollout_plain_logprobs``) and the learner's (``old_logprobs``) sits:

- padding: rows whose prompt carries padding disagree much more than rows that do not
  (left padding forced on T5's encoder, positions not taken from the mask; the TRL seed bug);
- precision: every row disagrees a little (fp16/bf16 on one side, fp32 on the other), or, with an int8
  rollout engine (``rollout.quantize``), every row disagrees by the engine's recorded int8-vs-fp32 gap;
- weights: large disagreement everywhere (a stale or wrong weight push);
- version_lag: generation overlapped with the update (``rollout.max_staleness``): the batch was sampled with
  weights ``mismatch/version_lag`` pushes older than the learner's, so the two disagree by the updates between
  them, on purpose; corrected by the importance weights (tis) and not a fault (each push is checked on the probe
  batch instead).

The sampler's logit processors (top-k/top-p/min-p, a repetition penalty; refit.rollout.processors) are not a
mismatch of the two models: they make the sampled distribution differ from the policy, which biases k1 computed
from the sampler's log-probs. Its size is ``truncation_gap`` = mean(rollout_logprobs - rollout_plain_logprobs)
(>= 0 under truncation alone; a repetition penalty can push it either way).
"""

from __future__ import annotations

import torch

from refit.learner import losses as L
from refit.learner.run.precision import mixed_bf16

PRECISION_LIMIT = 0.05  # mean |diff| below this with every row affected: rounding, not wrong inputs


def mismatch_stats(batch, old_logprobs: torch.Tensor) -> dict[str, float]:
    """Engine vs learner figures for one rollout batch (floats, for metrics.jsonl). A padded row is one whose prompt
    is shorter than the batch's longest (what padding columns the learner's view adds beside them, as
    ``RolloutBatch.trimmed`` does to round widths, changes no figure)."""
    mask = batch.response_mask
    base = L.logprob_mismatch_stats(batch.rollout_plain_logprobs, old_logprobs, mask)
    diff = (batch.rollout_plain_logprobs - old_logprobs).abs() * mask
    lengths = batch.prompt_mask.sum(-1)
    padded = lengths < lengths.max()
    row_mean = diff.sum(-1) / mask.sum(-1).clamp(min=1)
    stats = {f"mismatch/{k}": float(v) for k, v in base.items()}
    stats["mismatch/truncation_gap"] = float(L.masked_mean(batch.rollout_logprobs - batch.rollout_plain_logprobs,
                                                           mask)) if not batch.sampling.greedy else float("nan")
    stats["mismatch/padded_rows_mean_abs_diff"] = float(row_mean[padded].mean()) if padded.any() else 0.0
    stats["mismatch/unpadded_rows_mean_abs_diff"] = float(row_mean[~padded].mean()) if (~padded).any() else 0.0
    stats["mismatch/rows_affected_frac"] = float((row_mean > 1e-4).float().mean())
    return stats


def name_mismatch(stats: dict[str, float], tol: float = 1e-3, quantized: bool = False) -> str | None:
    """'padding' | 'version_lag' | 'precision' | 'weights' | None (agreement within ``tol``).

    ``quantized``: the engine runs in int8 and each push was checked against the learner's weights quantized
    the same way (the probe), so a disagreement on every row is its precision, whatever its size.
    ``stats["mismatch/version_lag"]`` > 0 (overlapped generation): the batch comes from older weights than the
    learner's, so a disagreement on every row is that lag (each push was checked on the probe batch)."""
    if stats["mismatch/max_abs_diff"] <= tol:
        return None
    padded, unpadded = stats["mismatch/padded_rows_mean_abs_diff"], stats["mismatch/unpadded_rows_mean_abs_diff"]
    if padded > 10 * max(unpadded, 1e-6):
        return "padding"
    if stats.get("mismatch/version_lag", 0) > 0:
        return "version_lag"
    if quantized or stats["mismatch/mean_abs_diff"] < PRECISION_LIMIT:
        return "precision"
    return "weights"


_CAUSES = {
    "padding": "engine and learner disagree on padded rows only: the padding side or position ids differ "
               "(never force left padding on an encoder; decoder positions must come from the attention mask)",
    "precision": "engine and learner disagree a little on every row: they run at different precisions "
                 "(fp16/bf16 vs fp32, or an int8 rollout engine vs the fp32 learner; with an int8 base on both sides, "
                 "an activation that a last-bit difference moves to the neighbouring int8 code); export and learn at "
                 "the same dtype or enable mismatch_correction=tis (the default with rollout.quantize)",
    "weights": "engine and learner disagree everywhere: the engine holds other weights than the learner "
               "(stale or failed weight push)",
    "neftune": "the learner's log-probs carry NEFTune's noise (optim.neftune_noise_alpha) and the engine's do not: "
               "expected; each push is checked on the clean probe batch instead",
    "version_lag": "the batch was sampled with older weights than the learner's (rollout.max_staleness: generation "
                   "overlapped with the update; mismatch/version_lag pushes behind): expected, weighted by "
                   "min(pi_learner / pi_engine, tis_cap) (mismatch_correction tis, the default with it); k1 over "
                   "these samples is not KL(pi||ref) and can dip below 0 (kl/exact, a sum per position, cannot)",
}


def describe(cause: str | None) -> str:
    return _CAUSES.get(cause or "", "engine and learner agree")


def explain_negative_kl(k1_mean: float, exact_kl_mean: float | None, stats: dict[str, float], truncates: bool,
                        quantized: bool = False) -> str:
    """Why the k1 estimate went below zero, most likely cause first (one line)."""
    reasons = []
    cause = name_mismatch(stats, quantized=quantized)
    if cause is not None:
        reasons.append(describe(cause))
    if truncates:
        reasons.append(f"samples come from a truncated or penalised distribution (top-k/top-p/min-p, repetition "
                       f"penalty; truncation gap "
                       f"{stats.get('mismatch/truncation_gap', float('nan')):.3g} nats/token), so the mean of "
                       "log pi - log ref over them is not KL(pi||ref); use kl_estimator=exact or k3, or tis")
    if exact_kl_mean is not None and exact_kl_mean < 1e-3 and not reasons:
        reasons.append(f"policy is still close to the reference (exact KL {exact_kl_mean:.2e}): k1 is an unbiased "
                       "but noisy estimate whose batch mean can dip below zero")
    if not reasons:
        reasons.append("sampling noise of the k1 estimator; compare with kl/exact")
    return f"k1 KL estimate {k1_mean:.3e} < 0: " + "; ".join(reasons)


def warn_small_tis_weights(run, step: int, stats: dict[str, float], sampling, log) -> None:
    """One line (once per run) when truncated importance weights shrink the policy gradient below
    ``tis_warn_below``: with top-k/top-p the sampler's probabilities exceed the policy's, so the weights
    ``pi/q`` are small by construction and the update is scaled down by their mean."""
    scale = stats.get("mismatch/tis_grad_scale")
    if scale is None or scale >= run.cfg.tis_warn_below or run.state.tis_warned:
        return
    run.state.tis_warned = True
    why = (f"top_k={sampling.top_k}, top_p={sampling.top_p}, min_p={sampling.min_p}, repetition_penalty="
           f"{sampling.repetition_penalty} process the sampler" if sampling.truncates
           else "the engine and the learner disagree")
    log(f"step {step}: warning: mean truncated importance weight {scale:.3g} < tis_warn_below "
        f"{run.cfg.tis_warn_below:g}: the policy gradient is scaled by ~{scale:.3g} ({why}); widen or drop the "
        "truncation, or use mismatch_correction none/seq_mask (docs/design.md: truncated importance sampling); logged as "
        "mismatch/tis_grad_scale, warned once")


def tell_mismatch(run, step: int, stats: dict[str, float], sampling, log) -> None:
    """Step 6: a small-TIS-weights warning, the engine/learner mismatch's cause named (the expected ones once per
    run), a negative k1 KL explained."""
    warn_small_tis_weights(run, step, stats, sampling, log)
    quantized = run.sync.contract.int8_manifest is not None
    cause = name_mismatch(stats, quantized=quantized)
    cause = "neftune" if cause is not None and run.cfg.optim.neftune_noise_alpha else cause  # noisy learner side
    low = quantized or run.cfg.lora.low_base or mixed_bf16(run.cfg)  # a precision gap chosen by the config
    once = cause in ("version_lag", "neftune") or (low and cause == "precision")  # expected: named once
    if cause is not None and (not once or run.sync.tell_once(cause)):
        log(f"step {step}: engine/learner mismatch ({cause}): {describe(cause)}"
            + (f" [correction: {run.cfg.correction}; told once]" if once else ""))
    if stats.get("kl/k1", 0.0) < -1e-6:
        log(f"step {step}: " + explain_negative_kl(stats["kl/k1"], stats["kl/exact"], stats, sampling.truncates,
                                                   quantized))
