"""The one-pass update (refit/learner/ppo/onepass.py) against the two-pass update it replaces: the same step taken from
the same rollout (metrics, loss terms, updated weights) within fp32 summation noise, with gradient accumulation,
with and without a reference, with the reference scored ahead on the engine's threads or inline; KL(0) = 0; the
rule that says when a run streams, and the update route (refit.learner.ppo.route) setup picks, with its reason line."""

from __future__ import annotations

import pytest
import torch

from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import setup, train_step, update_settings
from refit.learner.ppo.route import ScoreThenUpdate, SinglePassUpdate, StreamingUpdate, choose_route


def _run(model_dirs, engine_dirs, tmp_path, name: str, log=lambda *_: None, **over):
    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                output_dir=str(tmp_path / name), steps=2, batch_size=4, num_generations=2,
                advantage_estimator="grpo", num_mini_batches=1, num_ppo_epochs=1, response_length=6, probe_size=2,
                progress=False, tensorboard=False, plots=False, num_prompts=16, max_operand=9, learning_rate=1e-3,
                kl_coef=0.0, kl_penalty="loss", gradient_accumulation_steps=4,
                reward="refit.learner.builtin.tasks:length_reward")  # varied rewards: a non-zero step
    return setup(PPOConfig.from_flat(**(base | over)), resume=False, log=log)


def step_difference(w0, w1, w2) -> tuple[float, float]:
    """(the largest element of step 1 (w1 - w0), the distance of the two steps relative to it in norm:
    |(w1 - w0) - (w2 - w0)| / |w1 - w0| over every weight)."""
    d1 = torch.cat([(a - z).flatten() for a, z in zip(w1, w0)])
    d2 = torch.cat([(b - z).flatten() for b, z in zip(w2, w0)])
    return float(d1.abs().max()), float((d1 - d2).norm() / d1.norm())


def _step(run):
    """Step 1 of ``run``: (metrics, the policy's weights after it, policy forwards during it)."""
    calls = []
    hook = run.policy.register_forward_hook(lambda *_: calls.append(1))
    m = train_step(run, 1, log=lambda *_: None)
    hook.remove()
    weights = [p.detach().clone() for p in run.policy.parameters()]
    for engine in {id(e): e for e in (run.engine, run.ref_engine) if e is not None}.values():
        engine.close()
    return m, weights, len(calls)


