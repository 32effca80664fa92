"""The reward of ``refit bench grpo``: one plain function that both sides load by this file's path.

Refit's ``refit ppo`` takes it as ``--reward refit/bench/grpo_reward.py:reward``; the TRL side
(refit/bench/trl_grpo_side.py) loads the same file with ``importlib`` and hands the function to
``GRPOTrainer(reward_funcs=...)``. It imports nothing, so neither side's packages leak into the other.

TRL's signature: ``fn(prompts, completions, **columns) -> list[float]``, where a chat prompt's completion is
``[{"role": "assistant", "content": text}]`` and ``answer`` is a column of the dataset
(examples/trl_chat/data.jsonl: "5+2=" -> "7").
"""


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def reward(prompts, completions, answer, **kwargs):
    """1.0 for a reply that is exactly the answer; otherwise half the share of its characters that are digits.

    The second term is dense, so that a policy with random weights (the bench's default geometries) has a
    gradient to follow from the first step: an exact-match reward alone is 0 for every sample of such a
    policy, GRPO's group advantages are then all 0, and the reward curves say nothing. It does not reward
    length, so the completions (and the time a step takes) keep their shape as the policy learns.
    """
    out = []
    for completion, target in zip(completions, answer):
        text = _text(completion).strip()
        digits = sum(ch.isdigit() for ch in text)
        out.append(1.0 if text == target else 0.5 * digits / max(len(text), 1))
    return out
