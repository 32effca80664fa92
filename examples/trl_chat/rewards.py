"""Reward functions for examples/trl_chat, in TRL's signature: ``fn(prompts, completions, **columns)``.

The prompts are chat messages, so each completion is ``[{"role": "assistant", "content": text}]`` (as in
TRL's GRPOTrainer); ``answer`` and ``difficulty`` are columns of data.jsonl, passed by name for the same rows.
"""


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs):
    """1.0 when the reply is exactly the answer column, else 0.0."""
    return [float(_text(c).strip() == a) for c, a in zip(completions, answer)]


def carry_bonus(completions, answer, difficulty, **kwargs):
    """Extra credit for a right sum that carries; None (not applicable: left out of the sum and the mean) otherwise."""
    return [float(_text(c).strip() == a) if d == "carry" else None
            for c, a, d in zip(completions, answer, difficulty)]


def digit_share(completions, **kwargs):
    """The share of the reply's characters that are digits (a graded reward: a long, wordy reply scores low)."""
    texts = [_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]
