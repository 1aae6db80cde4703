"""Services placed on the same GPU take turns on it.

Two processes that launch kernels on one GPU at once do not add up: the GPU time-slices between
their contexts. On an H200 (qwen3-1.7b, 128 completions of 512 tokens) a generate call took
2.3 s and a train step 2.2 s on GPUs of their own, and 5.0 s and 4.8 s side by side on one GPU:
more than the two in turn. So when the plan puts several services on one GPU (a one-GPU smoke
run, a folded bench plan), the controller runs their GPU calls one at a time: a generate call,
a reference scoring, a train step and its publish, a weight load. Services on GPUs of their own
never wait.

Units: ``generator<replica>``, ``reference``, ``trainer``. Each GPU that two or more units use
has a lock, and a unit's call holds the locks of every shared GPU it uses, taken in one global
order (node, GPU) so two units never wait on each other. Units that share no GPU run at once,
also where a third unit spans both of theirs: on two GPUs with every service on both, the two
generators (a GPU each) sample together and the trainer (FSDP over both) waits for both. A unit
that shares no GPU takes no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

from recipes.placements import GPU_SERVICES, shared_gpus, unit_name

__all__ = ["GPU_SERVICES", "GpuTurns", "shared_gpus", "unit_name"]


class GpuTurns:
    """A lock per shared GPU, and what the turns cost: ``waited_s`` (seconds calls waited for
    their GPUs) and ``turns`` (calls per unit kind), reset by :meth:`take_stats`."""

    def __init__(self, placements: Iterable[Any]) -> None:
        self.shared = shared_gpus(placements)
        locks = {gpu: asyncio.Lock() for gpu in self.shared}  # sorted by (node, GPU)
        self._locks: dict[str, list[asyncio.Lock]] = {}
        for gpu, lock in locks.items():
            for unit in self.shared[gpu]:
                self._locks.setdefault(unit, []).append(lock)
        self.waited_s = 0.0
        self.turns: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self.shared)

    def describe(self) -> str:
        return "; ".join(
            f"{' + '.join(sorted(units))} (node {node} GPU {gpu})"
            for (node, gpu), units in self.shared.items()
        )

    @contextlib.asynccontextmanager
    async def turn(self, unit: str) -> AsyncIterator[None]:
        """Hold the shared GPUs of `unit` for the block (at once when it shares none)."""
        locks = self._locks.get(unit)
        if not locks:
            yield
            return
        start = time.perf_counter()
        async with contextlib.AsyncExitStack() as held:
            for lock in locks:
                await held.enter_async_context(lock)
            self.waited_s += time.perf_counter() - start
            self.turns[unit.rstrip("0123456789")] += 1
            yield

    def take_stats(self) -> dict[str, float]:
        """Metrics since the last call (nothing when no GPU is shared)."""
        if not self.shared:
            return {}
        stats: dict[str, float] = {"gpu/turn_wait_s": self.waited_s}
        stats.update({f"gpu/turns_{kind}": float(n) for kind, n in sorted(self.turns.items())})
        self.waited_s = 0.0
        self.turns.clear()
        return stats
