"""Reward sources: an HF sequence-classification folder scores text, and its reward is what PPO optimises."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refit.core.errors import RefitError
from refit.learner.ppo.rewards import ClassifierReward, load_reward


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer):
    """A tiny GPT-2 sequence classifier (1 label, random weights) with the local tokenizer, as an HF folder."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from refit.learner.builtin.models import BOS_ID, EOS_ID, PAD_ID

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tokenizer), num_labels=1,
                     pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
    out = tmp_path_factory.mktemp("reward") / "classifier"
    GPT2ForSequenceClassification(cfg).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _one_by_one(path, texts):
    """Independent reference: each text alone, unpadded, through the loaded model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_classifier_folder_scores_padded_batches_like_single_texts(classifier_dir):
    reward = load_reward(str(classifier_dir))
    assert isinstance(reward, ClassifierReward)
    prompts, responses = ["1+2=", "13+24=", "sort 321 =", "9+9="], ["3", "37", " 123", "18 and more text"]
    got = reward(prompts, responses)
    want = _one_by_one(classifier_dir, [p + r for p, r in zip(prompts, responses)])
    assert len(set(round(w, 6) for w in want)) == 4  # the texts score differently: the test can fail
    assert got == pytest.approx(want, abs=1e-5)
    long = reward(["1+1=" * 200], ["2"])  # over the position limit: cut from the left, still scored
    assert len(long) == 1 and long[0] == long[0]


def test_classifier_bad_label_or_missing_folder_is_one_line(classifier_dir, tmp_path):
    with pytest.raises(RefitError, match="label_index 3 is out of range"):
        ClassifierReward(str(classifier_dir), label_index=3)
    with pytest.raises(RefitError, match="is not 'exact_match'"):
        load_reward(str(tmp_path / "nope"))


def test_classifier_reward_enters_ppo(model_dirs, engine_dirs, classifier_dir, tmp_path):
    """reward/mean of a PPO step is the classifier's mean score of exactly the decoded responses."""
    from refit.learner.ppo.config import PPOConfig
    from refit.learner.ppo.cycle import setup, train_step

    cfg = PPOConfig.from_flat(model_dir=str(model_dirs["tiny-gpt2"]), engine_dir=str(engine_dirs["tiny-gpt2"]),
                    output_dir=str(tmp_path), reward=str(classifier_dir), steps=1, batch_size=4, num_generations=1,
                    num_mini_batches=1, num_ppo_epochs=1, response_length=4, probe_size=2, progress=False,
                    tensorboard=False, plots=False, num_prompts=16, max_operand=9)
    run = setup(cfg, resume=False, log=lambda *_: None)
    (named,) = run.reward_fn
    assert isinstance(named.fn, ClassifierReward) and named.name == "classifier"
    seen = []
    inner = named.fn
    run = replace(run, reward_fn=lambda p, r: seen.append((p, r, inner(p, r))) or seen[-1][2])
    m = train_step(run, 1, log=lambda *_: None)
    (prompts, responses, scores), = seen
    assert scores == pytest.approx(_one_by_one(classifier_dir, [p + r for p, r in zip(prompts, responses)]), abs=1e-5)
    assert m["reward/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
    assert m["reward/<lambda>/mean"] == pytest.approx(m["reward/mean"], abs=1e-6)  # one function, weight 1
    run.engine.close()
