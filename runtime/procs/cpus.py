"""Which CPUs a thread runs on, which it may run on, and the host's layout that tells them apart:
logical CPUs that share a physical core (SMT siblings) and NUMA nodes, the GPU's node among them.

A generate call of an engine that runs its steps on one thread is as fast as the core under that
thread; these read where the thread ran (the kernel's `processor` field of
/proc/<pid>/task/<tid>/stat: the CPU it last ran on, sampled from a helper thread), what those
CPUs spent meanwhile (/proc/stat: busy, interrupts, and stolen by the hypervisor under a virtual
CPU), the host's layout from /sys, and pin a process to a set of CPUs named by a short spec
(`resolve`). Two clocks tell a slow call's cause apart where the guest sees neither steal nor a
changed clock: `GcClock`, the seconds this process spent in Python's garbage collector (which
holds the GIL, so the engine's thread waits), and `SpeedProbe`, a process of its own that hashes
a fixed buffer over and over: how fast a CPU of the host runs meanwhile, without the GIL."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
SYS = Path("/sys")
# Field 39 of /proc/<pid>/task/<tid>/stat (proc(5)), counted from the first field after the
# command's closing parenthesis, which is field 3.
_PROCESSOR = 39 - 3
SPEC_WORDS = ("none", "node", "cores", "node-cores")


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's CPU list format ("0-3,8,10-11"; blank: none) as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text.strip()!r} (e.g. 0-3,8)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a CPU list: {text.strip()!r} ({part}: the range runs down)")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int] | set[int]) -> str:
    """CPU numbers in the kernel's list format, runs folded: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# /proc/stat's per-CPU columns (proc(5)), in clock ticks: the first eight
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks(stat: str) -> dict[int, dict[str, int]]:
    """Each CPU's time by kind, in clock ticks, from /proc/stat's text (its `cpuN` lines)."""
    out = {}
    for line in stat.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit():
            out[int(name[3:])] = dict(zip(STAT_FIELDS, map(int, fields), strict=False))
    return out


