"""Services placed on the same GPU take turns on it.

Two processes that launch kernels on one GPU at once do not add up: the GPU time-slices between
their contexts. On an H200 (qwen3-1.7b, 128 completions of 512 tokens) a generate call took
2.3 s and a train step 2.2 s on GPUs of their own, and 5.0 s and 4.8 s side by side on one GPU:
more than the two in turn. So when the plan puts several services on one GPU (a one-GPU smoke
run, a folded bench plan), the controller runs their GPU calls one at a time: a generate call,
a reference scoring, a train step and its publish, a weight load. Services on GPUs of their own
never wait.

Units: ``generator<replica>``, ``reference``, ``trainer``. Units whose GPUs overlap on a node
(directly or through a third unit) share one lock; a unit that shares with nobody has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

from recipes.planner import GPU_SERVICES, shared_groups, unit_name

__all__ = ["GPU_SERVICES", "GpuTurns", "shared_groups", "unit_name"]


class GpuTurns:
    """One lock per group of units sharing GPUs, and what the turns cost: ``waited_s`` (seconds
    calls waited for their GPU) and ``turns`` (calls per unit kind), reset by :meth:`take_stats`.
    """

    def __init__(self, placements: Iterable[Any]) -> None:
        self.groups = shared_groups(placements)
        self._locks: dict[str, asyncio.Lock] = {}
        for group in self.groups:
            lock = asyncio.Lock()
            for unit in group:
                self._locks[unit] = lock
        self.waited_s = 0.0
        self.turns: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self.groups)

    def describe(self) -> str:
        return "; ".join(" + ".join(sorted(g)) for g in self.groups)

    @contextlib.asynccontextmanager
    async def turn(self, unit: str) -> AsyncIterator[None]:
        """Hold `unit`'s GPU(s) for the block (at once when it shares them with nobody)."""
        lock = self._locks.get(unit)
        if lock is None:
            yield
            return
        start = time.perf_counter()
        async with lock:
            self.waited_s += time.perf_counter() - start
            self.turns[unit.rstrip("0123456789")] += 1
            yield

    def take_stats(self) -> dict[str, float]:
        """Metrics since the last call (nothing when no GPU is shared)."""
        if not self.groups:
            return {}
        stats: dict[str, float] = {"gpu/turn_wait_s": self.waited_s}
        stats.update({f"gpu/turns_{kind}": float(n) for kind, n in sorted(self.turns.items())})
        self.waited_s = 0.0
        self.turns.clear()
        return stats
