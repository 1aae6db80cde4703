"""The moving parts the rollout loops wait on: the trainer's policy version (and whether it is
mid-step) and the version each generator has loaded, under one condition that every change
notifies; and the per-step timings the services report between two metric records."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Progress:
    """`version`: optimizer steps the trainer has done (the policy it holds); `training`: a
    step's groups have left the buffer and its update is not in yet; `loaded[r]`: the version
    generator replica r samples with."""

    def __init__(self, generators: int) -> None:
        self.version = 0
        self.training = False
        self.loaded = [0] * generators
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, ready: Callable[[], bool], then: Callable[[], None]) -> None:
        """Wait until `ready()`, then run `then()` before anyone else sees the state."""
        async with self._changed:
            await self._changed.wait_for(ready)
            then()


class Notes:
    """Timings noted between two step records (several generate calls may end in one step);
    `take()` gives their means and starts over."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self._values.setdefault(key, []).append(value)

    def take(self) -> dict[str, float]:
        means = {k: sum(v) / len(v) for k, v in self._values.items() if v}
        self._values.clear()
        return means
