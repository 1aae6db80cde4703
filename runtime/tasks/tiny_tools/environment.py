"""The tiny-tools environment, in OpenEnv's Environment shape: `reset` opens an episode and
returns its first observation (the chat messages and the tools), `step` takes one action (a
tool call, or the final answer) and returns the next observation, with its reward and whether
the episode is over. Plain methods and dataclasses, no OpenEnv import."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from runtime.tasks.tiny_tools.tokenization import KEYS

# The reward of an answer: LOOKUP_CREDIT where the episode looked the prompt's key up first, the
# rest by prefix credit (the share of the digit matched before the first wrong character, over
# the longer of the two): 1.0 only for the right digit after the right lookup. An episode that
# never answers (calls until its turns run out) scores 0.
LOOKUP_CREDIT = 0.2

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The secret digit stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "one letter, a to c"}},
            "required": ["key"],
        },
    },
}


@dataclass
class LookupAction:
    """A tool call (`tool` and its `arguments`) or, with `tool` None, the final `answer`."""

    tool: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    answer: str = ""


@dataclass
class LookupObservation:
    """What the model sees next (`text`; on reset the chat `messages` and the `tools`), the
    step's `reward`, `done`, and `error` when a call could not be served."""

    text: str = ""
    reward: float | None = None
    done: bool = False
    error: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)


class LookupEnvironment:
    """One episode at a time: a table of secret digits and the key the prompt asks for. One
    lookup an episode: a second call gets an error (the digit to copy is then the only one the
    episode shows)."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}
        self.key = ""
        self.looked_up: set[str] = set()

    def reset(self, seed: int | None = None, key: str | None = None) -> LookupObservation:
        rng = random.Random(seed)
        self.table = {k: str(rng.randrange(10)) for k in KEYS}
        self.key = key if key in self.table else rng.choice(KEYS)
        self.looked_up: set[str] = set()
        return LookupObservation(
            messages=[{"role": "user", "content": self.key}], tools=[LOOKUP_TOOL]
        )

    def step(self, action: LookupAction) -> LookupObservation:
        if action.tool is None:
            return LookupObservation(reward=self.reward(action.answer), done=True)
        if action.tool != "lookup":
            return LookupObservation(f"error: no tool {action.tool!r}", error="unknown_tool")
        key = action.arguments.get("key")
        if self.looked_up:
            return LookupObservation("error: one lookup an episode", error="raised")
        if key not in self.table:
            return LookupObservation(f"error: no key {key!r}", error="raised")
        self.looked_up.add(key)
        return LookupObservation(self.table[key])

    def reward(self, answer: str) -> float:
        want, got = self.table[self.key], answer.strip()
        matched = 0
        for a, b in zip(want, got, strict=False):
            if a != b:
                break
            matched += 1
        credit = matched / max(len(want), len(got), 1)
        looked = LOOKUP_CREDIT if got and self.key in self.looked_up else 0.0
        return looked + (1.0 - LOOKUP_CREDIT) * credit
