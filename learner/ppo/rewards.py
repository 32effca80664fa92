"""Rewards: a Python callable ``(prompts, responses) -> list[float]`` or an HF classifier folder.

``load_reward(spec)``:
- ``"exact_match"``: the embedded tasks' exact-match reward (:mod:`learner.examples.tasks`);
- ``"package.module:function"``: any importable callable with that signature;
- a folder path: an HF sequence-classification checkpoint; the reward is the logit of
  ``label_index`` on ``prompt + response``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import torch

from export.errors import RefitError

RewardFn = Callable[[list[str], list[str]], list[float]]


class ClassifierReward:
    """Score ``prompt + response`` with an HF ``AutoModelForSequenceClassification`` folder.

    The reward is the logit of ``label_index``. Texts are padded in batches of ``batch_size`` and cut to
    the model's position limit (from the left, so the response is kept); the model pools the last
    non-padding token as HF's sequence classifiers do.
    """

    def __init__(self, path: str, label_index: int = 0, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"cannot load reward model {path}: {str(e).splitlines()[0]}") from None
        if self.tok.pad_token_id is None or self.model.config.pad_token_id is None:
            raise RefitError(f"reward model {path}: the tokenizer and config need a pad token to score batches")
        if not 0 <= label_index < self.model.config.num_labels:
            raise RefitError(f"reward model {path} has {self.model.config.num_labels} labels; label_index "
                             f"{label_index} is out of range")
        c = self.model.config
        self.max_length = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
        self.tok.truncation_side = "left"
        self.label_index, self.batch_size = label_index, batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        texts = [p + r for p, r in zip(prompts, responses)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                           truncation=self.max_length is not None, max_length=self.max_length)
            out += self.model(**enc).logits[:, self.label_index].float().tolist()
        return out


def load_reward(spec: str) -> RewardFn:
    if spec == "exact_match":
        from learner.examples.tasks import exact_match_reward

        return exact_match_reward
    if Path(spec).is_dir():
        return ClassifierReward(spec)
    if ":" in spec:
        mod, _, fn = spec.partition(":")
        try:
            return getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise RefitError(f"cannot import reward {spec!r}: {e}") from None
    raise RefitError(f"reward {spec!r} is not 'exact_match', 'module:function' or a classifier folder")
