"""Scale-out: rollout workers on Ray (RayEnginePool) and the DDP learner (refit.learner.run.distributed).

Ray: one local cluster for the module (2 CPUs, no dashboard), a 1-worker and a 2-worker pool on
the tiny-gpt2 ONNX engine (half a CPU each, so both fit). DDP: 2 gloo processes spawned with
torch.multiprocessing against one process running refit.learner.ppo.update.ppo_update on the same Experience.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from refit.core.errors import RefitError
from refit.rollout.engine import Engine
from refit.rollout.types import SamplingParams

from conftest import tiny_distill_config

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [3, 4, 5, 6, 7, 8]]  # 3 chunks of 2: uneven Tp per chunk
SAMPLING = SamplingParams(max_new_tokens=6, seed=3, n=2, top_k=20, return_topk=2)
TOL = dict(atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="scale-out tests need Ray: pip install 'refit[dist]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pools(ray_cluster, engine_dirs):
    from refit.rollout.ray_pool import RayEnginePool

    made = [RayEnginePool("onnxruntime", engine_dirs["tiny-gpt2"], workers=w, chunk=2, cpus_per_worker=0.5,
                          log=lambda *_: None) for w in (1, 2)]
    yield made
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def local_engine(engine_dirs):
    from refit.rollout.engine import create_engine

    eng = create_engine("onnxruntime", engine_dirs["tiny-gpt2"], threads=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def weights(model_dirs):
    """(original, perturbed) HF-named weights of tiny-gpt2."""
    from refit.core.hf_folder import load_model
    from refit.export.weight_map import canonical_params

    named = {k: v.detach().clone() for k, v in canonical_params(load_model(model_dirs["tiny-gpt2"]))[0].items()}
    g = torch.Generator().manual_seed(0)
    return named, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in named.items()}


def chunked_reference(engine, prompts, sampling, chunk=2):
    """What the pool promises: fixed chunks, chunk k seeded chunk_seed(seed, k), merged in order."""
    from refit.rollout.ray_pool import chunk_seed, merge_batches

    parts = [engine.generate(prompts[i:i + chunk], replace(sampling, seed=chunk_seed(sampling.seed, i // chunk)))
             for i in range(0, len(prompts), chunk)]
    return merge_batches(parts, list(range(0, len(prompts), chunk)), sampling)


def assert_same_rollout(a, b):
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "prompt_index", "topk_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("rollout_logprobs", "rollout_plain_logprobs", "topk_logprobs"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), **TOL)
    assert a.weights_version == b.weights_version


# ----------------------------------------------------------------------------- Ray rollout workers


def test_two_workers_give_the_tokens_of_one(pools, local_engine):
    one, two = pools
    # what the learner reads of an engine (the protocol): the workers' folder's manifest, no adapter in this process
    assert isinstance(two, Engine) and two.manifest.dtype == local_engine.manifest.dtype and two.adapter is None
    a, b = one.generate(PROMPTS, SAMPLING), two.generate(PROMPTS, SAMPLING)
    assert_same_rollout(a, b)
    assert a.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert (a.prompt_mask[:, 0] == 0).any() and a.prompt_ids.shape[1] == 6  # re-padded to the widest chunk (left)
    assert_same_rollout(b, chunked_reference(local_engine, PROMPTS, SAMPLING))
    # a batch that fits in one chunk samples exactly like a single engine with the same seed
    assert_same_rollout(two.generate(PROMPTS[:2], SAMPLING), local_engine.generate(PROMPTS[:2], SAMPLING))
    # scoring shards rows over the workers
    s = two.score(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, topk=3)
    torch.testing.assert_close(s.logprobs, b.rollout_plain_logprobs, atol=1e-4, rtol=0)
    assert s.topk_ids.shape == (b.num_rows, b.response_ids.shape[1], 3)


def test_weight_push_reaches_every_worker(pools, local_engine, weights):
    _, two = pools
    original, perturbed = weights
    before = two.generate(PROMPTS, SAMPLING)
    v0 = two.weights_version
    assert v0 == local_engine.weights_version
    try:
        two.update_weights(perturbed)
        local_engine.update_weights(perturbed)
        assert two.worker_versions() == [v0 + 1, v0 + 1] and two.weights_version == local_engine.weights_version
        after = two.generate(PROMPTS, SAMPLING)
        assert not torch.equal(after.rollout_plain_logprobs, before.rollout_plain_logprobs)  # the push took
        assert_same_rollout(after, chunked_reference(local_engine, PROMPTS, SAMPLING))
    finally:
        two.update_weights(original)
        local_engine.update_weights(original)
    restored = two.generate(PROMPTS, SAMPLING)
    assert restored.weights_version == v0 + 2
    torch.testing.assert_close(restored.rollout_plain_logprobs, before.rollout_plain_logprobs, **TOL)


def test_killed_worker_is_restarted_with_the_pushed_weights(pools, weights, ray_cluster):
    _, two = pools
    original, perturbed = weights
    two.update_weights(perturbed)  # the restarted worker must get these back, not the engine folder's
    try:
        want = two.generate(PROMPTS, SAMPLING)
        ray_cluster.kill(two._workers[1])
        got = two.generate(PROMPTS, SAMPLING)
        assert_same_rollout(got, want)
        assert two.worker_versions() == [two.weights_version] * 2
    finally:
        two.update_weights(original)


def test_two_failures_in_a_row_raise(pools, monkeypatch, ray_cluster):
    _, two = pools
    spawn = two._spawn

    def dead_on_arrival(i):
        actor = spawn(i)
        ray_cluster.kill(actor)
        return actor

    monkeypatch.setattr(two, "_spawn", dead_on_arrival)
    monkeypatch.setattr(two, "_last_checkpoint", lambda: "runs/x/checkpoints/step_000004")
    ray_cluster.kill(two._workers[0])
    with pytest.raises(RefitError, match=r"worker 0 failed twice in a row during generate.*step_000004"):
        two.generate(PROMPTS, SAMPLING)
    monkeypatch.undo()
    assert two.generate(PROMPTS[:2], SAMPLING).num_rows == 4  # the next call restarts it again


def test_stale_worker_is_refused(pools, weights, ray_cluster):
    _, two = pools
    original, _ = weights
    ray_cluster.get(two._workers[1].load_weights.remote(original, two.weights_version + 5))
    with pytest.raises(RefitError, match="stale rollout worker 1"):
        two.generate(PROMPTS, SAMPLING)
    two.update_weights(original)  # a push brings every worker to one version again
    assert len(set(two.worker_versions())) == 1


def test_bad_prompt_is_named_by_the_callers_index(pools):
    _, two = pools
    with pytest.raises(RefitError, match="prompt 3 is empty"):
        two.generate(PROMPTS[:3] + [[]], SAMPLING)
    with pytest.raises(RefitError, match="prompt 2 has 200 tokens"):
        two.generate(PROMPTS[:2] + [[5] * 200], SAMPLING)
    with pytest.raises(RefitError, match="on_step.*not available on a Ray engine pool"):  # steps run in the actors
        two.generate(PROMPTS, SAMPLING, on_step=print)


def test_ppo_cycle_with_two_rollout_workers(pools, model_dirs, engine_dirs, tmp_path):
    """train_step through a RayEnginePool: rollouts, weight push, parity probe on the pool's score()."""
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import setup, train_step

    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                    output_dir=str(tmp_path), steps=1, batch_size=4, num_generations=2, advantage_estimator="gae",
                    num_mini_batches=2,
                    num_ppo_epochs=1, response_length=4, save_steps=1, probe_size=4, progress=False,
                    tensorboard=False, plots=False, max_operand=9, num_prompts=16, rollout_workers=2,
                    rollout_worker_cpus=0.25)
    run = setup(cfg, resume=False, log=lambda *_: None)
    try:
        assert type(run.engine).__name__ == "RayEnginePool" and run.engine.workers == 2
        m = train_step(run, 1, log=lambda *_: None)
        assert m["engine/weights_version"] == 1 and m["probe/max_abs_logprob_diff"] <= cfg.rollout.probe_tol
    finally:
        run.engine.close()


