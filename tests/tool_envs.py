"""OpenEnv environments for the environment-hosting tests (tests/test_environments.py): tools
that answer, sleep, raise, hang, or end their worker process."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State

TABLE = {"apple": "17", "pear": "4"}


class ToolsEnv(MCPEnvironment):
    """A lookup table and tools that misbehave on purpose; the reward is 1 for the row's key's
    value as the final answer."""

    def __init__(self, prefix: str = "") -> None:
        server = FastMCP("tools")

        @server.tool()
        def lookup(key: str) -> str:
            """The value stored under a key."""
            return prefix + TABLE.get(key, "no such key")

        @server.tool()
        def slow(seconds: float) -> str:
            """Wait, then answer."""
            time.sleep(seconds)
            return f"waited {seconds}"

        @server.tool()
        def boom() -> str:
            """Raise."""
            raise ValueError("boom went the tool")

        @server.tool()
        def die() -> str:
            """End the process at once."""
            os._exit(3)

        @server.tool()
        def segv() -> str:
            """Read address 0."""
            return str(ctypes.string_at(0))

        @server.tool()
        def pid() -> str:
            """The id of the process answering."""
            return str(os.getpid())

        super().__init__(server)
        self._state = State()
        self.key = ""
        self.steps = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, row: Any = None,
              **kwargs: Any) -> Observation:  # fmt: skip
        self._state = State(episode_id=episode_id)
        self.key = (row or {}).get("key", "apple")
        return Observation(done=False, reward=None, metadata={"messages": []})

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None)

    @property
    def state(self) -> State:
        return self._state

    def score(self, answer: str) -> float:
        return 1.0 if answer.strip() == TABLE.get(self.key) else 0.0


class RewardOnStep(MCPEnvironment):
    """No score(): the episode's reward is the last observation's; every call ends it."""

    def __init__(self) -> None:
        server = FastMCP("steps")

        @server.tool()
        def done(value: int) -> int:
            """Finish."""
            return value

        super().__init__(server)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
              ) -> Observation:  # fmt: skip
        return Observation(done=False, reward=None)

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = super().step(action, timeout_s=timeout_s, **kwargs)
        obs.done, obs.reward = True, 0.25
        return obs

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None)

    @property
    def state(self) -> State:
        return State()


class BadName(ToolsEnv):
    """A tool whose name no chat template takes."""

    def __init__(self) -> None:
        super().__init__()
        self.mcp_server.tool(name="has space")(lambda: "x")


class CannotBuild(ToolsEnv):
    def __init__(self) -> None:
        raise RuntimeError("no database here")


class NotAnEnvironment:
    pass
