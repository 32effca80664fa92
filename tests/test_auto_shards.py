"""``rollout.engine_shards`` auto (refit.rollout.decode.auto_shards): the rule picks what docs/engine-step.md's
table says, from the layer weights of real configs counted by hand."""

from __future__ import annotations

import pytest
from transformers import GPT2Config

from refit.learner.builtin.published import published_config
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.models import resolve_shards
from refit.rollout.decode import auto_decode_threads, auto_shards, layer_weights

SMALL_GPT2 = GPT2Config(n_layer=4, n_embd=128, n_head=4, n_inner=512)  # the bench's small-gpt2
GPT2_SMALL = GPT2Config(n_layer=12, n_embd=768, n_head=12)  # GPT-2 small (n_inner None: 4 d)


def test_layer_weights_by_hand():
    assert layer_weights(SMALL_GPT2) == 4 * (4 * 128 ** 2 + 2 * 128 * 512) == 786_432
    assert layer_weights(GPT2_SMALL) == 12 * (4 * 768 ** 2 + 2 * 768 * 3072) == 84_934_656
    qwen = published_config("Qwen2.5 0.5B", None)  # SwiGLU: three d x ff matrices
    assert layer_weights(qwen) == 24 * (4 * 896 ** 2 + 3 * 896 * 4864) == 390_856_704


TABLE = [  # (model, rows, 2 threads) -> shards: docs/engine-step.md "Shards: the auto rule"
    (SMALL_GPT2, 8, 1), (SMALL_GPT2, 32, 2), (SMALL_GPT2, 128, 2),
    (GPT2_SMALL, 8, 1), (GPT2_SMALL, 32, 1),
]


@pytest.mark.parametrize("cfg,rows,shards", TABLE, ids=[f"{c.n_embd}-{r}" for c, r, _ in TABLE])
def test_auto_rule_picks_the_table(cfg, rows, shards):
    assert auto_shards(rows, layer_weights(cfg), threads=2) == shards


def test_auto_rule_bounds():
    assert auto_shards(128, 786_432, threads=1) == 1  # one thread: one loop
    assert auto_shards(128, 786_432, threads=16) == 8  # at most one shard per 16 rows
    assert auto_shards(4096, layer_weights(published_config("Qwen2.5 0.5B", None)), threads=16) == 1


def test_ppo_resolves_auto_and_keeps_explicit(model_dirs):
    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), batch_size=16, num_generations=2,
                advantage_estimator="grpo", engine_threads=2)
    lines = []
    auto = resolve_shards(PPOConfig.from_flat(**base), lines.append)
    assert PPOConfig.from_flat(**base).rollout.engine_shards == 0  # the default is auto
    assert auto.rollout.engine_shards == 2 and "engine_shards auto: 2" in lines[0]
    assert resolve_shards(PPOConfig.from_flat(**base, engine_shards=1)).rollout.engine_shards == 1  # explicit wins
    few = resolve_shards(PPOConfig.from_flat(**(base | dict(batch_size=4))), lines.append)
    assert few.rollout.engine_shards == 1  # 8 rows: one loop
    hf = resolve_shards(PPOConfig.from_flat(**(base | dict(backend="hf"))), lines.append)
    assert hf.rollout.engine_shards == 1


DECODE_TABLE = [  # (model, rows, 2 threads) -> a single loop's decode threads: docs/engine-step.md, "Decode threads"
    (SMALL_GPT2, 8, 1), (SMALL_GPT2, 16, 1), (SMALL_GPT2, 24, 2),
    (GPT2_SMALL, 8, 2),  # above the small-model bound: the matmuls split well over intra-op threads
]


@pytest.mark.parametrize("cfg,rows,threads", DECODE_TABLE, ids=[f"{c.n_embd}-{r}" for c, r, _ in DECODE_TABLE])
def test_decode_threads_rule_picks_the_table(cfg, rows, threads):
    assert auto_decode_threads(rows, layer_weights(cfg), threads=2) == threads
    assert auto_decode_threads(rows, layer_weights(cfg), threads=1) == 1


def test_ppo_decodes_a_small_models_few_rows_on_one_thread(model_dirs):
    """Under engine_shards auto with one shard, the policy engine's config gets one intra-op thread (tiny-gpt2, 8
    rows); the run's config (the reference engine's) keeps its threads; two shards or a PyTorch backend: unchanged."""
    from refit.learner.ppo.models import decode_threads

    base = dict(model_dir=str(model_dirs["tiny-gpt2"]), batch_size=4, num_generations=2,
                advantage_estimator="grpo", engine_threads=2)
    lines = []
    cfg = resolve_shards(PPOConfig.from_flat(**base), lines.append)
    assert decode_threads(cfg, lines.append).rollout.engine_threads == 1 and cfg.rollout.engine_threads == 2
    assert "1 shard decoding on 1 of 2 threads" in lines[-1]
    wide = resolve_shards(PPOConfig.from_flat(**(base | dict(batch_size=16))))  # 32 rows: two shards instead
    assert decode_threads(wide).rollout.engine_threads == 2
    torch_side = resolve_shards(PPOConfig.from_flat(**(base | dict(backend="hf"))))
    assert decode_threads(torch_side).rollout.engine_threads == 2