def cpu_seconds(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> dict:
    """Each CPU's seconds between two `cpu_ticks`: busy (neither idle nor waiting on I/O),
    serving interrupts (irq + softirq, in busy) and stolen (steal: the hypervisor ran something
    else on the host CPU under this virtual one)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for cpu, now in after.items():
        was = before.get(cpu, now)
        d = {k: now.get(k, 0) - was.get(k, 0) for k in STAT_FIELDS}
        out[cpu] = {
            "busy_s": (sum(d.values()) - d["idle"] - d["iowait"]) / tick,
            "irq_s": (d["irq"] + d["softirq"]) / tick,
            "steal_s": d["steal"] / tick,
        }
    return out


def thread_cpu(tid: int, pid: int | str = "self", proc: Path = PROC) -> int | None:
    """The CPU thread `tid` of process `pid` last ran on; None once the thread is gone."""
    try:
        stat = (proc / str(pid) / "task" / str(tid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command (field 2) is in parentheses and may hold spaces and ')': split after the last
    return int(stat[stat.rindex(")") + 2 :].split()[_PROCESSOR])


@dataclass
class Topology:
    """The host's logical CPUs, grouped by physical core (SMT siblings) and by NUMA node."""

    cpus: list[int]
    cores: list[list[int]]  # each physical core's logical CPUs (SMT siblings), by first CPU
    nodes: dict[int, list[int]] = field(default_factory=dict)  # NUMA node -> its CPUs
    gpu_node: int | None = None  # the GPU's NUMA node, where the host says

    def one_per_core(self, among: list[int] | None = None) -> list[int]:
        """The first CPU of each core among `among` (default: all): no two share a core."""
        allowed = set(self.cpus if among is None else among)
        firsts = (next((c for c in core if c in allowed), None) for core in self.cores)
        return sorted(c for c in firsts if c is not None)

    def node_of(self, cpu: int) -> int | None:
        return next((n for n, cpus in self.nodes.items() if cpu in cpus), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "cpus": format_cpu_list(self.cpus),
            "smt_siblings": [format_cpu_list(core) for core in self.cores],
            "numa_nodes": {str(n): format_cpu_list(cpus) for n, cpus in self.nodes.items()},
            "gpu_numa_node": self.gpu_node,
        }


def sysfs_bus(bus_id: str) -> str:
    """nvidia-smi's PCI bus id ("00000000:18:00.0") as /sys names the device ("0000:18:00.0")."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    return f"{(domain or '0')[-4:].rjust(4, '0')}:{bus}:{rest}"


def topology(sys: Path = SYS, gpu_bus_id: str | None = None) -> Topology:
    """The host's layout from /sys: online CPUs, SMT siblings, NUMA nodes and, given the GPU's
    PCI bus id (nvidia-smi's), the GPU's node (None where /sys has no node for it: -1)."""
    cpu_dir = sys / "devices/system/cpu"
    online = cpu_dir / "online"
    cpus = parse_cpu_list(online.read_text()) if online.exists() else []
    cores: dict[tuple[int, ...], None] = {}
    for cpu in cpus:
        siblings = cpu_dir / f"cpu{cpu}/topology/thread_siblings_list"
        core = parse_cpu_list(siblings.read_text()) if siblings.exists() else [cpu]
        cores[tuple(c for c in core if c in cpus) or (cpu,)] = None
    nodes = {}
    for node in sorted((sys / "devices/system/node").glob("node[0-9]*")):
        nodes[int(node.name[4:])] = parse_cpu_list((node / "cpulist").read_text())
    gpu_node = None
    if gpu_bus_id:
        numa = sys / "bus/pci/devices" / sysfs_bus(gpu_bus_id) / "numa_node"
        if numa.exists() and int(numa.read_text()) >= 0:
            gpu_node = int(numa.read_text())
    return Topology(cpus, sorted(map(list, cores), key=min), dict(sorted(nodes.items())), gpu_node)


def resolve(spec: str, topo: Topology, allowed: list[int]) -> list[int] | None:
    """The CPUs a spec names, among those `allowed` (the process's affinity): "none" (None:
    leave the affinity as it is), "node" (the GPU's NUMA node), "cores" (one CPU of each core:
    no SMT siblings), "node-cores" (both) or a CPU list ("0-3,8"). A spec the host cannot
    meet raises ValueError, in one line."""
    spec = spec.strip()
    if spec in ("", "none"):
        return None
    chosen = list(allowed)
    # one NUMA node (or none shown, as in many VMs): the GPU's is that one, every CPU
    if spec in ("node", "node-cores") and len(topo.nodes) > 1:
        if topo.gpu_node is None:
            raise ValueError(f"cpus {spec}: the GPU's NUMA node is not known on this host")
        chosen = [c for c in chosen if c in topo.nodes.get(topo.gpu_node, [])]
    if spec in ("cores", "node-cores"):
        chosen = topo.one_per_core(chosen)
    if spec not in SPEC_WORDS:
        if not spec[:1].isdigit():
            raise ValueError(f"cpus {spec!r}: one of {', '.join(SPEC_WORDS)} or a CPU list")
        chosen = parse_cpu_list(spec)
        outside = sorted(set(chosen) - set(allowed))
        if outside:
            raise ValueError(
                f"cpus {spec}: {format_cpu_list(outside)} not among this process's CPUs "
                f"({format_cpu_list(allowed)})"
            )
    if not chosen:
        raise ValueError(f"cpus {spec}: no CPU of this process's ({format_cpu_list(allowed)})")
    return chosen


def pin_process(cpus: list[int], proc: Path = PROC) -> int:
    """Pin every thread of this process to `cpus` (threads and processes started later inherit
    it); returns how many threads were pinned."""
    pinned = 0
    for task in (proc / "self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return pinned


class CpuWatch:
    """Samples, from a thread of its own, the CPU each of `threads` ((pid, tid) pairs) last ran
    on, every `every_s` until `stop()`, which returns the samples by thread, by CPU; `moves`
    counts, by thread, the samples that found it on another CPU than the sample before;
    `seconds` (after `stop()`) each CPU's busy, interrupt and stolen seconds meanwhile."""

    def __init__(
        self, threads: list[tuple[int | str, int]], every_s: float = 0.05, proc: Path = PROC
    ) -> None:
        self.threads, self.proc = threads, proc
        self.every_s = every_s
        self.seen: dict[tuple[int | str, int], Counter[int]] = {t: Counter() for t in threads}
        self.moves: dict[tuple[int | str, int], int] = dict.fromkeys(threads, 0)
        self._last: dict[tuple[int | str, int], int] = {}
        self.seconds: dict[int, dict[str, float]] = {}
        self._ticks = self._read_ticks()
        self._stop = threading.Event()
        self._sample()  # one sample even for a call shorter than a period
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-watch")
        self._thread.start()

    def _sample(self) -> None:
        for pid, tid in self.threads:
            cpu = thread_cpu(tid, pid, self.proc)
            if cpu is None:
                continue
            key = (pid, tid)
            self.seen[key][cpu] += 1
            self.moves[key] += key in self._last and self._last[key] != cpu
            self._last[key] = cpu

    def _read_ticks(self) -> dict[int, dict[str, int]]:
        try:
            return cpu_ticks((self.proc / "stat").read_text())
        except (OSError, ValueError):
            return {}

    def stolen_s(self) -> float:
        """Seconds stolen from the CPUs the watched threads were seen on (after `stop()`)."""
        seen = {cpu for counts in self.seen.values() for cpu in counts}
        return sum(self.seconds.get(cpu, {}).get("steal_s", 0.0) for cpu in seen)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        self.seconds = cpu_seconds(self._ticks, self._read_ticks())
        return {
            f"{pid}/{tid}": {str(c): n for c, n in sorted(seen.items())}
            for (pid, tid), seen in self.seen.items()
        }


class GcClock:
    """Seconds and collections of Python's garbage collector in this process, by generation,
    from `gc.callbacks`, between its start and `stop()` (which unregisters it)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = min(int(info.get("generation", 2)), 2)
            self.seconds[generation] += time.perf_counter() - self._started
            self.collections[generation] += 1
            self._started = None

    def stop(self) -> dict[str, float]:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        return {
            "gc_s": sum(self.seconds),
            "gc_gen2_s": self.seconds[2],
            "gc_collections": float(sum(self.collections)),
        }


# The probe's loop, run by `python -c`: every PERIOD seconds, hash 1 MiB with SHA-256 REPEAT
# times and print the MB/s (hashlib's C code on a fixed buffer: the CPU's pace, not the GIL's).
_PROBE = """
import hashlib, sys, time
period, repeat = float(sys.argv[1]), int(sys.argv[2])
buf = bytes(1 << 20)
while True:
    t = time.perf_counter()
    for _ in range(repeat):
        hashlib.sha256(buf).digest()
    dt = time.perf_counter() - t
    print(f"{repeat * len(buf) / dt / 1e6:.1f}", flush=True)
    time.sleep(max(0.0, period - dt))
"""


class SpeedProbe:
    """A child process that measures, every `every_s`, how fast one CPU hashes a fixed buffer
    (MB/s of SHA-256), until `stop()`, which returns the median, min and max of its samples:
    where a call is slow and the probe is not, the cause is the call's own work; where both
    are, the host's CPUs ran slower (other load on the physical cores, invisible to a guest).
    `cpus`: the CPUs it may run on (default: the caller's)."""

    def __init__(self, every_s: float = 0.05, repeat: int = 2, cpus: set[int] | None = None):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(every_s), str(repeat)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if cpus:
            with contextlib.suppress(OSError):  # it exited already: stop() says no samples
                os.sched_setaffinity(self._proc.pid, cpus)

    def stop(self) -> dict[str, float | int | None]:
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        samples = []
        for line in out.splitlines():
            try:
                samples.append(float(line))
            except ValueError:
                continue
        if not samples:
            return {"probe_samples": 0, "probe_mb_per_s": None}
        return {
            "probe_samples": len(samples),
            "probe_mb_per_s": statistics.median(samples),
            "probe_mb_per_s_min": min(samples),
            "probe_mb_per_s_max": max(samples),
        }
