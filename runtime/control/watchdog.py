"""A bound on every service call: a service that stops answering without dying ends the run.

A dead proc or a raised exception reaches the controller at once (runtime/procs/lifecycle.py);
a wedged collective or a hung kernel does not: the call just never returns. So each supervised
call gets a deadline from the recipe's `watchdog` section and what calls of its kind took so
far: the first call of a kind `first_call_s` (start-up, compiling, a first checkpoint or
export), later ones `factor` times the slowest answer of that kind, never less than `min_s`.
A call past its deadline ends the run with one line naming the service, the call, the bound
and when each service last answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Watchdog:
    """Deadlines for service calls, from the recipe's settings and the calls' history."""

    def __init__(
        self,
        settings: Any,
        places: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings  # recipes.service_sections.WatchdogSettings
        self.places = places or {}  # service -> where it runs ("node 0 GPU 1"), for the message
        self._clock = clock
        self._slowest: dict[str, float] = {}  # kind -> the slowest answer so far, seconds
        self._answers: dict[str, int] = {}  # kind -> answers so far
        self._last: dict[str, tuple[float, str]] = {}  # service -> (when, kind) of its last answer

    def bound(self, kind: str) -> float:
        """Seconds a call of `kind` may take before its service counts as stuck."""
        s = self.settings
        if kind not in self._slowest:
            return s.first_call_s
        return max(s.min_s, s.factor * self._slowest[kind])

    def answered(self, service: str, kind: str, seconds: float) -> None:
        """A call of `kind` to `service` answered after `seconds`."""
        self._slowest[kind] = max(self._slowest.get(kind, 0.0), seconds)
        self._answers[kind] = self._answers.get(kind, 0) + 1
        self._last[service] = (self._clock(), kind)

    def silence(self, service: str, kind: str, bound: float) -> str:
        """The cause a run ends with when a call of `kind` to `service` outlived `bound`."""
        s = self.settings
        if kind in self._slowest:
            n = self._answers[kind]
            why = (
                f"{s.factor:g} x the slowest of {n} earlier {kind} call{'s' if n > 1 else ''}, "
                f"{self._slowest[kind]:.3g} s, at least watchdog.min_s {s.min_s:g} s"
            )
        else:
            why = f"watchdog.first_call_s for a first {kind} call"
        now = self._clock()
        last = ", ".join(
            f"{name} {what} {now - when:.1f} s ago"
            for name, (when, what) in sorted(self._last.items(), key=lambda item: -item[1][0])
        )
        place = self.places.get(service)
        return (
            f"stopped answering{f' ({place})' if place else ''}: {kind} gave no answer within "
            f"{bound:.3g} s ({why}); last answers: {last or 'none yet'}"
        )

    async def call(self, life: Any, service: str, kind: str, awaitable: Any) -> Any:
        """`life.call(service, awaitable)` under this call's deadline."""
        bound = self.bound(kind)
        start = self._clock()
        result = await life.call(
            service, awaitable, timeout=bound, silence=lambda: self.silence(service, kind, bound)
        )
        self.answered(service, kind, self._clock() - start)
        return result
