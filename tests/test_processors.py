"""refit.rollout.processors: min-p and the repetition penalty, against transformers' own LogitsProcessor classes and
HF ``generate()``'s processed scores (independent references), through the engine's decode loops (static and in
flight), and the engine's log-probs against the learner's recomputation (KL at step 0 still exactly 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from refit.learner.ppo.cycle import setup
from refit.learner.ppo.route import experience
from refit.learner.run.policy import response_forward
from refit.rollout.engine import create_engine, pad_prompts
from refit.rollout.processors import (SeenTokens, min_p_filter, process_logits, repetition_penalty,
                                      seen_per_position)
from refit.rollout.sampling import sample_step
from refit.rollout.types import ModelSpec, SamplingParams

from conftest import same_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = 40
DECODER = ModelSpec(kind="decoder", pad_id=0, eos_id=1, decoder_start_id=None, prompt_side="left", vocab_size=V,
                    max_len=None)


def _logits(b=5, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2.0


def _left_padded(b=5, t=9, seed=1):
    """(ids, mask, padding lengths): rows of lengths t, t-1, ..., left-padded with the pad id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (b, t), generator=g)
    pads = torch.arange(b) % t
    mask = (torch.arange(t)[None, :] >= pads[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, pads


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf_and_ignores_left_padding(penalty):
    """HF's processor over generate's input_ids less the left padding (transformers 5's ``prompt_ignore_length``)
    equals ours over SeenTokens started from the real prompt tokens, bit for bit; the pad id (0) is penalised only
    in rows that hold it as a real token (none here)."""
    x = _logits()
    x[:, 0] = 3.0  # the pad id's logit: HF without prompt_ignore_length would penalise it in padded rows
    ids, mask, pads = _left_padded()
    seen = SeenTokens(5, V)
    seen.reset(np.arange(5), ids, mask, DECODER)
    ours = repetition_penalty(x, seen.mask, penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pads)(ids, x.clone())
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, 0], x[:, 0]), "padding is not a seen token"
    changed = ours != x
    assert changed.any() and torch.equal(changed, torch.from_numpy(seen.mask) & (x != 0))


@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p):
    x = _logits(b=8, v=200) / 0.7
    ours = min_p_filter(x, min_p)
    ref = MinPLogitsWarper(min_p)(None, x.clone())
    assert torch.equal(ours, ref)
    assert torch.isfinite(ours.gather(-1, x.argmax(-1, keepdim=True))).all(), "the most likely token stays"


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.4, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
    SamplingParams(temperature=1.3, min_p=0.2, repetition_penalty=0.8)])
