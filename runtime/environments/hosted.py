"""What the two ways of hosting episodes share: the rollout's side of the protocol (api.py), the
episodes' time limits, the episodes lost, and the counters the metrics read.

A hosting (workers.py: worker processes; local.py: this process) supplies `_open`, `_call` and
`_close_episode`; each may raise `Lost(reason)` where the episode cannot go on (its worker died,
a call ran past its time). Lost episodes answer every later step with an error observation that
ends them and close with None (dropped), counted once.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from typing import Any

from runtime.environments.api import Opening, StepResult, ToolCall, zero_counters

_ENDED = {
    "timeout": "the episode ran past its time and ends here",
    "crashed": "the tool's worker stopped; the episode ends here",
}


class Lost(Exception):
    """The episode cannot go on: `reason` is "timeout" or "crashed"; `text` what the model sees."""

    def __init__(self, reason: str, text: str = "") -> None:
        super().__init__(text or _ENDED[reason])
        self.reason = reason
        self.text = text or _ENDED[reason]


class Hosted(ABC):
    """The Environments protocol over a hosting's `_open` / `_call` / `_close_episode`."""

    def __init__(self, call_timeout_s: float, episode_timeout_s: float) -> None:
        self.call_timeout_s = call_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self._deadlines: dict[str, float] = {}
        self._lost: dict[str, str] = {}
        self._ids = itertools.count()
        self._counts = zero_counters()

    # -- what a hosting supplies -------------------------------------------------------------

    @abstractmethod
    async def _open(self, episode: str, row: dict[str, Any], seed: int, timeout: float) -> dict:
        """Supplied by each hosting (workers.py, local.py)."""

    @abstractmethod
    async def _call(self, episode: str, name: str, arguments: Any, timeout: float) -> dict:
        """Supplied by each hosting (workers.py, local.py)."""

    @abstractmethod
    async def _close_episode(self, episode: str, answer: str, timeout: float) -> float:
        """Supplied by each hosting (workers.py, local.py)."""

    def _forget(self, episode: str) -> None:  # noqa: B027 (a hosting may hold nothing)
        """Free what the hosting holds for an episode that was dropped."""

    # -- the protocol --------------------------------------------------------------------------

    def _remaining(self, episode: str) -> float:
        return self._deadlines.get(episode, 0.0) - time.monotonic()

    def _drop(self, episode: str, reason: str) -> None:
        if episode in self._deadlines and episode not in self._lost:
            self._lost[episode] = reason
            self._counts["episodes_dropped"] += 1
            self._forget(episode)

    async def open(self, row: dict[str, Any], seed: int) -> Opening:
        episode = f"ep{next(self._ids)}"
        self._deadlines[episode] = time.monotonic() + self.episode_timeout_s
        try:
            opened = await self._open(episode, row, seed, self._wait(episode))
        except Lost as e:
            # an episode that could not open is dropped: its steps end it, close gives None
            self._drop(episode, e.reason)
            return Opening(episode, [])
        return Opening(episode, opened["tools"], opened["messages"])

    def _wait(self, episode: str) -> float:
        return max(0.0, min(self.call_timeout_s, self._remaining(episode)))

    async def step(self, episode: str, call: ToolCall) -> StepResult:
        if episode not in self._deadlines:
            raise KeyError(f"no open episode {episode!r}")
        self._counts["tool_calls"] += 1
        if episode not in self._lost and self._remaining(episode) <= 0:
            self._drop(episode, "timeout")
        if episode in self._lost:
            self._counts["tool_errors"] += 1
            reason = self._lost[episode]
            return StepResult(_ENDED[reason], done=True, error=reason)
        try:
            out = await self._call(episode, call.name, call.arguments, self._wait(episode))
        except Lost as e:
            self._counts["tool_errors"] += 1
            self._drop(episode, e.reason)
            return StepResult(e.text, done=True, error=e.reason)
        seconds = out.get("seconds", 0.0)
        self._counts["tool_s"] += seconds
        if out.get("error"):
            self._counts["tool_errors"] += 1
        return StepResult(
            out["text"],
            reward=out.get("reward"),
            done=bool(out.get("done")),
            error=out.get("error"),
            seconds=seconds,
        )

    async def close(self, episode: str, answer: str) -> float | None:
        if episode not in self._deadlines:
            raise KeyError(f"no open episode {episode!r}")
        try:
            if episode not in self._lost and self._remaining(episode) <= 0:
                self._drop(episode, "timeout")
            if episode in self._lost:
                return None
            try:
                return await self._close_episode(episode, answer, self._wait(episode))
            except Lost as e:
                self._drop(episode, e.reason)
                return None
        finally:
            self._deadlines.pop(episode, None)
            self._lost.pop(episode, None)

    def counters(self) -> dict[str, float]:
        return dict(self._counts)

    @property
    def open_episodes(self) -> int:
        return len(self._deadlines)
