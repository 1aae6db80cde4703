"""The tiny-tools environment, in OpenEnv's Environment shape: `reset` opens an episode and
returns its first observation (the chat messages and the tools), `step` takes one action (a
tool call, or the final answer) and returns the next observation, with its reward and whether
the episode is over. Plain methods and dataclasses, no OpenEnv import."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KEYS = "abcdefghij"

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The secret digit stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "one letter, a to j"}},
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
    """One episode at a time: a table of secret digits and the key the prompt asks for."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}
        self.key = ""
        self.lookups = 0

    def reset(self, seed: int | None = None, key: str | None = None) -> LookupObservation:
        rng = random.Random(seed)
        self.table = {k: str(rng.randrange(10)) for k in KEYS}
        self.key = key if key in self.table else rng.choice(KEYS)
        self.lookups = 0
        return LookupObservation(
            messages=[{"role": "user", "content": self.key}], tools=[LOOKUP_TOOL]
        )

    def step(self, action: LookupAction) -> LookupObservation:
        if action.tool is None:
            right = action.answer.strip() == self.table[self.key]
            return LookupObservation(reward=1.0 if right else 0.0, done=True)
        if action.tool != "lookup":
            return LookupObservation(f"error: no tool {action.tool!r}", error="unknown_tool")
        key = action.arguments.get("key")
        if key not in self.table:
            return LookupObservation(f"error: no key {key!r}", error="raised")
        self.lookups += 1
        return LookupObservation(self.table[key])
