"""GPU memory in use, as nvidia-smi reports it (every process, allocators' caches included),
sampled in the background while a benchmark runs, its peaks kept by phase; and, within a window
the bench names, each GPU's SM clock, power and utilization (a GPU held back by its clocks or
power cap is told from one whose work came slower).

Only the GPUs `CUDA_VISIBLE_DEVICES` gives the bench are sampled, numbered as the bench's own
processes number them (the plan's GPU 0 is the first listed): a run beside it on the host's
other GPUs is not in its figures."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

from runtime.procs.cpus import cpu_ticks

_MEMORY = "index,memory.used"
_WITH_CLOCKS = "index,memory.used,clocks.sm,power.draw,utilization.gpu"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def visible_gpus(env: str | None = None) -> dict[int, int] | None:
    """nvidia-smi's index -> the index a process started with `CUDA_VISIBLE_DEVICES` sees; None
    when every GPU is visible (unset, or not a list of indices: UUIDs are taken as all)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if text is None or not text.strip():
        return None
    fields = [f.strip() for f in text.split(",") if f.strip()]
    if not all(f.isdigit() for f in fields):
        return None
    return {int(f): i for i, f in enumerate(fields)}


def _memory_gb(rows: list[list[str]]) -> dict[int, float]:
    """Each GPU's memory.used (MiB in nvidia-smi's rows: index first, memory second) in GB."""
    return {int(r[0]): float(r[1]) * 2**20 / 1e9 for r in rows}


def cpu_times(stat: str) -> dict[str, tuple[int, int]]:
    """Each core's (busy, total) jiffies from /proc/stat's text (`cpuN` lines; idle and
    iowait are not busy)."""
    out: dict[str, tuple[int, int]] = {}
    for cpu, ticks in cpu_ticks(stat).items():
        total = sum(ticks.values())
        out[f"cpu{cpu}"] = (total - ticks["idle"] - ticks.get("iowait", 0), total)
    return out


def busy_cores(first: dict[str, tuple[int, int]], last: dict[str, tuple[int, int]]) -> float:
    """How many cores were busy on average between two `cpu_times` snapshots."""
    busy = 0.0
    for core, (b1, t1) in last.items():
        b0, t0 = first.get(core, (b1, t1))
        if t1 > t0:
            busy += (b1 - b0) / (t1 - t0)
    return busy


def cpu_mhz(cpuinfo: str) -> float | None:
    """The mean `cpu MHz` of /proc/cpuinfo's text (what the kernel last read of each core's
    clock; a VM may show a fixed figure)."""
    values = [
        float(line.split(":")[1]) for line in cpuinfo.splitlines() if line.startswith("cpu MHz")
    ]
    return round(sum(values) / len(values), 1) if values else None


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


class GpuSampler:
    """The largest memory.used (GB) of every GPU, by phase, sampled with nvidia-smi; while
    `clock_window` names a window, each GPU's SM clock (MHz), power (W) and utilization (%)
    too (`clocks()`: their means and the lowest clock, by window)."""

    def __init__(self, every_s: float = 0.2, clock_window: str | None = None) -> None:
        self.every_s = every_s
        self.phase = "idle"
        self.clock_window = clock_window
        self.peaks: dict[str, dict[int, float]] = {}
        self._samples: dict[str, dict[int, list[tuple[float | None, ...]]]] = {}
        self._query = _WITH_CLOCKS
        self._cpu: dict[str, dict[str, Any]] = {}
        self._visible = visible_gpus()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _smi(self, query: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [[f.strip() for f in line.split(",")] for line in out.strip().splitlines()]
        if self._visible is None:
            return rows
        return [[str(self._visible[int(r[0])]), *r[1:]] for r in rows if int(r[0]) in self._visible]

    def used(self) -> dict[int, float]:
        return _memory_gb(self._smi(_MEMORY))

    def _sample(self) -> list[list[str]]:
        try:
            return self._smi(self._query)
        except subprocess.CalledProcessError:
            if self._query == _MEMORY:
                raise
            self._query = _MEMORY  # a driver without one of the clock fields: memory alone
            return self._smi(self._query)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rows = self._sample()
                now = _memory_gb(rows)
            except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
                time.sleep(self.every_s)
                continue
            peaks = self.peaks.setdefault(self.phase, {})
            for gpu, gb in now.items():
                peaks[gpu] = max(peaks.get(gpu, 0.0), round(gb, 2))
            window = self.clock_window
            if window is not None:
                kept = self._samples.setdefault(window, {})
                for r in rows:
                    if len(r) == 5:
                        kept.setdefault(int(r[0]), []).append(tuple(_number(f) for f in r[2:]))
                self._host(window)
            time.sleep(self.every_s)

    def _host(self, window: str) -> None:
        """The host's CPU over `window`: the first and the latest per-core times, and the
        cores' clock each sample."""
        stat, info = _read("/proc/stat"), _read("/proc/cpuinfo")
        try:
            now = cpu_times(stat) if stat else None
            mhz = cpu_mhz(info) if info else None
        except (ValueError, IndexError):  # a kernel's format this does not read: go without
            return
        if not now:
            return
        seen = self._cpu.setdefault(window, {"first": now, "mhz": []})
        seen["last"] = now
        if mhz is not None:
            seen["mhz"].append(mhz)

    def host_cpu(self) -> dict[str, dict[str, float | int | None]]:
        """By window: the host's cores, how many were busy on average over it (every
        process's work, ours and the neighbours'), and the cores' mean clock (MHz)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for window, seen in self._cpu.items():
            last = seen.get("last", seen["first"])
            mhz = seen["mhz"]
            out[window] = {
                "cores": len(last),
                "busy_cores_mean": round(busy_cores(seen["first"], last), 2),
                "cpu_mhz_mean": round(sum(mhz) / len(mhz), 1) if mhz else None,
            }
        return out

    def clocks(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """By window, by GPU: mean and lowest SM clock (MHz), mean power (W) and utilization
        (%), over the samples taken in it."""

        def mean(values: list[float | None]) -> float | None:
            kept = [v for v in values if v is not None]
            return round(sum(kept) / len(kept), 1) if kept else None

        out: dict[str, dict[str, dict[str, float | int | None]]] = {}
        for window, gpus in self._samples.items():
            for gpu, samples in sorted(gpus.items()):
                sm = [s[0] for s in samples]
                lowest = [v for v in sm if v is not None]
                out.setdefault(window, {})[str(gpu)] = {
                    "samples": len(samples),
                    "sm_mhz_mean": mean(sm),
                    "sm_mhz_min": min(lowest) if lowest else None,
                    "power_w_mean": mean([s[1] for s in samples]),
                    "utilization_pct_mean": mean([s[2] for s in samples]),
                }
        return out

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