def test_overlapped_ppo_cycle_with_two_rollout_workers(pools, model_dirs, engine_dirs, tmp_path):
    """rollout.max_staleness 1 over a RayEnginePool: the background thread waits on the actors (generation in
    their processes), each push queued behind it on that thread; step 2's batch is one push behind; step 1's push
    is checked on the probe batch and logged on step 2's row (the last, which also waits for its own)."""
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import setup, train_step

    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                              output_dir=str(tmp_path), steps=2, batch_size=4, num_generations=2,
                              advantage_estimator="grpo", num_mini_batches=1, num_ppo_epochs=1, response_length=4,
                              save_steps=2, probe_size=4, progress=False, tensorboard=False, plots=False,
                              max_operand=9, num_prompts=16, rollout_workers=2, rollout_worker_cpus=0.25,
                              max_staleness=1)
    n = torch.get_num_threads()
    run = setup(cfg, resume=False, log=lambda *_: None)
    try:
        rows = [train_step(run, s, log=lambda *_: None) for s in (1, 2)]
        assert [m["mismatch/version_lag"] for m in rows] == [0, 1]
        assert [m["engine/weights_version"] for m in rows] == [1, 2]
        assert "probe/max_abs_logprob_diff" not in rows[0]
        assert rows[1]["probe/max_abs_logprob_diff"] <= cfg.rollout.probe_tol
    finally:
        run.ahead.close()
        run.engine.close()
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- DDP learner

