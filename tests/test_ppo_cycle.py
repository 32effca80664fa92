"""The PPO-KL cycle: KL at step 0, mismatch naming, micro-batches, probe, resume, NaN, demo."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo, setup, train_step
from refit.learner.ppo.route import experience
from refit.learner.run.metrics import read_metrics
from refit.learner.ppo.mismatch import explain_negative_kl, mismatch_stats, name_mismatch
from refit.learner.ppo.experience import score_batch
from refit.learner.ppo.update import UpdateSettings, ppo_update
from refit.learner.run.policy import learner_view
from refit.rollout.types import SamplingParams

from conftest import corrupting


def _cfg(model_dirs, engine_dirs, arch, out, **kw):
    base = dict(model_dir=str(model_dirs[arch]), engine_dir=str(engine_dirs[arch]), output_dir=str(out),
                steps=2, batch_size=4, num_generations=2, advantage_estimator="gae", num_mini_batches=2, num_ppo_epochs=1, response_length=4,
                save_steps=2, probe_size=4, progress=False, tensorboard=False, plots=False, max_operand=9,
                num_prompts=32, learning_rate=1e-3, export_final=False)
    base.update(kw)
    return PPOConfig.from_flat(**base)


@pytest.mark.parametrize("ref_backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_kl_is_zero_at_step_zero_with_truncated_sampling(model_dirs, engine_dirs, tmp_path, arch, ref_backend):
    """policy == reference: k1, k2, k3 and exact KL are 0 within 1e-6 though sampling used top-k and top-p,
    with the reference as a PyTorch forward and on the exported reference engine; both engines run the
    fused-attention graph (T5's: refit/export/fused_seq2seq.py)."""
    run = setup(_cfg(model_dirs, engine_dirs, arch, tmp_path, batch_size=8, ref_backend=ref_backend), resume=False,
                log=lambda *_: None)
    assert (run.ref_engine is not None) == (ref_backend == "onnxruntime")
    assert all(e.manifest.attention == "fused" for e in (run.engine, run.ref_engine) if e is not None)
    prompts = run.prompt_ids[:8]
    rollout = run.engine.generate(prompts, SamplingParams(max_new_tokens=6, top_k=5, top_p=0.8, seed=3))
    assert (rollout.rollout_logprobs - rollout.rollout_plain_logprobs)[rollout.response_mask.bool()].max() > 0
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    for k in ("k1", "k2", "k3", "exact"):
        assert abs(stats[f"kl/{k}"]) <= 1e-6, (k, stats[f"kl/{k}"])
    assert stats["mismatch/max_abs_diff"] < 1e-4


def _kl_at_step_zero(run, rollout):
    """Every KL estimator of the cycle's first experience, and its engine/learner mismatch."""
    _, stats = experience(run, rollout, torch.zeros(rollout.num_rows))
    return {k: stats[f"kl/{k}"] for k in ("k1", "k2", "k3", "exact")}, stats["mismatch/max_abs_diff"]


@pytest.mark.parametrize("arch", ["tiny-bart", pytest.param("tiny-marian", marks=pytest.mark.slow)])
def test_bart_family_kl_is_zero_at_step_zero_with_top_p_and_top_k(model_dirs, engine_dirs, tmp_path, arch):
    """BART (learned positions from offset 2, eos as decoder start) and Marian (sinusoidal positions,
    scaled embeddings, pad as decoder start), both with final_logits_bias: top-k 20 and top-p 0.9
    sampling on the engine, k1/k2/k3/exact KL 0 within 1e-6, engine and learner agree."""
    run = setup(_cfg(model_dirs, engine_dirs, arch, tmp_path, batch_size=8), resume=False, log=lambda *_: None)
    rollout = run.engine.generate(run.prompt_ids[:8], SamplingParams(max_new_tokens=6, top_k=20, top_p=0.9, seed=3))
    assert (rollout.rollout_logprobs - rollout.rollout_plain_logprobs)[rollout.response_mask.bool()].max() > 0
    kls, mismatch = _kl_at_step_zero(run, rollout)
    for k, v in kls.items():
        assert abs(v) <= 1e-6, (k, v)
    assert mismatch < 1e-4


SOURCE_SENTENCES = ["Refit trains language models.", "The engine samples.",
                    "Generation runs on exported inference engines while the learner stays in PyTorch.", "Hello"]


def test_seed_marian_right_padded_sources_top_p_kl_zero(model_dirs, engine_dirs, tmp_path):
    """The seed thread's open case: a Marian-geometry policy, source sentences of different lengths
    right-padded (the encoder's native side), top-p 0.9: KL at step 0 == 0. Forcing left padding on
    the encoder instead (the bug the thread fixed for T5) moves Marian's positions: the learner's
    log-probs would no longer be the engine's."""
    from refit.learner.run.policy import learner_view

    run = setup(_cfg(model_dirs, engine_dirs, "tiny-marian", tmp_path), resume=False, log=lambda *_: None)
    sources = [run.tok(s, add_special_tokens=False).input_ids for s in SOURCE_SENTENCES]
    rollout = run.engine.generate(sources, SamplingParams(max_new_tokens=8, top_p=0.9, seed=0, n=2))
    lengths = rollout.prompt_mask.sum(-1)
    assert len(set(lengths.tolist())) == len(SOURCE_SENTENCES) and rollout.prompt_mask[:, 0].all(), "right-padded"
    kls, mismatch = _kl_at_step_zero(run, rollout)
    for k, v in kls.items():
        assert abs(v) <= 1e-6, (k, v)
    assert mismatch < 1e-4
    flipped = copy.copy(rollout)  # the same rows, encoder input moved to the left
    flipped.prompt_ids = torch.stack([r.roll(int(r.shape[0] - n)) for r, n in zip(rollout.prompt_ids, lengths)])
    flipped.prompt_mask = torch.stack([r.roll(int(r.shape[0] - n)) for r, n in zip(rollout.prompt_mask, lengths)])
    left_lp = learner_view(run.policy, None, flipped, 1.0)[0]
    m = rollout.response_mask.bool()
    assert (left_lp - rollout.rollout_plain_logprobs)[m].abs().max() > 1e-3


@torch.no_grad()
def _exact_kl_reference(model, ref_model, batch, temperature):
    """Per-token KL(pi || ref) from two separate forwards of the whole batch (B, Tr)."""
    from refit.learner.losses import exact_kl_from_logits
    from refit.learner.run.policy import response_forward

    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.is_seq2seq, temperature)
    return exact_kl_from_logits(response_forward(model, *args).logits, response_forward(ref_model, *args).logits)


