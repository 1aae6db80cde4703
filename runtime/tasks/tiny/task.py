"""The tiny task: continue a counting sequence of digits (mod 10), up or down.

A prompt shows `context` consecutive digits, e.g. "345" (counting up) or "543" (counting down);
the answer is the next `length` digits ("678", "210"). The policy has to read the prompt: the
last digit says where to continue from and, when both directions are in play, the last two say
which way. The reward is prefix credit: the share of answer digits the completion gets right
before its first mistake, so a completion only scores by following the rule from the start.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

DIGITS = "0123456789"


@dataclass(frozen=True)
class TinyTask:
    """Prompts and answers of the tiny task (the defaults are the `tiny` recipe's)."""

    context: int = 3
    length: int = 3
    directions: tuple[str, ...] = ("up",)

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt, answer) pair."""
        step = 1 if rng.choice(self.directions) == "up" else -1
        start = rng.randrange(10)
        seq = [DIGITS[(start + step * i) % 10] for i in range(self.context + self.length)]
        return "".join(seq[: self.context]), "".join(seq[self.context :])

    def all_prompts(self) -> list[tuple[str, str]]:
        """Every distinct (prompt, answer) pair, in a fixed order."""
        pairs = []
        for direction in self.directions:
            step = 1 if direction == "up" else -1
            for start in range(10):
                seq = [DIGITS[(start + step * i) % 10] for i in range(self.context + self.length)]
                pairs.append(("".join(seq[: self.context]), "".join(seq[self.context :])))
        return pairs

    def prompts(self, seed: int = 0) -> Iterator[tuple[str, str]]:
        """An endless, seeded stream of (prompt, answer) pairs."""
        rng = random.Random(seed)
        while True:
            yield self.sample(rng)


def tiny_reward(prompt: str, completion: str, answer: str) -> float:
    """Share of the answer matched before the first wrong character; extra characters count
    against (a completion longer than the answer is divided by its own length)."""
    completion = completion.strip()
    if not answer:
        return float(not completion)
    matched = 0
    for want, got in zip(answer, completion, strict=False):
        if want != got:
            break
        matched += 1
    return matched / max(len(answer), len(completion))