DDP_SETTINGS = dict(num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=2, cliprange=0.2,
                    cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.01, max_grad_norm=1.0, temperature=1.0)


def _learner(model_dir):
    from refit.core.hf_folder import load_model
    from refit.learner.run.policy import ValueHead, hidden_size

    torch.manual_seed(0)
    policy = load_model(model_dir)
    vh = ValueHead(hidden_size(policy))
    torch.nn.init.normal_(vh.summary.weight, std=0.1)
    opt = torch.optim.SGD(list(policy.parameters()) + list(vh.parameters()), lr=0.5)
    return policy, vh, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _fixed_rows(g: torch.Generator):
    """8 rows: left-padded prompts (B, 5) and responses of unequal length (B, 4), so ranks see unequal
    token counts. Returns prompt ids, prompt mask, response ids, response mask (float)."""
    b, tp, tr = 8, 5, 4
    plen, rlen = [5, 2, 3, 1, 4, 5, 2, 3], [4, 1, 2, 4, 3, 1, 4, 2]
    pmask = torch.tensor([[0] * (tp - n) + [1] * n for n in plen])
    pids = torch.randint(3, 60, (b, tp), generator=g) * pmask
    mask = torch.tensor([[1.0] * n + [0.0] * (tr - n) for n in rlen])
    return pids, pmask, (torch.randint(3, 60, (b, tr), generator=g) * mask).long(), mask


def _fixed_experience(model_dir):
    """An Experience on :func:`_fixed_rows` with the learner's own log-probs and values."""
    from refit.learner.ppo.update import Experience
    from refit.learner.run.policy import learner_view

    g = torch.Generator().manual_seed(1)
    pids, pmask, rids, mask = _fixed_rows(g)
    b, tr = rids.shape
    batch = SimpleNamespace(num_rows=b, prompt_ids=pids, prompt_mask=pmask, response_ids=rids, is_seq2seq=False)
    policy, vh, _, _ = _learner(model_dir)
    old, values, _ = learner_view(policy, vh, batch, 1.0)
    adv = torch.randn(b, tr, generator=g) * mask
    returns = (values + torch.randn(b, tr, generator=g)) * mask
    return Experience(pids, pmask, rids, mask, old * mask, old * mask, values * mask, adv, returns, None)


