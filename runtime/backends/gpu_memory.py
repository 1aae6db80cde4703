"""Peak GPU memory of a backend's phases (start-up, a training step, a publish, a checkpoint
write, an export), as the CUDA caching allocator saw them: what the memory plan
(recipes/memory.py) estimates, measured where the run really is. Nothing is recorded on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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

    `before = events.read()` ahead of a step, `events.since(before)` after it."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def read(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        out = {"compile/graphs": int(counters["stats"]["unique_graphs"])}
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            out["memory/alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        return out

    def since(self, before: dict[str, int]) -> dict[str, float]:
        now = self.read()
        return {k: float(now[k] - before.get(k, 0)) for k in now}