def test_reference_beside_the_policy_forward_equals_it_in_turn(model_dirs, engine_dirs, tmp_path):
    """reference_ahead with a reference engine on a step that scores separately (a value head): the reference's
    chunks scored on a thread beside the policy's forward give the same numbers as scored in turn, and a step of
    each kind logs the same metrics."""
    from refit.learner.ppo.onepass import ReferenceAhead
    from refit.learner.ppo.experience import score_chunks
    from refit.learner.run.policy import vocab_size

    runs = [setup(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / f"r{ahead}", batch_size=8, kl_coef=0.1,
                       ref_backend="onnxruntime", reference_ahead=ahead), resume=False, log=lambda *_: None)
            for ahead in (False, True)]
    rows = [train_step(r, 1, log=lambda *_: None) for r in runs]
    for k, v in rows[0].items():
        if not k.startswith(("time/", "tokens_per_s")):
            assert rows[1][k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    run = runs[0]
    assert run.ref_engine is not None and run.cfg.advantage_estimator == "gae"
    with torch.no_grad():
        for p in run.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout = run.engine.generate(run.prompt_ids[:8], SamplingParams(max_new_tokens=6, seed=5, n=2, temperature=0.7))
    turn = score_batch(run.policy, run.value_head, run.ref_engine, rollout, chunk=5)  # at the rollout's 0.7
    ahead = ReferenceAhead(run.ref_engine, [rollout.rows(r) for r in score_chunks(rollout.num_rows, 5)],
                           vocab_size(run.policy), ahead=True)
    beside = score_batch(run.policy, run.value_head, run.ref_engine, rollout, chunk=5, ref_ahead=ahead)
    ahead.close()
    assert float(turn.exact_kl[rollout.response_mask.bool()].mean()) > 1e-4
    for a, b in ((turn.ref_logprobs, beside.ref_logprobs), (turn.exact_kl, beside.exact_kl)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_one_pass_scoring_equals_separate_forwards(model_dirs, engine_dirs, tmp_path, arch):
    """score_batch (one policy + one reference forward per chunk) == learner_view x2 + the KL of two more forwards."""
    cfg = _cfg(model_dirs, engine_dirs, arch, tmp_path, batch_size=8, ref_backend="torch")
    run = setup(cfg, resume=False, log=lambda *_: None)
    with torch.no_grad():  # policy != reference, value head != 0, so nothing below is trivially 0
        for p in run.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        run.value_head.summary.weight.normal_()
    rollout = run.engine.generate(run.prompt_ids[:8], SamplingParams(max_new_tokens=6, seed=5, n=2, temperature=0.7))
    sc = score_batch(run.policy, run.value_head, run.ref, rollout, chunk=5)  # at the temperature it was sampled at
    lp, values, ent = learner_view(run.policy, run.value_head, rollout, 0.7)
    ref = learner_view(run.ref, None, rollout, 0.7)[0]
    kl = _exact_kl_reference(run.policy, run.ref, rollout, 0.7)
    m = rollout.response_mask.bool()
    assert kl[m].mean() > 1e-4 and values.abs().max() > 0
    for got, want in ((sc.logprobs, lp), (sc.values, values), (sc.entropy, ent), (sc.ref_logprobs, ref),
                      (sc.exact_kl, kl)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_planted_padding_mismatch_is_named(model_dirs, engine_dirs, tmp_path, monkeypatch):
    """Left-padded prompts whose positions ignore the padding (arange instead of the mask's count)."""
    import refit.learner.run.policy

    run = setup(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path), resume=False, log=lambda *_: None)
    prompts = [run.tok(p).input_ids for p in ["1+2=", "sort 98765 = ", "12+34=", "sort 1234567 = "]]
    rollout = run.engine.generate(prompts, SamplingParams(max_new_tokens=5, seed=0))
    assert (rollout.prompt_mask == 0).any() and (rollout.prompt_mask == 1).all(-1).any()
    right = learner_view(run.policy, None, rollout, 1.0)[0]
    assert name_mismatch(mismatch_stats(rollout, right)) is None
    monkeypatch.setattr(refit.learner.run.policy, "position_ids_from_mask",
                        lambda m: torch.arange(m.shape[1]).expand(m.shape[0], -1))
    wrong = learner_view(run.policy, None, rollout, 1.0)[0]
    stats = mismatch_stats(rollout, wrong)
    assert name_mismatch(stats) == "padding", stats
    # the learner's view of the batch widened to multiples of 8 (a padding column on every row): the same figures
    wide = rollout.trimmed(8)
    assert (wide.prompt_mask[:, 0] == 0).all()
    assert mismatch_stats(wide, torch.nn.functional.pad(wrong, (0, wide.response_ids.shape[1] - wrong.shape[1]))
                          ) == pytest.approx(stats)
    assert "padding" in explain_negative_kl(-0.01, 0.01, stats, truncates=False)


def test_planted_precision_mismatch_is_named(model_dirs, engine_dirs, tmp_path):
    run = setup(_cfg(model_dirs, engine_dirs, "tiny-llama", tmp_path), resume=False, log=lambda *_: None)
    rollout = run.engine.generate(run.prompt_ids[:6], SamplingParams(max_new_tokens=5, seed=0))
    lp16 = learner_view(copy.deepcopy(run.policy).to(torch.bfloat16), None, rollout, 1.0)[0]
    stats = mismatch_stats(rollout, lp16)
    assert name_mismatch(stats) == "precision", stats
    msg = explain_negative_kl(-0.01, 0.0, stats, truncates=True)
    assert "precision" in msg and "truncated" in msg


def test_microbatch_split_gives_same_update(model_dirs, engine_dirs, tmp_path):
    run = setup(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path, batch_size=8), resume=False, log=lambda *_: None)
    rollout = run.engine.generate(run.prompt_ids[:8], SamplingParams(max_new_tokens=5, seed=1))
    scores = torch.linspace(-1, 1, rollout.num_rows)
    exp, _ = experience(run, rollout, scores)
    results, logged = [], []
    for accum in (1, 4):
        policy, vh = copy.deepcopy(run.policy), copy.deepcopy(run.value_head)
        opt = torch.optim.SGD(list(policy.parameters()) + list(vh.parameters()), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        s = UpdateSettings(1, 1, accum, 0.2, 0.2, 0.1, 0.01, 1e9)
        logged.append(ppo_update(policy, vh, opt, sched, exp, s, torch.Generator().manual_seed(0)))
        results.append(torch.cat([p.detach().flatten() for p in list(policy.parameters()) + list(vh.parameters())]))
    moved = (results[0] - torch.cat([p.detach().flatten() for p in list(run.policy.parameters())
                                     + list(run.value_head.parameters())])).abs().max()
    assert moved > 1e-4
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-5)
    for key in ("pg_loss", "vf_loss", "entropy", "grad_norm", "ratio_max"):  # the minibatch's values, not 1/accum
        assert abs(logged[0][key] - logged[1][key]) <= 1e-5 * max(1.0, abs(logged[0][key])), (key, logged)


@pytest.mark.parametrize("on_rollout", [True, False], ids=["next-rollout", "probe-batch"])
def test_probe_stops_a_run_whose_engine_got_wrong_weights(model_dirs, engine_dirs, tmp_path, on_rollout):
    """A push that does not take stops the run in one line: on the probe batch right after the push, or
    (probe_on_rollout) on the next step's rollout, before that step's update touches the policy."""
    run = setup(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path, probe_on_rollout=on_rollout), resume=False,
                log=lambda *_: None)
    push = run.engine.update_weights
    run.engine.update_weights = corrupting(push)
    if on_rollout:
        m = train_step(run, 1, log=lambda *_: None)  # pushed, not yet checked
        assert "probe/max_abs_logprob_diff" not in m and run.sync.unchecked
        before = [p.detach().clone() for p in run.policy.parameters()]
    with pytest.raises(RefitError, match="parity probe failed.*" + ("first rollout" if on_rollout else "probe batch")):
        train_step(run, 2 if on_rollout else 1, log=lambda *_: None)
    if on_rollout:
        assert all(torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))  # no update from it
    run.engine.update_weights = push
    push({n: p for n, p in run.policy.named_parameters()})
    assert run.sync.check_now(run.policy) < 1e-4