def _ddp_rank(rank, world, port, model_dir, exp_path, out_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from refit.learner.run.distributed import init_from_env
    from refit.learner.ppo.update import UpdateSettings, distributed_ppo_update

    ctx = init_from_env("cpu")
    policy, vh, opt, sched = _learner(model_dir)
    mine = torch.load(exp_path, weights_only=False) if ctx.is_main else None
    exp = ctx.share(mine)  # rank 0's Experience on every rank
    ctx.wrap(policy, vh)
    stats = distributed_ppo_update(ctx, policy, vh, opt, sched, exp, UpdateSettings(**DDP_SETTINGS),
                                   torch.Generator().manual_seed(7))
    params = {k: v.detach().clone() for k, v in [*policy.named_parameters(), *vh.named_parameters()]}
    torch.save({"params": params, "stats": stats}, f"{out_path}.{rank}")
    ctx.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(fn, model_dir, in_path, out_path, world: int = 2, timeout_s: float = 180):
    """Run ``fn(rank, world, port, model_dir, in_path, out_path)`` on ``world`` spawned gloo ranks; wait."""
    import torch.multiprocessing as mp

    procs = mp.start_processes(fn, args=(world, _free_port(), model_dir, str(in_path), str(out_path)), nprocs=world,
                               join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1):
            assert time.monotonic() < deadline, "DDP ranks did not finish in time"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()


def test_ddp_two_ranks_update_like_one_process(model_dirs, tmp_path):
    """2 gloo ranks (each a slice of every minibatch, accumulation, 2 epochs) == ppo_update on the global batch."""
    from refit.learner.ppo.update import UpdateSettings, ppo_update

    model_dir = str(model_dirs["tiny-gpt2"])
    exp = _fixed_experience(model_dir)
    torch.save(exp, tmp_path / "exp.pt")
    policy, vh, opt, sched = _learner(model_dir)
    want_stats = ppo_update(policy, vh, opt, sched, exp, UpdateSettings(**DDP_SETTINGS),
                            torch.Generator().manual_seed(7))
    want = {k: v.detach() for k, v in [*policy.named_parameters(), *vh.named_parameters()]}

    _spawn_ranks(_ddp_rank, model_dir, tmp_path / "exp.pt", tmp_path / "out")
    outs = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    start = dict(_learner(model_dir)[0].named_parameters())
    moved = max(float((want[k] - p.detach()).abs().max()) for k, p in start.items())
    assert moved > 1e-3  # the update did something
    for out in outs:
        for k, v in want.items():
            torch.testing.assert_close(out["params"][k], v, **TOL, msg=k)
    for key in ("pg_loss", "vf_loss", "entropy", "grad_norm"):
        assert abs(outs[0]["stats"][key] - want_stats[key]) <= 1e-5, (key, outs[0]["stats"][key], want_stats[key])


@pytest.mark.slow
def test_ddp_cycle_resumes_with_another_world_size(model_dirs, engine_dirs, tmp_path):
    """torchrun 2 ranks for step 1 (checkpoint), then 1 process resumes step 2 == 1 process for both steps."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import run_ppo
    from refit.learner.run.metrics import read_metrics

    kw = dict(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]), steps=2,
              batch_size=4, num_generations=2, advantage_estimator="gae", num_mini_batches=2, num_ppo_epochs=1,
              response_length=4,
              save_steps=1, probe_size=4, progress=False, tensorboard=False, plots=False, max_operand=9,
              num_prompts=16, learning_rate=1e-3, device="cpu", reward="refit.bench.ppo:length_reward",
              export_final=False)
    want = read_metrics(run_ppo(PPOConfig.from_flat(output_dir=str(tmp_path / "one"), **kw), log=lambda *_: None))
    flags = [x for k, v in {**kw, "output_dir": str(tmp_path / "two"), "max_steps_this_run": 1}.items()
             for x in (f"--{k}", str(v))]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "refit", "ppo", *flags], capture_output=True, text=True, timeout=300, env=env,
                       cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((tmp_path / "two" / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["step"] == 1 and len(read_metrics(tmp_path / "two")) == 1  # rank 0 alone wrote them
    got = read_metrics(run_ppo(PPOConfig.from_flat(output_dir=str(tmp_path / "two"), **kw), resume=True,
                               log=lambda *_: None))
    assert [row["step"] for row in got] == [1, 2]
    for a, b in zip(want, got):
        for key in ("reward/mean", "kl/exact", "ppo/pg_loss", "ppo/vf_loss", "ppo/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


# ----------------------------------------------------------------------------- distillation: Ray engines, DDP


def _distill_cfg(model_dirs, engine_dirs, out, **kw):
    """conftest's tiny distillation config, smaller still: Ray workers and DDP ranks multiply its cost."""
    small = dict(steps=2, batch_size=4, eval_size=4, num_prompts=32, teacher_topk=4, lmbda=1.0, loss="topk_kl",
                 device="cpu", export_final=False)
    return tiny_distill_config(model_dirs, engine_dirs, out, **{**small, **kw})


def test_distill_step_with_two_engine_workers_per_model(pools, model_dirs, engine_dirs, tmp_path):
    """rollout_workers=2: teacher and student engines are 2-actor pools; the student generates (lmbda=1), the
    teacher pool scores top-k, the push reaches both student actors, and the step equals one local engine's."""
    from refit.learner.distill.cycle import setup, train_step

    def one_step(workers):
        cfg = _distill_cfg(model_dirs, engine_dirs, tmp_path / f"w{workers}", rollout_workers=workers,
                           rollout_worker_cpus=0.125)
        run = setup(cfg, resume=False, log=lambda *_: None)
        try:
            m = train_step(run, 1)
            versions = run.student_engine.worker_versions() if workers > 1 else [run.student_engine.weights_version]
            kinds = (type(run.teacher.inner).__name__, type(run.student_engine).__name__)
            return m, versions, kinds
        finally:
            run.student_engine.close()
            run.teacher.close()

    m2, versions, kinds = one_step(2)
    assert kinds == ("RayEnginePool", "RayEnginePool") and versions == [1, 1]
    assert m2["student/generated"] == 1 and m2["teacher/engine_score"] == 1
    assert m2["probe/max_abs_logprob_diff"] <= 1e-3
    m1, _, _ = one_step(1)
    for key in ("loss", "distill/topk_kl", "grad_norm", "response/length"):
        assert abs(m1[key] - m2[key]) <= 1e-5 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])