CASES = {
    "no-reference": {},
    "k3-loss-ahead": dict(kl_coef=0.1, kl_estimator="k3", reference_ahead=True),
    "k3-loss-inline": dict(kl_coef=0.1, kl_estimator="k3"),
    "exact-loss": dict(kl_coef=0.1, kl_estimator="exact"),
    "tis-rloo": dict(advantage_estimator="rloo", mismatch_correction="tis"),
    "torch-reference": dict(kl_coef=0.1, kl_estimator="k2", ref_backend="torch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_onepass_equals_two_passes(model_dirs, engine_dirs, tmp_path, case):
    """The same step through one pass (old log-probs from the update's forward, 4 micro-batches) and through a
    scoring pass + the update: equal metrics and weights, GA + chunks forwards fewer, ratio exactly 1."""
    over = CASES[case]
    lines = []
    one = _run(model_dirs, engine_dirs, tmp_path, "one", log=lines.append, **over)
    assert isinstance(one.route, StreamingUpdate)
    routed = [ln for ln in lines if "update route" in ln]
    assert routed == [f"refit ppo: update route one-pass streaming ({one.route.why})"]
    two = _run(model_dirs, engine_dirs, tmp_path, "two", single_pass=False, **over)
    assert isinstance(two.route, ScoreThenUpdate) and two.route.why == "single_pass false"
    m1, w1, n1 = _step(one)
    m2, w2, n2 = _step(two)
    assert n1 == 4 and n2 == 5  # two-pass: one scoring forward (8 rows, one chunk) more than the 4 micro-batches
    assert m1["time/score"] == 0.0 and m2["time/score"] > 0.0
    keys = ["ppo/pg_loss", "ppo/approx_kl", "ppo/clipfrac", "ppo/entropy", "policy/entropy", "reward/mean",
            "mismatch/max_abs_diff", "mismatch/mean_abs_diff", "reward/std"]
    if over.get("kl_coef"):
        keys += ["kl/k1", "kl/k2", "kl/k3", "kl/exact", "ppo/kl_loss"]
    else:  # no KL in the objective: the reference is not scored (TRL at beta 0), no kl/* figures
        assert not any(k.startswith("kl/") and k != "kl/coef" for k in m1) and "ppo/kl_loss" not in m1
        assert not any(k.startswith("kl/") and k != "kl/coef" for k in m2)
    if over.get("mismatch_correction") == "tis":
        keys += ["mismatch/tis_grad_scale", "ppo/is_weights_mean"]
    for key in keys:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["ppo/ratio_max"] == 1.0  # the old log-probs ARE the update's (detached)
    if over.get("kl_coef"):
        assert abs(m1["kl/k1"]) <= 1e-6 and abs(m1["kl/exact"]) <= 1e-6  # KL(0): policy == reference at step 1
    w0 = [p.detach() for p in _run(model_dirs, engine_dirs, tmp_path, "fresh", **over).policy.parameters()]
    moved, off = step_difference(w0, w1, w2)
    # the same (non-zero) step: oneDNN's fp32 sums (run.cpu_matmul auto) depend on a matmul's rows, so the scoring
    # pass (8 rows) and the micro-batches (2) differ in the last bits, which Adam's first step (g / (|g| + eps))
    # magnifies on near-zero gradients (one element's max difference: 1.2e-3 of the step on an AMD EPYC, 7.3e-3 on an
    # Intel Xeon); the steps' relative distance in norm is the measure, a wrong step differs by O(1)
    assert moved > 1e-4 and off < 1e-2, (moved, off)


def test_reference_always_logs_kl_at_zero_coef(model_dirs, engine_dirs, tmp_path):
    m, _, _ = _step(_run(model_dirs, engine_dirs, tmp_path, "always", reference="always"))
    assert abs(m["kl/k1"]) <= 1e-6 and abs(m["kl/exact"]) <= 1e-6 and "ppo/kl_loss" not in m


RULE = [  # (overrides, one pass?): each case of the module docstring
    ({}, True),
    (dict(gradient_accumulation_steps=1), True),
    (dict(single_pass=False), False),
    (dict(num_ppo_epochs=2), False),
    (dict(num_mini_batches=2, gradient_accumulation_steps=2), False),
    (dict(advantage_estimator="gae", num_generations=1, batch_size=8), False),
    (dict(kl_penalty="reward", kl_coef=0.05), False),
    (dict(kl_penalty="reward", kl_coef=0.0), True),
    (dict(kl_penalty="loss", kl_coef=0.05), True),
    (dict(mismatch_correction="seq_mask"), False),
    (dict(mismatch_correction="tis"), True),
    ({"run.precision": "bf16"}, True),  # bf16 autocast: the old log-probs and the reference under it too
]


@pytest.mark.parametrize("over,expected", RULE, ids=[str(o) for o, _ in RULE])
def test_streamable_rule(over, expected):
    cfg = PPOConfig.from_flat(**(dict(batch_size=4, num_generations=2, advantage_estimator="grpo", num_mini_batches=1,
                                      num_ppo_epochs=1, kl_coef=0.0, kl_penalty="loss",
                                      gradient_accumulation_steps=4) | over))
    s = update_settings(cfg, cfg.kl_coef, False)
    assert isinstance(choose_route(cfg, s, False, cfg.kl_coef), StreamingUpdate) is expected
    assert isinstance(choose_route(cfg, s, True, cfg.kl_coef), ScoreThenUpdate)  # torchrun: never one pass


ROUTES = {  # config -> (route, its reason line as setup logs it)
    "demo": (ScoreThenUpdate, "refit ppo: update route score-then-update (2 PPO epochs, 2 minibatches)"),
    "grpo": (StreamingUpdate, "refit ppo: update route one-pass streaming (grpo: no value head, 1 epoch, 1 minibatch, "
                              "no reference scored at kl_coef 0)"),
    "gae": (SinglePassUpdate, "refit ppo: update route single pass (1 epoch, 1 minibatch, no accumulation; not "
                              "streamed: a value head (gae: the advantages need every row's values), the KL penalty "
                              "in the reward at kl_coef 0.05)"),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_route_chosen_once_with_its_reason(name):
    """The route setup picks (and the line it logs) for the demo's PPO config (GAE, 2 epochs x 2 minibatches), TRL's
    GRPOConfig defaults through the facade (beta 0, num_iterations 1) and a PPO config with a value head at one
    epoch and one minibatch (PPOConfig's defaults otherwise: the KL penalty in the reward)."""
    from pathlib import Path

    from refit.learner.demo import DemoConfig, ppo_config
    from refit.learner.trl.grpo import GRPOConfig, to_ppo_config

    cfg = {"demo": lambda: ppo_config(DemoConfig(), Path("policy")),
           "grpo": lambda: to_ppo_config(GRPOConfig(output_dir="out", max_steps=10), "model"),
           "gae": lambda: PPOConfig.from_flat(advantage_estimator="gae", num_ppo_epochs=1, num_mini_batches=1)}[name]()
    route = choose_route(cfg, update_settings(cfg, cfg.kl_coef, False), False, cfg.kl_coef)
    kind, line = ROUTES[name]
    assert type(route) is kind and f"refit ppo: update route {route.name} ({route.why})" == line


def test_route_declines_a_step_it_cannot_take():
    """Step-time conditions: the single pass declines a batch over one forward's rows; streaming with an adaptive KL
    coefficient in the reward declines once the coefficient is not 0; the others take every step."""
    from dataclasses import replace

    gae = PPOConfig.from_flat(advantage_estimator="gae", num_ppo_epochs=1, num_mini_batches=1)
    s = replace(update_settings(gae, gae.kl_coef, False), micro_rows=8)
    single = choose_route(gae, s, False, gae.kl_coef)
    assert single.declines(s, 8, gae.kl_coef) is None and "16 rows" in single.declines(s, 16, gae.kl_coef)
    assert choose_route(gae, replace(s, gradient_accumulation_steps=2), False, 0.05).declines(s, 16, 0.05) is None
    rloo = PPOConfig.from_flat(advantage_estimator="rloo", num_generations=2, num_ppo_epochs=1, num_mini_batches=1,
                               kl_coef=0.0, adap_kl_ctrl=True)
    stream = choose_route(rloo, update_settings(rloo, 0.0, False), False, 0.0)
    assert isinstance(stream, StreamingUpdate) and "adaptive KL re-checked each step" in stream.why
    assert stream.declines(s, 64, 0.0) is None and "adaptive KL coefficient is 0.01" in stream.declines(s, 64, 0.01)


def test_micro_rows_at_qwen25_05b_full_depth(tmp_path):
    """Auto micro-batches at Qwen2.5-0.5B's published geometry (24 layers, hidden 896, MLP 4864, 14 heads, vocab
    151936), rows of 40 prompt + 64 response tokens, against the hand count of refit.core.memory's bytes per row."""
    from refit.core.memory import auto_learner_rows, geometry
    from refit.learner.builtin.published import published_config
    from refit.learner.run.engines import learner_micro_rows

    published_config("Qwen2.5 0.5B", None).save_pretrained(tmp_path)  # the config, and an empty weights file
    (tmp_path / "model.safetensors").write_bytes(b"")
    g = geometry(tmp_path)
    per_row = 4 * 64 * 151936 * 2 + 4 * 104 * 24 * (4 * 896 + 11 * 4864 + 2 * 14 * 104)  # logits x2, activations
    assert per_row == 676_831_232
    assert auto_learner_rows(g, 104, 64, free=64 << 30) == (5 << 30) // 2 // per_row == 3  # the 2.5 GiB cap
    assert auto_learner_rows(g, 104, 64, free=4 << 30) == (1 << 30) // per_row == 1  # a quarter of the free memory
    assert learner_micro_rows(g, 2, 104, 64, free=64 << 30) == 2  # gradient_accumulation_steps' rows are fewer
    assert learner_micro_rows(g, 64, 104, 64, explicit=20, free=1) == 20  # an explicit value wins
    assert learner_micro_rows(g, 64, 104, 64, explicit=30, free=1) == 30  # ... as given, not evened out
    assert learner_micro_rows(g, 64, 104, 64, free=1) == 1
    assert learner_micro_rows(g, 64, 104, 64, free=64 << 30) == 3  # 21 micro-batches of 3 and one of 1


def test_micro_rows_token_cap_and_even_split():
    """A small model's rows are capped by positions (LEARNER_TOKENS), not bytes, and split evenly: 128 rows of 160
    positions at a cap of 4096 // 160 = 25 rows a forward run as 6 micro-batches of 22 (the last 18)."""
    from refit.core.memory import LEARNER_TOKENS, Geometry, auto_learner_rows
    from refit.learner.run.engines import learner_micro_rows

    g = Geometry(layers=2, hidden=128, intermediate=512, heads=4, kv_dim=128, vocab=4096, params=900_000)
    assert LEARNER_TOKENS == 4096
    assert auto_learner_rows(g, 160, 128, free=64 << 30) == 25
    assert learner_micro_rows(g, 128, 160, 128, free=64 << 30) == 22
    assert learner_micro_rows(g, 100, 160, 128, free=64 << 30) == 25  # 4 x 25: already even
    assert learner_micro_rows(g, 8, 160, 128, free=64 << 30) == 8  # fewer rows than the cap: one forward


def test_uneven_micro_batches_equal_two_passes(model_dirs, engine_dirs, tmp_path):
    """3 rows per forward over 8 rows (3 + 3 + 2): the loss is normalised by the batch's tokens, so the step is the
    two-pass step's."""
    over = dict(kl_coef=0.1, kl_estimator="k3", gradient_accumulation_steps=1, micro_batch_rows=3)  # both paths
    first = _run(model_dirs, engine_dirs, tmp_path, "uneven", **over)
    w0 = [p.detach().clone() for p in first.policy.parameters()]
    m1, w1, n1 = _step(first)
    m2, w2, _ = _step(_run(model_dirs, engine_dirs, tmp_path, "two", single_pass=False, **over))
    for key in ("ppo/pg_loss", "ppo/entropy", "kl/k3", "ppo/kl_loss"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    moved, off = step_difference(w0, w1, w2)  # (max element difference 1.16e-6 on an Intel Xeon, 1e-6 before)
    assert moved > 1e-4 and off < 1e-2, (moved, off)
    assert n1 == 3  # three forwards (the push is checked on the next rollout: probe_on_rollout)


def _uneven(batch, lengths: list[int], eos: int):
    """``batch`` with row i's response cut to ``lengths[i]`` tokens, the last one ``eos`` (a valid RolloutBatch)."""
    from dataclasses import replace

    ids, mask = batch.response_ids.clone(), batch.response_mask.clone()
    lp, plain = batch.rollout_logprobs.clone(), batch.rollout_plain_logprobs.clone()
    for i, n in enumerate(lengths):
        ids[i, n - 1], ids[i, n:], mask[i, :n], mask[i, n:], lp[i, n:], plain[i, n:] = eos, batch.pad_id, 1, 0, 0, 0
    return replace(batch, response_ids=ids, response_mask=mask, rollout_logprobs=lp, rollout_plain_logprobs=plain)


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-llama", "tiny-t5"])
def test_trimmed_rows_forward_the_same_logits(model_dirs, arch):
    """A group of rows without its all-padding columns (RolloutBatch.trimmed): the prompt's padding on its side
    and the response past the longest row gone, every kept response position's logits those of the whole batch's
    forward (to fp32 GEMM blocking: 1e-5), at prompts of different lengths."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from refit.learner.ppo.onepass import micro_batches
    from refit.learner.run.policy import response_forward
    from refit.rollout.types import RolloutBatch, SamplingParams

    s2s = arch == "tiny-t5"
    model = (AutoModelForSeq2SeqLM if s2s else AutoModelForCausalLM).from_pretrained(model_dirs[arch]).eval()
    tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    texts = ["1+2=", "a much longer prompt of several words here", "9+9=", "x", "some middle prompt", "7+3="]
    enc = tok(texts, padding=True, return_tensors="pt", padding_side="right" if s2s else "left")
    b, tr = len(texts), 10
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(5, model.config.vocab_size, (b, tr), generator=g)
    full = RolloutBatch(prompt_ids=enc.input_ids, prompt_mask=enc.attention_mask, response_ids=resp,
                        response_mask=torch.ones(b, tr), rollout_logprobs=torch.full((b, tr), -1.0),
                        rollout_plain_logprobs=torch.full((b, tr), -1.0), prompt_index=torch.arange(b),
                        weights_version=0, sampling=SamplingParams(max_new_tokens=tr), is_seq2seq=s2s,
                        pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    batch = _uneven(full, [3, 10, 2, 7, 4, 6], tok.eos_token_id).check()
    groups = micro_batches(batch, 2)
    assert [r.tolist() for r in groups] == [[1, 3], [4, 5], [0, 2]]  # by length, longest first; in batch order
    whole = response_forward(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, s2s).logits
    for r in groups:
        part = batch.rows(r).trimmed().check()
        w = part.response_ids.shape[1]
        assert w == int(batch.response_mask[r].sum(1).max())
        assert part.prompt_ids.shape[1] == int(batch.prompt_mask[r].sum(1).max())  # only real prompt columns
        got = response_forward(model, part.prompt_ids, part.prompt_mask, part.response_ids, s2s).logits
        keep = part.response_mask.bool()
        torch.testing.assert_close(got[keep], whole[r][:, :w][keep], rtol=1e-5, atol=1e-5)
        # widths rounded up to 8: more padding columns (the prompt's beyond the batch's own), the same logits
        wide = batch.rows(r).trimmed(8).check()
        assert wide.prompt_ids.shape[1] % 8 == 0 and wide.response_ids.shape[1] % 8 == 0
        assert wide.prompt_ids.shape[1] >= part.prompt_ids.shape[1] and wide.response_mask.sum() == keep.sum()
        got8 = response_forward(model, wide.prompt_ids, wide.prompt_mask, wide.response_ids, s2s).logits
        torch.testing.assert_close(got8[:, :w][keep], whole[r][:, :w][keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [1, 8])
def test_length_grouped_micro_batches_equal_two_passes(model_dirs, engine_dirs, tmp_path, monkeypatch, step):
    """Responses of different lengths, 3 rows a forward: the one-pass update forwards each group of rows by length
    without its padding columns (narrower forwards than the batch at exact widths; at WIDTH_STEP 8, wider ones of 8
    response columns, padding added), and takes the two-pass step (full-width scoring and update forwards): the same
    metrics, KL(0) = 0 by the exact estimator, the same weights."""
    import refit.learner.ppo.onepass as onepass

    monkeypatch.setattr(onepass, "WIDTH_STEP", step)
    over = dict(kl_coef=0.1, kl_estimator="exact", gradient_accumulation_steps=1, micro_batch_rows=3)
    lengths = [6, 2, 5, 1, 3, 6, 4, 2]
    runs = [_run(model_dirs, engine_dirs, tmp_path, name, **over, **extra)
            for name, extra in (("grouped", {}), ("two", dict(single_pass=False)))]
    widths = []
    for run in runs:
        gen = run.engine.generate
        run.engine.generate = lambda *a, _gen=gen, **k: _uneven(b := _gen(*a, **k), lengths[:b.num_rows], b.eos_id)
    hook = runs[0].policy.register_forward_hook(lambda m, args, kw, out: widths.append(kw["input_ids"].shape[1]),
                                                with_kwargs=True)
    w0 = [p.detach().clone() for p in runs[0].policy.parameters()]
    m1, w1, n1 = _step(runs[0])
    hook.remove()
    m2, w2, _ = _step(runs[1])
    if step == 1:
        assert n1 == 3 and min(widths) <= max(widths) - 3  # response groups 6-5, 4-2, 2-1 tokens wide (not 6 each)
    else:
        assert n1 == 3 and all(w % 8 == 0 for w in widths)  # prompt and response widths, each a multiple of 8
    for key in ("ppo/pg_loss", "ppo/entropy", "policy/entropy", "kl/k3", "kl/exact", "ppo/kl_loss", "reward/mean",
                "mismatch/mean_abs_diff"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert abs(m1["kl/exact"]) <= 1e-6
    moved, off = step_difference(w0, w1, w2)
    assert moved > 1e-4 and off < 1e-2, (moved, off)
