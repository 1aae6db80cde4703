"""What a multi-turn rollout asks of the environments of its episodes, and what it gets back.

The rollout side (runtime/episodes) speaks only this; the hosting side (worker processes running
OpenEnv environments, runtime/environments) implements it. An episode is opened from a prompt row,
stepped once per tool call the model makes, and closed with the model's last answer, which gives
the episode's reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# Why a step did not give a tool's result; the text of such a step tells the model what went wrong.
ERRORS = ("malformed", "unknown_tool", "raised", "timeout", "crashed")
# The running totals `Environments.counters()` gives.
COUNTERS = ("tool_calls", "tool_errors", "tool_s", "episodes_dropped", "workers_lost")


def zero_counters() -> dict[str, float]:
    """Every counter of COUNTERS at 0."""
    return dict.fromkeys(COUNTERS, 0.0)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, parsed from its turn."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Opening:
    """An opened episode: its id, the tools it offers (JSON Schema, in the OpenAI function
    format the chat templates take) and the chat messages it starts with (may be empty: the
    prompt row then holds them)."""

    episode: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """What one tool call gave: the tool message's text the model sees next, this turn's reward
    where the environment gives one, whether the episode is over, `error` (one of ERRORS)
    where the call failed (a failed call is an observation, never an exception), and the
    seconds the tool ran where it is hosted (without the way there and back)."""

    text: str
    reward: float | None = None
    done: bool = False
    error: str | None = None
    seconds: float = 0.0


class Environments(Protocol):
    """The environments of a run's episodes, however they are hosted."""

    async def open(self, row: dict[str, Any], seed: int) -> Opening: ...

    async def step(self, episode: str, call: ToolCall) -> StepResult: ...

    async def close(self, episode: str, answer: str) -> float | None:
        """The episode's reward for its final answer; None when the episode was lost (its worker
        crashed, it ran past its time): the rollout drops it and counts it."""
        ...

    def counters(self) -> dict[str, float]:
        """Running totals for the metrics: tool_calls, tool_errors, tool_s, episodes_dropped,
        workers_lost."""
        ...