def test_resume_reproduces_uninterrupted_metrics(model_dirs, engine_dirs, tmp_path):
    full = run_ppo(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / "full", steps=4), log=lambda *_: None)
    part = tmp_path / "part"
    run_ppo(_cfg(model_dirs, engine_dirs, "tiny-gpt2", part, steps=4, max_steps_this_run=2), log=lambda *_: None)
    assert [r["step"] for r in read_metrics(part)] == [1, 2]
    run_ppo(_cfg(model_dirs, engine_dirs, "tiny-gpt2", part, steps=4), resume=True, log=lambda *_: None)
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    timings = ("time/", "tokens_per_s")  # wall-clock: the only fields allowed to differ
    for ra, rb in zip(a[2:], b[2:]):
        assert set(ra) == set(rb), ra["step"]
        for k, v in ra.items():
            if not k.startswith(timings) and v is not None:
                assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (ra["step"], k)
    assert [r["engine/weights_version"] for r in b] == [1, 2, 3, 4]  # the resumed engine went on from 2
    state = json.loads((part / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["step"] == 4 and state["engine_weights_version"] == 4 and state["data_position"] == 4 * 4


def test_nan_reward_stops_with_clear_error_and_keeps_checkpoint(model_dirs, engine_dirs, tmp_path):
    from refit.learner.ppo.cycle import save

    cfg = _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path, steps=3, save_steps=1)
    run = setup(cfg, resume=False, log=lambda *_: None)
    train_step(run, 1, log=lambda *_: None)
    ck = save(run, 1)
    before = {p.name: p.stat().st_mtime_ns for p in ck.rglob("*")}

    def nan_reward(prompts, completions):
        return [float("nan")] * len(completions)

    run = replace(run, reward_fn=nan_reward)  # the run's fixed part is frozen: a new one around the same state
    with pytest.raises(RefitError, match="reward function 'nan_reward' returned nan for row 0"):
        train_step(run, 2, log=lambda *_: None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert {p.name: p.stat().st_mtime_ns for p in ck.rglob("*")} == before
    run.engine.close()


@pytest.mark.parametrize("arch", ["tiny-t5", "tiny-bart", pytest.param("tiny-marian", marks=pytest.mark.slow)])
def test_seq2seq_cycle_exact_kl_never_negative(model_dirs, engine_dirs, tmp_path, arch):
    """A dense reward moves the policy off the reference, so the exact KL after step 1 is > 0, never < 0."""
    out = run_ppo(_cfg(model_dirs, engine_dirs, arch, tmp_path, steps=3, kl_estimator="exact",
                       reward="refit.learner.builtin.tasks:length_reward", top_k=20, top_p=0.9, save_steps=1,
                       export_final=True),
                  log=lambda *_: None)
    rows = read_metrics(out)
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    final = AutoModelForSeq2SeqLM.from_pretrained(out / "final").state_dict()  # the trained model as an HF folder
    last = load_file(str(out / "checkpoints" / "step_000003" / "policy" / "model.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in last.items()) and (out / "final_engine" / "manifest.json").exists()
    assert len(rows) == 3 and abs(rows[0]["kl/exact"]) < 1e-6
    assert all(r["kl/exact"] >= 0 for r in rows) and rows[-1]["kl/exact"] > 1e-8, [r["kl/exact"] for r in rows]
    # every push checked: steps 1-2's on the next rollout, the last one on the probe batch
    assert "probe/max_abs_logprob_diff" not in rows[0] and all(r["probe/max_abs_logprob_diff"] < 1e-3 for r in rows[1:])
    for key in ("kl/k1", "kl/k2", "kl/k3", "ppo/clipfrac", "ppo/approx_kl", "ppo/vf_loss", "policy/entropy",
                "value/explained_variance", "mismatch/token_mult_prob_error", "time/rollout", "time/score",
                "time/update", "time/weight_push", "tokens_per_s"):
        assert key in rows[-1], key


def test_config_yaml_and_flags(tmp_path):
    """Sections in YAML, flags over YAML, --resume a regular option (more in tests/test_config.py)."""
    from refit.learner.run.config import parse_job

    f = tmp_path / "c.yaml"
    f.write_text("model: {model_dir: m}\nrun: {steps: 7}\nkl_coef: 0.2\nscale: {workers: 3, worker_cpus: 0.5}\n")
    cfg, opts = parse_job(PPOConfig, ["--config", str(f), "--run.steps", "9", "--resume"], "refit ppo")
    assert (cfg.model.model_dir, cfg.run.steps, cfg.kl_coef, opts.resume) == ("m", 9, 0.2, True)
    assert (cfg.scale.workers, cfg.scale.worker_cpus, cfg.scale.ray_address) == (3, 0.5, "")
    f.write_text("model: {model_dir: m}\nrollout:\n  nope: 1\n")
    with pytest.raises(RefitError, match=r"unknown field rollout.nope"):
        parse_job(PPOConfig, ["--config", str(f)], "refit ppo")
    with pytest.raises(RefitError, match="save_steps must be a multiple"):
        PPOConfig.from_flat(save_steps=3, sync_every=2)


def test_demo_end_to_end_short(tmp_path):
    r = subprocess.run([sys.executable, "-m", "refit", "demo", "-o", str(tmp_path / "demo"), "--steps", "3",
                        "--sft-steps", "20", "--batch-size", "8", "--num-generations", "2", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["min_exact_kl"] >= 0
    run = tmp_path / "demo" / "ppo"
    assert (run / "metrics.jsonl").exists() and (run / "curves.png").exists() and (run / "config.yaml").exists()
    assert any((run / "tb").iterdir()) and (run / "checkpoints" / "step_000003" / "policy" / "config.json").exists()
    # issue 43 #5: the same demo again is refused before any work, its run untouched; the warm-up is reused
    metrics = (run / "metrics.jsonl").read_bytes()
    again = subprocess.run([sys.executable, "-m", "refit", "demo", "-o", str(tmp_path / "demo"), "--steps", "3"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"refit demo: error: {run} already holds this demo's run; pass --overwrite to run it again (deletes that "
        "run's metrics and checkpoints), or choose another folder (-o)"), again.stderr[-500:]
    assert (run / "metrics.jsonl").read_bytes() == metrics
    only = subprocess.run([sys.executable, "-m", "refit", "demo", "-o", str(tmp_path / "demo"), "--sft-steps", "20",
                           "--policy-only"], capture_output=True, text=True, timeout=600)
    assert only.returncode == 0 and "reusing the warmed-up policy" in only.stdout, only.stdout[-500:]


def test_each_demo_variant_has_its_own_run_folder():
    from refit.learner.demo import DemoConfig, run_folder

    got = [run_folder(DemoConfig(out="d", **kw)).name for kw in (
        {}, {"lora": 16}, {"quantize": "int8"}, {"lora": 8, "quantize": "int8", "chat": True}, {"backend": "torch"},
        {"lora": 16, "quantize": "none"}, {"precision": "fp32"}, {"lora": 16, "precision": "bf16"})]
    assert got == ["ppo", "ppo-lora16", "ppo-int8", "ppo-lora8-int8-chat", "ppo-torch", "ppo-lora16-fp32engine",
                   "ppo-fp32", "ppo-lora16-bf16"]


def test_kl_in_loss_tis_and_adaptive_kl(model_dirs, engine_dirs, tmp_path):
    out = run_ppo(_cfg(model_dirs, engine_dirs, "tiny-llama", tmp_path, steps=2, kl_penalty="loss",
                       mismatch_correction="tis", tis_cap=1.5, top_k=8, adap_kl_ctrl=True, target=0.1, horizon=100,
                       kl_coef=0.1), log=lambda *_: None)
    rows = read_metrics(out)
    assert "ppo/is_weights_mean" in rows[0] and 0 < rows[0]["ppo/is_weights_mean"] <= 1.5
    assert rows[0]["kl/coef"] != 0.1  # the controller moved it after step 1
    assert rows[0]["mismatch/truncation_gap"] > 0  # top-k sampling: sampled log-probs above the plain ones


def test_seq_mask_correction_drops_mismatched_rows(model_dirs, engine_dirs, tmp_path):
    run = setup(_cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path, mismatch_correction="seq_mask",
                     seq_mask_threshold=1e-3), resume=False, log=lambda *_: None)
    rollout = run.engine.generate(run.prompt_ids[:4], SamplingParams(max_new_tokens=4, seed=0))
    rollout.rollout_plain_logprobs[0] -= 0.5 * rollout.response_mask[0]  # plant a mismatch on row 0
    exp, stats = experience(run, rollout, torch.zeros(4))
    assert stats["mismatch/seq_masked_frac"] == 0.25
    assert exp.mask[0].sum() == 0 and exp.mask[1:].sum() == rollout.response_mask[1:].sum()


def test_tensorrt_backend_fails_at_once_without_tensorrt(model_dirs, tmp_path):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), output_dir=str(tmp_path / "run"),
                              backend="tensorrt", progress=False)
    with pytest.raises(RefitError, match="TensorRT is not installed"):
        setup(cfg, resume=False, log=lambda *_: None)
    assert not (tmp_path / "run" / "engine").exists()


@pytest.mark.parametrize("kl_penalty, ref_backend, torch_ref", [("reward", "onnxruntime", False),
                                                                ("loss", "onnxruntime", True),
                                                                ("reward", "torch", True)])
def test_reference_held_once(model_dirs, engine_dirs, tmp_path, kl_penalty, ref_backend, torch_ref):
    """The frozen reference is held where it is used, once: on the engine (a session over the folder's files, no
    weights copy of its own), and in PyTorch only when a step needs it there (the loss's exact KL, or
    ref_backend torch). The job's engines hold no copy of their weights (they take whole-model pushes)."""
    cfg = _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path, ref_backend=ref_backend, kl_penalty=kl_penalty,
               kl_estimator="exact")
    run = setup(cfg, resume=False, log=lambda *_: None)
    try:
        assert (run.ref is not None) == torch_ref
        assert (run.ref_engine is not None) == (ref_backend == "onnxruntime")
        assert run.engine.weights is None and (run.ref_engine is None or run.ref_engine.weights is None)
        assert run.ref_engine is None or not run.ref_engine._prepack  # it only scores: weights mapped, not packed
    finally:
        run.engine.close()


def test_push_via_file_trains_as_the_memory_push(model_dirs, engine_dirs, tmp_path):
    """rollout.push_via: file (pushes written to a scratch graph beside the engine folder, mapped by ONNX Runtime)
    logs what push_via: memory logs: the same bytes reach the same sessions, so rewards, KL and probes match."""
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    rows = {}
    for via in ("memory", "file"):
        cfg = _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / via, push_via=via, kl_estimator="exact")
        rows[via] = read_metrics(run_ppo(cfg, log=lambda *_: None))
    keys = ("reward/mean", "kl/exact", "probe/max_abs_logprob_diff", "engine/weights_version")
    assert [[r.get(k) for k in keys] for r in rows["file"]] == [[r.get(k) for k in keys] for r in rows["memory"]]
    assert rows["file"][-1]["engine/weights_version"] == 2
    assert not list(engine_dirs["tiny-gpt2"].parent.glob(f".{engine_dirs['tiny-gpt2'].name}.push-*"))  # closed


def test_engine_shards_train_as_one_batch(model_dirs, engine_dirs, tmp_path):
    """rollout.engine_shards: 2 reaches the policy engine (its rollouts decoded in two shards on two threads) and the
    reference engine (its scoring in two row ranges), and the run logs what one shard logs: the rows and scores
    are the same, so rewards, KL, probes and versions match."""
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    cfg = _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / "setup", engine_shards=2, ref_backend="onnxruntime")
    run = setup(cfg, resume=False, log=lambda *_: None)
    try:
        assert run.engine.shards == 2 and run.ref_engine.shards == 2
    finally:
        run.engine.close()
    rows = {}
    for shards in (1, 2):
        cfg = _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / str(shards), engine_shards=shards,
                   kl_estimator="exact", ref_backend="onnxruntime")
        rows[shards] = read_metrics(run_ppo(cfg, log=lambda *_: None))
    keys = ("reward/mean", "kl/exact", "probe/max_abs_logprob_diff", "engine/weights_version")
    assert [[r.get(k) for k in keys] for r in rows[2]] == [[r.get(k) for k in keys] for r in rows[1]]
    assert rows[2][-1]["engine/weights_version"] == 2
    with pytest.raises(RefitError, match="rollout.engine_shards = 2 needs rollout.backend onnxruntime"):
        _cfg(model_dirs, engine_dirs, "tiny-gpt2", tmp_path / "torch", engine_shards=2, backend="torch")
