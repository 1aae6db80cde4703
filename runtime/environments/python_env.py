"""`builtin:python`: an OpenEnv environment with one MCP tool, `python`, that runs the model's
code in the sandbox (sandbox.py) and returns what it printed. The episode's reward is the GSM8K
check of the final answer against the row's gold answer (runtime/tasks/rewards.py `math`).
"""

from __future__ import annotations

from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State

from runtime.environments.sandbox import Limits, check, run_python


class PythonEnvironment(MCPEnvironment):
    """Math word problems with a Python interpreter as the tool."""

    def __init__(self, limits: dict[str, Any] | None = None) -> None:
        self.limits = Limits(**(limits or {}))
        # refuses to start (one line) where the isolation asked for cannot be had
        self.isolation = check(self.limits)
        server = FastMCP("python")
        run = self._run

        @server.tool()
        def python(code: str) -> str:
            """Run a Python program and return what it prints (stdout and stderr). Print the
            values you need; nothing else is returned. No network; files only in the current
            folder."""
            return run(code)

        super().__init__(server)
        self._state = State(step_count=0)
        self.gold = ""

    def _run(self, code: str) -> str:
        outcome = run_python(code, self.limits)
        self._state.step_count += 1
        note = {
            "cpu": f"\n[stopped: more than {self.limits.cpu_seconds:g} CPU seconds]",
            "wall": f"\n[stopped: more than {self.limits.wall_seconds:g} seconds]",
            "memory": f"\n[stopped: more than {self.limits.memory_mb} MB of memory]",
        }.get(outcome.stopped or "", "")
        return (outcome.output or "(no output)") + note

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        row: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.gold = str((row or {}).get("answer", ""))
        return Observation(done=False, reward=None)

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(
            done=False,
            reward=None,
            metadata={"error": f"only tool calls are taken, got {type(action).__name__}"},
        )

    @property
    def state(self) -> State:
        return self._state

    def score(self, answer: str) -> float:
        """1.0 where the final answer's number is the gold one (GSM8K's check), else 0.0."""
        from runtime.tasks.rewards import math_reward

        return math_reward("", answer, self.gold)
