"""Small verifiable tasks built locally: prompts, reference answers and exact-match rewards.

``addition``: prompt ``"a+b="``, answer ``str(a + b)`` followed by EOS. ``sort``: prompt
``"sort 3142 = "``, answer ``"1234"``. Rewards read the decoded response up to the first EOS.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def addition(n: int, max_operand: int = 30, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Example(f"{a}+{b}=", str(a + b)))
    return out


def sorting(n: int, max_digits: int = 5, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, max_digits)))
        out.append(Example(f"sort {d} = ", "".join(sorted(d))))
    return out


TASKS = {"addition": addition, "sort": sorting}


def answer_of(prompt: str) -> str:
    """The reference answer for a task prompt (parsed back, so rewards need no lookup table)."""
    if prompt.startswith("sort "):
        return "".join(sorted(prompt[5:].split("=")[0].strip()))
    lhs = prompt.rstrip("=").split("+")
    return str(sum(int(x) for x in lhs))


def exact_match_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response (stripped) equals the reference answer, else 0.0."""
    return [1.0 if r.strip() == answer_of(p) else 0.0 for p, r in zip(prompts, responses)]


def length_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Characters in the response / 32, at most 1: a dense toy reward for smoke runs.

    A random-weight model almost never gets ``exact_match_reward``'s 1.0, and an all-zero reward
    leaves the policy where it started; this one differs between any two samples whose tokens
    spell strings of different lengths, so a few PPO steps move the policy off the reference and
    the KL is exercised, not trivially 0.
    """
    return [min(len(r), 32) / 32 for r in responses]
