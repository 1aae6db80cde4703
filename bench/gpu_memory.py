"""GPU memory in use, as nvidia-smi reports it (every process, allocators' caches included),
sampled in the background while a benchmark runs, its peaks kept by phase."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any


class GpuSampler:
    """The largest memory.used (GB) of every GPU, by phase, sampled with nvidia-smi."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s = every_s
        self.phase = "idle"
        self.peaks: dict[str, dict[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used(self) -> dict[int, float]:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = (line.split(",") for line in out.strip().splitlines())
        return {int(i): float(mib) * 2**20 / 1e9 for i, mib in rows}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                now = self.used()
            except (OSError, subprocess.CalledProcessError, ValueError):
                time.sleep(self.every_s)
                continue
            peaks = self.peaks.setdefault(self.phase, {})
            for gpu, gb in now.items():
                peaks[gpu] = max(peaks.get(gpu, 0.0), round(gb, 2))
            time.sleep(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def trainer_peaks(records: list[dict[str, Any]]) -> dict[str, float]:
    """The largest of each trainer memory figure (`memory/*`, rank 0's allocator by phase) over
    a run's metric records."""
    out: dict[str, float] = {}
    for row in records:
        for k, v in row.items():
            if k.startswith("memory/"):
                out[k] = max(out.get(k, 0.0), v)
    return out


def plan_gb_per_gpu(plan: Any) -> dict[str, float]:
    """The plan's estimate per GPU: its services' GB/GPU added up where they share one."""
    per_gpu: dict[int, float] = {}
    for placement in plan.placements:
        for gpu in placement.gpus:
            per_gpu[gpu] = per_gpu.get(gpu, 0.0) + plan.memory.get(placement.service, 0.0)
    return {str(g): round(v, 1) for g, v in sorted(per_gpu.items())}