def test_pool_that_cannot_fit_fails_in_one_line(ray_cluster, engine_dirs):
    from refit.rollout.ray_pool import RayEnginePool

    with pytest.raises(RefitError, match="Ray cluster has 2 in all") as e:
        RayEnginePool("onnxruntime", engine_dirs["tiny-gpt2"], workers=3, cpus_per_worker=1.0, log=lambda *_: None)
    assert "\n" not in str(e.value)


def _distill_batch(model_dir):
    """:func:`_fixed_rows` with random full-vocabulary teacher logits."""
    from refit.core.hf_folder import load_model
    from refit.learner.distill.batch import DistillBatch

    g = torch.Generator().manual_seed(2)
    pids, pmask, rids, mask = _fixed_rows(g)
    b, tr = rids.shape
    v = load_model(model_dir).config.vocab_size
    batch = DistillBatch(pids, pmask, rids, mask, "dataset", False)
    batch.teacher_logits = 3 * torch.randn(b, tr, v, generator=g)
    return batch


def _distill_learner(model_dir, out, dist):
    from refit.core.hf_folder import load_model
    from refit.learner.distill.cycle import Run

    cfg = _distill_cfg({"tiny-llama": model_dir, "tiny-gpt2": model_dir}, {"tiny-llama": "", "tiny-gpt2": ""}, out,
                       batch_size=8, gradient_accumulation_steps=2, loss="jsd", lmbda=0.0, beta=0.3)
    torch.manual_seed(0)
    student = load_model(model_dir)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    dist.wrap(student)
    return Run(cfg, out, None, student, None, None, None, opt, sched, [], [], None, False, 0, "left", dist=dist)


