"""The tiny-tools environment, an OpenEnv `Environment`: `reset` opens an episode (its chat
messages in the observation's metadata), `ListToolsAction` lists its one tool, `lookup`,
`CallToolAction` calls it, and `score(answer)` is the episode's reward. It answers OpenEnv's MCP
actions itself, without an MCP server: an episode costs the worker hosting it
(runtime/environments) microseconds, not an MCP round trip."""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
    ToolError,
    ToolErrorType,
)
from openenv.core.env_server.types import Observation, State

from runtime.tasks.tiny_tools.tokenization import KEYS

# The reward of an answer: LOOKUP_CREDIT where the episode looked the prompt's key up first, the
# rest by prefix credit (the share of the digit matched before the first wrong character, over
# the longer of the two): 1.0 only for the right digit after the right lookup. An episode that
# never answers (calls until its turns run out) scores 0.
LOOKUP_CREDIT = 0.2

# The tool in the OpenAI function format the chat templates take (what the hosting makes of
# the environment's `Tool`, runtime/environments/host.py function_schema).
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
_TOOL = Tool(
    name="lookup",
    description=LOOKUP_TOOL["function"]["description"],
    input_schema=LOOKUP_TOOL["function"]["parameters"],
)


class LookupEnvironment(Environment):
    """One episode at a time: a table of secret digits and the key the prompt (the row's
    `question`) asks for. One lookup an episode: a second call gets an error (the digit to copy
    is then the only one the episode shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: dict[str, str] = {}
        self.key = ""
        self.looked_up: set[str] = set()
        self._state = State()

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        row: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Observation:
        rng = random.Random(seed)
        self.table = {k: str(rng.randrange(10)) for k in KEYS}
        key = (row or {}).get("question")
        self.key = key if key in self.table else rng.choice(KEYS)
        self.looked_up = set()
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(metadata={"messages": [{"role": "user", "content": self.key}]})

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=[_TOOL])
        if not isinstance(action, CallToolAction):
            return Observation(metadata={"error": f"tool calls only, got {type(action).__name__}"})
        if action.tool_name != "lookup":
            return _failed(action.tool_name, ToolErrorType.TOOL_NOT_FOUND, "no such tool")
        key = action.arguments.get("key")
        if self.looked_up:
            return _failed("lookup", ToolErrorType.EXECUTION_ERROR, "one lookup an episode")
        if key not in self.table:
            return _failed("lookup", ToolErrorType.EXECUTION_ERROR, f"no key {key!r}")
        self.looked_up.add(key)
        return CallToolObservation(tool_name="lookup", result=self.table[key])

    @property
    def state(self) -> State:
        return self._state

    def score(self, answer: str) -> float:
        """The episode's reward for the model's final answer."""
        want, got = self.table[self.key], answer.strip()
        matched = 0
        for a, b in zip(want, got, strict=False):
            if a != b:
                break
            matched += 1
        credit = matched / max(len(want), len(got), 1)
        looked = LOOKUP_CREDIT if got and self.key in self.looked_up else 0.0
        return looked + (1.0 - LOOKUP_CREDIT) * credit


def _failed(tool: str, kind: ToolErrorType, message: str) -> CallToolObservation:
    return CallToolObservation(tool_name=tool, error=ToolError(error_type=kind, message=message))
