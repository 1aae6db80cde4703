"""Peak GPU memory of a backend's phases (start-up, a training step, a publish, a checkpoint
write, an export), as the CUDA caching allocator saw them: what the memory plan
(recipes/memory.py) estimates, measured where the run really is. Nothing is recorded on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

GB = 1e9


class PeakMemory:
    """The largest allocated and reserved bytes of each phase on this process's GPU.

    `record("startup")` closes the phase that ran since the process began (or the last reset);
    `phase(name)` measures a block. `metrics()` gives every phase seen so far as
    `memory/<name>_gb` (allocated) and `memory/<name>_reserved_gb`, each the largest yet, and
    `memory/<name>_after_gb`, what stayed allocated when the phase last ended (growing from
    step to step: something is kept that should not be)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.on = self.device.type == "cuda" and torch.cuda.is_available()
        self.peaks: dict[str, tuple[float, float]] = {}
        self.after: dict[str, float] = {}

    def record(self, name: str) -> None:
        if not self.on:
            return
        # the device named: a call may run on a thread whose current device is another one
        allocated = torch.cuda.max_memory_allocated(self.device) / GB
        reserved = torch.cuda.max_memory_reserved(self.device) / GB
        old = self.peaks.get(name, (0.0, 0.0))
        self.peaks[name] = (max(old[0], allocated), max(old[1], reserved))
        self.after[name] = torch.cuda.memory_allocated(self.device) / GB

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.record(name)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, (allocated, reserved) in self.peaks.items():
            out[f"memory/{name}_gb"] = round(allocated, 3)
            out[f"memory/{name}_reserved_gb"] = round(reserved, 3)
            out[f"memory/{name}_after_gb"] = round(self.after[name], 3)
        return out


class StepEvents:
    """What can make one step much slower than the others without showing in its own figures,
    counted during the step: `compile/graphs`, the graphs torch.compile made (a shape or a guard
    it had not seen: seconds to minutes each once the first steps are past), and on a GPU
    `memory/alloc_retries`, the CUDA allocator's retries (a cudaMalloc that failed until the
    allocator freed its cache and tried again: the GPU's memory is nearly full).

    `before = events.read()` ahead of a step, `events.since(before)` after it, and
    `events.recompiled()` for why a graph was compiled again during it: the guards that failed
    (torch.compile keeps them), one line each, e.g. `forward (torchtitan/models/qwen3/model.py:54):
    2 <= x.size()[0]` (a batch of one row, where the graphs were made for more)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._failures: dict[Any, int] = {}

    def read(self) -> dict[str, int]:
        from torch._dynamo.utils import counters, guard_failures

        self._failures = {code: len(reasons) for code, reasons in guard_failures.items()}
        out = {"compile/graphs": int(counters["stats"]["unique_graphs"])}
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            out["memory/alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        return out

    def since(self, before: dict[str, int]) -> dict[str, float]:
        now = self.read()
        return {k: float(now[k] - before.get(k, 0)) for k in now}

    def recompiled(self, most: int = 3) -> list[str]:
        """The guard failures since the last `read()`, at most `most` distinct ones: the code
        compiled again (name, file:line) and the first guard that failed, without the
        framework's advice that follows it."""
        from torch._dynamo.utils import guard_failures

        lines: list[str] = []
        for code, reasons in list(guard_failures.items()):
            for reason in reasons[self._failures.get(code, 0) :]:
                guard = str(reason).strip().splitlines()[0] if str(reason).strip() else "?"
                guard = guard.split("  # ", 1)[0].strip()
                if guard[:1].isdigit() and ": " in guard:  # "0/0: " names the cache entry
                    guard = guard.split(": ", 1)[1]
                name = getattr(code, "co_name", str(code))
                where = _module_path(getattr(code, "co_filename", "?"))
                line = f"{name} ({where}:{getattr(code, 'co_firstlineno', '?')}): {guard}"
                if line not in lines:
                    lines.append(line)
        return lines[:most]


def _module_path(filename: str) -> str:
    """`filename` as its import path would name it (`torchtitan/models/qwen3/model.py`,
    `runtime/backends/blocks.py`): relative to the nearest entry of sys.path."""
    import sys

    path = Path(filename)
    found = [
        path.relative_to(root).as_posix()
        for root in {Path(e).resolve() for e in sys.path if e}
        if path.is_relative_to(root)
    ]
    return min(found, key=len) if found else "/".join(path.parts[-3:])
