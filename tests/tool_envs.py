"""OpenEnv environments for the environment-hosting tests (tests/test_environments.py,
tests/test_episode_runs.py): tools that answer, sleep, raise, hang, or end their worker
process."""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

from runtime.tasks.tiny_tools.environment import LookupEnvironment

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


class CountedSessions(ToolsEnv):
    """ToolsEnv that counts its MCP sessions' outermost entries (a client connecting) and those
    open now, over the process."""

    connects = 0
    open_now = 0

    @asynccontextmanager
    async def mcp_session(self):
        cls = type(self)
        cls.connects += cls.open_now == 0
        cls.open_now += 1
        try:
            async with super().mcp_session() as client:
                yield client
        finally:
            cls.open_now -= 1


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


class TinyToolsPid(LookupEnvironment):
    """tiny-tools whose lookup answers with the id of the process serving it."""

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = super().step(action, timeout_s, **kwargs)
        if isinstance(obs, CallToolObservation) and obs.error is None:
            obs.result = str(os.getpid())
        return obs


class SlowTinyTools(LookupEnvironment):
    """tiny-tools whose lookup takes `seconds` (a tool the generator would idle through)."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds
        super().__init__()

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if isinstance(action, CallToolAction):
            time.sleep(self.seconds)
        return super().step(action, timeout_s, **kwargs)


class FragileTinyTools(LookupEnvironment):
    """tiny-tools whose lookup ends its worker while the file `crash` is in `flags`: `once`, it
    removes the file first (the worker comes back, the run goes on); else it leaves `broken`
    there, and while that file is there the environment cannot be built (no worker comes back)."""

    def __init__(self, flags: str, once: bool = True) -> None:
        self.flags, self.once = Path(flags), once
        if (self.flags / "broken").exists():
            raise RuntimeError("the lookup table is gone")
        super().__init__()

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        crash = self.flags / "crash"
        if isinstance(action, CallToolAction) and crash.exists():
            if self.once:
                crash.unlink(missing_ok=True)
            else:
                (self.flags / "broken").touch()
            os._exit(3)
        return super().step(action, timeout_s, **kwargs)


class SlowToBuild(ToolsEnv):
    """An environment whose construction takes `seconds`: its workers start that slowly."""

    def __init__(self, seconds: float = 120.0) -> None:
        time.sleep(seconds)
        super().__init__()
