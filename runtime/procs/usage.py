"""What a thread spent besides wall time: its CPU seconds and how often it left the CPU, by
choice (waiting for a lock, the GIL, I/O: voluntary switches) or not (another thread or process
took the core: involuntary). Around a long call on one thread, these tell a call that waited on
something in its own process from one that was crowded off its core. A kernel that counts CPU
time by its tick (4 ms at 250 Hz) samples it: a call of a few milliseconds can read 0 or a tick
more than it lasted; a generate call of seconds reads true to a percent."""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadUsage:
    cpu_s: float
    voluntary_switches: int
    involuntary_switches: int

    def since(self, earlier: ThreadUsage) -> ThreadUsage:
        return ThreadUsage(
            self.cpu_s - earlier.cpu_s,
            self.voluntary_switches - earlier.voluntary_switches,
            self.involuntary_switches - earlier.involuntary_switches,
        )

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_cpu_s": self.cpu_s,
            f"{prefix}_voluntary_switches": float(self.voluntary_switches),
            f"{prefix}_involuntary_switches": float(self.involuntary_switches),
        }


def thread_usage() -> ThreadUsage | None:
    """The calling thread's usage so far (Linux's getrusage(RUSAGE_THREAD)); None where the
    platform keeps no per-thread usage."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    u = resource.getrusage(who)
    return ThreadUsage(u.ru_utime + u.ru_stime, u.ru_nvcsw, u.ru_nivcsw)
