"""Environments run in this process: an `Environments` (runtime/environments/api.py) over
environment classes in OpenEnv's shape (reset / step, observations with reward and done).

For environments whose steps take no time (tiny-tools) and tests of the episode loop: a step
runs on the event loop, so a slow tool would stall every episode. Real tools run in worker
processes (runtime/environments) behind the same interface. An exception in a tool becomes an
error observation.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from runtime.environments.api import Opening, StepResult, ToolCall, zero_counters


class LocalEnvironments:
    """One environment object per open episode, made by `factory`.

    `reset(row, seed)` resets an environment for a prompt row and returns its first
    observation (with `messages` and `tools`); `call_action(call)` and `answer_action(text)`
    turn a tool call and the final answer into the environment's actions. The reward of
    `close` is the answer step's."""

    def __init__(
        self,
        factory: Callable[[], Any],
        reset: Callable[[Any, dict[str, Any], int], Any],
        call_action: Callable[[ToolCall], Any],
        answer_action: Callable[[str], Any],
    ) -> None:
        self.factory = factory
        self._reset = reset
        self.call_action = call_action
        self.answer_action = answer_action
        self._open: dict[str, Any] = {}
        self._ids = itertools.count()
        self.totals = zero_counters()

    async def open(self, row: dict[str, Any], seed: int) -> Opening:
        env = self.factory()
        obs = self._reset(env, row, seed)
        episode = f"local-{next(self._ids)}"
        self._open[episode] = env
        return Opening(episode, list(obs.tools), list(obs.messages))

    async def step(self, episode: str, call: ToolCall) -> StepResult:
        env = self._open[episode]
        start = time.perf_counter()
        self.totals["tool_calls"] += 1
        try:
            obs = env.step(self.call_action(call))
        except Exception as e:  # noqa: BLE001 - a tool that raises is an observation
            self.totals["tool_errors"] += 1
            return StepResult(f"error: {type(e).__name__}: {e}", error="raised")
        finally:
            self.totals["tool_s"] += time.perf_counter() - start
        if obs.error is not None:
            self.totals["tool_errors"] += 1
        return StepResult(obs.text, obs.reward, obs.done, obs.error)

    async def close(self, episode: str, answer: str) -> float | None:
        env = self._open.pop(episode)
        try:
            obs = env.step(self.answer_action(answer))
        except Exception:  # noqa: BLE001 - an answer that cannot be scored loses the episode
            self.totals["episodes_dropped"] += 1
            return None
        return float(obs.reward or 0.0)

    def counters(self) -> dict[str, float]:
        return dict(self.totals)


def tiny_tools_environments() -> LocalEnvironments:
    """The tiny-tools task's environments, in-process."""
    from runtime.tasks.tiny_tools import LookupAction, LookupEnvironment

    return LocalEnvironments(
        LookupEnvironment,
        lambda env, row, seed: env.reset(seed=seed, key=row.get("question")),
        lambda call: LookupAction(tool=call.name, arguments=dict(call.arguments)),
        lambda text: LookupAction(answer=text),
    )