def _distill_rank(rank, world, port, model_dir, batch_path, out_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from refit.learner.distill.cycle import update
    from refit.learner.run.distributed import init_from_env

    ctx = init_from_env("cpu")
    run = _distill_learner(model_dir, out_path, ctx)
    b = ctx.share(torch.load(batch_path, weights_only=False) if ctx.is_main else None)
    stats = update(run, b)
    torch.save({"params": {k: v.detach().clone() for k, v in run.student.named_parameters()}, "stats": stats},
               f"{out_path}.{rank}")
    ctx.close()


def test_ddp_two_ranks_distill_update_like_one_process(model_dirs, tmp_path):
    """2 gloo ranks (a slice of rows each, 2 micro-batches each) == refit.learner.distill.cycle.update on the whole batch."""
    from refit.learner.distill.cycle import update
    from refit.learner.run.distributed import DistContext

    model_dir = str(model_dirs["tiny-gpt2"])
    batch = _distill_batch(model_dir)
    torch.save(batch, tmp_path / "batch.pt")
    run = _distill_learner(model_dir, tmp_path, DistContext())
    start = {k: v.detach().clone() for k, v in run.student.named_parameters()}
    want_stats = update(run, batch)
    want = dict(run.student.named_parameters())
    moved = max(float((want[k].detach() - v).abs().max()) for k, v in start.items())
    assert moved > 1e-3  # the update did something

    _spawn_ranks(_distill_rank, model_dir, tmp_path / "batch.pt", tmp_path / "out")
    for r in range(2):
        out = torch.load(tmp_path / f"out.{r}", weights_only=False)
        for k, v in want.items():
            torch.testing.assert_close(out["params"][k], v.detach(), **TOL, msg=k)
        for key in ("loss", "distill/jsd", "grad_norm"):
            assert abs(out["stats"][key] - want_stats[key]) <= 1e-5, (key, out["stats"][key], want_stats[key])
    assert abs(want_stats["loss"] - want_stats["distill/jsd"]) <= 1e-6  # loss-like stats are sums, like the loss


@pytest.mark.parametrize("backend,share,gpus", [("tensorrt", 1.0, 1.0), ("tensorrt", 0.5, 0.5), ("onnxruntime", 1.0, 0.0)])
def test_worker_resources_follow_the_backend(monkeypatch, tmp_path, backend, share, gpus):
    """CPU-side check of what a GPU run would reserve: a TensorRT engine actor asks Ray for (a share of) a GPU,
    since Ray hides the GPUs from an actor that reserved none; other backends ask for none by default."""
    import refit.rollout.ray_pool
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.run.engines import make_engine

    seen = {}
    monkeypatch.setattr(refit.rollout.ray_pool, "RayEnginePool", lambda *a, **kw: seen.update(kw) or "pool")
    cfg = PPOConfig.from_flat(backend=backend, rollout_workers=2, rollout_worker_cpus=0.75)
    assert make_engine(cfg, tmp_path, tmp_path, gpu_share=share) == "pool"
    assert (seen["workers"], seen["cpus_per_worker"], seen["gpus_per_worker"]) == (2, 0.75, gpus)
    make_engine(PPOConfig.from_flat(backend=backend, rollout_workers=2, rollout_worker_gpus=0.25), tmp_path, tmp_path)
    assert seen["gpus_per_worker"] == 0.25  # an explicit setting wins
