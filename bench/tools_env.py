"""The tool-use throughput bench's environment (bench/gpu_tools.py): one tool that takes a fixed
time and a synthetic reward, for runs of random weights that cannot solve anything.

`wait()` sleeps `tool_s` seconds (default 0.1: the issue's 100 ms tool) and answers `done`: the
cost of a real tool (a sandboxed Python run, a search) without its variance. The episode's
reward is drawn from its seed and id, uniform in [0, 1): a group's episodes differ, so GRPO's
advantages are not 0 and every step trains, as `bench.rewards.distinct_share` does for the
single-turn bench (a random policy's answer text says nothing worth scoring).

A recipe names it `env.name: bench.tools_env:WaitEnvironment` (the checkout's root on the
Python path), `env.args: {tool_s: 0.1}`.
"""

from __future__ import annotations

import random
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State


class WaitEnvironment(MCPEnvironment):
    """Every call of `wait` takes `tool_s` seconds; the reward is synthetic."""

    def __init__(self, tool_s: float = 0.1) -> None:
        if tool_s < 0:
            raise ValueError(f"tool_s must be 0 or more, got {tool_s}")
        server = FastMCP("wait")
        state = self

        @server.tool()
        def wait() -> str:
            """Wait a moment, then answer."""
            time.sleep(tool_s)
            state._state.step_count += 1
            return "done"

        super().__init__(server)
        self._state = State(step_count=0)
        self._draw = random.Random(0)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        row: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._draw = random.Random(f"{seed}/{episode_id}")
        return Observation(done=False, reward=None)

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "tool calls only"})

    @property
    def state(self) -> State:
        return self._state

    def score(self, answer: str) -> float:
        """Uniform in [0, 1), from the episode's seed and id."""
        return self._draw.random()