def test_processed_distribution_matches_hf_chain(params):
    """process_logits = log_softmax of HF's chain in generate()'s order: repetition penalty, temperature, top-k,
    top-p, min-p (transformers.GenerationMixin._get_logits_processor)."""
    x = _logits(b=5, v=V)
    ids, mask, pads = _left_padded()
    chain = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty, prompt_ignore_length=pads),
             TemperatureLogitsWarper(params.temperature)]
    chain += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    chain += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    chain += [MinPLogitsWarper(params.min_p)]
    ref = torch.log_softmax(LogitsProcessorList(chain)(ids, x.clone()), -1)
    seen = SeenTokens(5, V)
    seen.reset(np.arange(5), ids, mask, DECODER)
    ours = process_logits(x, params, seen.mask)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # the sampler draws from it, and returns the log-prob of the drawn token under it (plain: no processors)
    tok, proc, plain, _ = sample_step(x, params, torch.Generator().manual_seed(0), seen=seen.mask)
    assert torch.isfinite(ours.gather(-1, tok[:, None])).all()
    torch.testing.assert_close(proc, ours.gather(-1, tok[:, None])[:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(plain, torch.log_softmax(x / params.temperature, -1).gather(-1, tok[:, None])[:, 0],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_hf_generate_scores_equal_ours_at_every_position(model_dirs, prompts, arch):
    """HF generate() with a repetition penalty and min-p: its processed scores (``output_scores``) at each sampled
    token equal our processors on its raw logits (``output_logits``) with the seen sets of seen_per_position
    (a decoder's real prompt + the response so far; T5: the decoder start token + the response so far)."""
    cls = AutoModelForSeq2SeqLM if arch == "tiny-t5" else AutoModelForCausalLM
    model = cls.from_pretrained(model_dirs[arch]).eval()
    spec = ModelSpec.from_config(model.config, model_dir=model_dirs[arch])
    ids, mask, _ = pad_prompts(prompts, 1, spec)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=30, min_p=0.05, repetition_penalty=1.5)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=10, temperature=0.9,
                             top_k=30, min_p=0.05, repetition_penalty=1.5, pad_token_id=spec.pad_id,
                             eos_token_id=spec.eos_id, output_scores=True, output_logits=True,
                             return_dict_in_generate=True)
    resp = out.sequences[:, 1:] if arch == "tiny-t5" else out.sequences[:, ids.shape[1]:]
    raw, hf = torch.stack(out.logits, 1).float(), torch.log_softmax(torch.stack(out.scores, 1).float(), -1)
    ours = process_logits(raw, params, seen_per_position(ids, mask, resp, raw.shape[-1], spec))
    live = (torch.cumsum((resp == spec.eos_id).long(), 1) - (resp == spec.eos_id).long()) == 0  # up to the EOS
    pick = lambda lp: lp.gather(-1, resp[..., None])[..., 0][live]  # noqa: E731
    torch.testing.assert_close(pick(ours), pick(hf), atol=1e-5, rtol=0)
    assert (pick(ours) != pick(torch.log_softmax(raw / 0.9, -1))).any(), "the processors changed the distribution"


def _learner_recomputation(model, batch, params, spec):
    """The learner's forward at temperature 1 (the raw logits), through the same processors with the same seen sets:
    the processed log-probs of the sampled tokens (B, Tr), and the plain ones at the temperature."""
    raw = response_forward(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.is_seq2seq).logits
    seen = seen_per_position(batch.prompt_ids, batch.prompt_mask, batch.response_ids, raw.shape[-1], spec)
    ids = batch.response_ids[..., None]
    proc = process_logits(raw, params, seen).gather(-1, ids)[..., 0]
    plain = torch.log_softmax(raw / params.temperature, -1).gather(-1, ids)[..., 0]
    m = batch.response_mask.bool()
    return torch.where(m, proc, 0.0), torch.where(m, plain, 0.0)  # a pad id past the stop may be filtered out (-inf)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_engine_logprobs_equal_the_learner_recomputation(model_dirs, engine_dirs, prompts, arch):
    """ONNX Runtime engine, repetition penalty 1.3 and min-p 0.05, two samples a prompt: its rollout_logprobs are the
    processed distribution's as the learner recomputes it from its own forward (within the export's fp32 parity,
    1e-4), its plain ones the learner's at the temperature; in-flight slots (a seen set per slot, reset on each
    admission) give the same rows as one static batch."""
    cls = AutoModelForSeq2SeqLM if arch == "tiny-t5" else AutoModelForCausalLM
    model = cls.from_pretrained(model_dirs[arch]).eval()
    params = SamplingParams(max_new_tokens=8, seed=2, temperature=0.9, min_p=0.05, repetition_penalty=1.3, n=2,
                            stop_ids=tuple(range(5, 25)))
    eng = create_engine("onnxruntime", engine_dirs[arch])
    batch = eng.generate(prompts, params)
    with torch.no_grad():
        proc, plain = _learner_recomputation(model, batch, params, eng.spec)
    torch.testing.assert_close(batch.rollout_logprobs, proc, atol=1e-4, rtol=0)
    torch.testing.assert_close(batch.rollout_plain_logprobs, plain, atol=1e-4, rtol=0)
    m = batch.response_mask.bool()
    assert (batch.rollout_logprobs - batch.rollout_plain_logprobs)[m].abs().max() > 1e-2
    if arch == "tiny-gpt2":
        lengths = batch.response_mask.sum(1)
        assert lengths.min() < lengths.max(), "rows stop at different lengths, so slots are refilled"
        same_rows(batch, create_engine("onnxruntime", engine_dirs[arch], slots=3).generate(prompts, params), 1e-5)


def test_kl_zero_at_step_zero_and_tis_knows_the_processors(model_dirs, engine_dirs, tmp_path):
    """PPO at step 0 with a repetition penalty and min-p: every KL estimator is 0 (the learner and the reference both
    score at the temperature alone, as TRL), the engine/learner mismatch of the plain log-probs is within the parity,
    the truncation gap shows the processors, and tis weights each token by min(pi_learner / pi_engine, cap) with
    pi_engine the processed distribution the engine sampled from."""
    from refit.learner.ppo.config import PPOConfig

    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                              output_dir=str(tmp_path), steps=1, batch_size=8, num_generations=2,
                              advantage_estimator="grpo", response_length=6, probe_size=4, progress=False,
                              tensorboard=False, plots=False, max_operand=9, num_prompts=32, export_final=False,
                              repetition_penalty=1.3, min_p=0.05, temperature=0.9, mismatch_correction="tis",
                              kl_coef=0.1, tis_cap=1e6)
    assert (cfg.sampling.repetition_penalty, cfg.sampling.min_p) == (1.3, 0.05)
    run = setup(cfg, resume=False, log=lambda *_: None)
    params = cfg.sampling.params(6, n=2, seed=3)
    rollout = run.engine.generate(run.prompt_ids[:8], params)
    exp, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(stats[f"kl/{k}"]) <= 1e-6, (k, stats[f"kl/{k}"])
    assert stats["mismatch/max_abs_diff"] < 1e-4
    assert abs(stats["mismatch/truncation_gap"]) > 1e-3
    with torch.no_grad():
        proc, _ = _learner_recomputation(run.policy, rollout, params, run.engine.spec)
    m = rollout.response_mask
    torch.testing.assert_close(exp.is_weights, torch.exp(exp.old_logprobs - proc) * m, atol=1e-3, rtol=1e-3)
