"""Before a run starts on a node: are the GPUs its plan uses there free enough?

A GPU that another process already holds would otherwise show up minutes later as a CUDA
out-of-memory trace from whichever service got there first. Read through nvidia-smi (no CUDA
context in the controller), compared with the plan's memory estimate for each GPU, it is one
line and exit code 2 before anything starts. Memory taken after that check (a run beside this
one still starting) shows when the generator's engine starts: `engine_room_explained` then says
in one line what held its GPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from recipes import UserError
from runtime.procs.host import host_gpu_ids, visible_gpus

GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class GpuState:
    """One GPU as nvidia-smi sees it: its index and UUID, memory in GB, the processes on it."""

    index: str
    uuid: str
    used_gb: float
    total_gb: float
    processes: tuple[tuple[int, str, float], ...] = ()  # (pid, name, GB)

    @property
    def free_gb(self) -> float:
        return self.total_gb - self.used_gb


def parse_nvidia_smi(gpus_csv: str, apps_csv: str) -> list[GpuState]:
    """`--query-gpu=index,uuid,memory.used,memory.total` and
    `--query-compute-apps=gpu_uuid,pid,process_name,used_memory` (csv, noheader, nounits: MiB)."""
    apps: dict[str, list[tuple[int, str, float]]] = {}
    for line in apps_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[1].isdigit():
            used = float(parts[3]) * MIB / GB if _number(parts[3]) else 0.0
            apps.setdefault(parts[0], []).append((int(parts[1]), parts[2], used))
    states = []
    for line in gpus_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and _number(parts[2]) and _number(parts[3]):
            index, uuid = parts[0], parts[1]
            states.append(
                GpuState(
                    index,
                    uuid,
                    float(parts[2]) * MIB / GB,
                    float(parts[3]) * MIB / GB,
                    tuple(apps.get(uuid, ())),
                )
            )
    return states


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_gpus() -> list[GpuState] | None:
    """This host's GPUs, or None where there is no nvidia-smi or it does not answer."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def query(what: str) -> str:
        return subprocess.run(
            [smi, what, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout

    try:
        return parse_nvidia_smi(
            query("--query-gpu=index,uuid,memory.used,memory.total"),
            query("--query-compute-apps=gpu_uuid,pid,process_name,used_memory"),
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _by_name(gpus: list[GpuState]) -> dict[str, GpuState]:
    """Each GPU under both its names, its index and its UUID (CUDA_VISIBLE_DEVICES takes either)."""
    return {g.index: g for g in gpus} | {g.uuid: g for g in gpus}


def planned_gb(plan: Any, node: int) -> dict[int, dict[str, float]]:
    """The plan's GPUs on `node` (its indices) and the GB each service is estimated to hold."""
    per_gpu: dict[int, dict[str, float]] = {}
    for p in plan.placements:
        if p.node != node:
            continue
        for gpu in p.gpus:
            gb = plan.memory.get(p.service)
            if gb is not None:
                per_gpu.setdefault(gpu, {})[p.service] = gb
    return per_gpu


def check_gpus_free(
    plan: Any, node: int, gpus: list[GpuState] | None, visible: str | None = None
) -> None:
    """Raise UserError where a GPU the plan uses on `node` has less free memory than the plan
    puts there (`gpus`: this host's, from `read_gpus`; None: nothing to check)."""
    if plan.cpu or not gpus:
        return
    by_name = _by_name(gpus)
    for gpu, services in sorted(planned_gb(plan, node).items()):
        name = host_gpu_ids((gpu,), visible)[0]
        # the host's own name for it where CUDA_VISIBLE_DEVICES renumbers
        label = f"GPU {gpu}" if name == str(gpu) else f"GPU {gpu} (host GPU {name})"
        state = by_name.get(name)
        if state is None:
            raise UserError(
                f"the plan uses {label} on this node, which nvidia-smi does not list; "
                f"it lists {', '.join(g.index for g in gpus)}"
            )
        settings = getattr(plan, "settings", None)
        if "generator" in services and settings and settings.generator.kv_cache_gb is None:
            # vLLM profiling a GPU of its own starts only with this share of the GPU free
            services["generator"] = settings.generator.gpu_memory_utilization * state.total_gb
        need = sum(services.values())
        if state.free_gb >= need:
            continue
        holders = ", ".join(f"pid {pid} {pname} {gb:.1f} GB" for pid, pname, gb in state.processes)
        taken = f"{state.used_gb:.1f} GB taken" + (f" by {holders}" if holders else "")
        wants = " + ".join(f"{s} ~{gb:.0f} GB" for s, gb in services.items())
        raise UserError(
            f"{label} is in use: {state.free_gb:.1f} of {state.total_gb:.0f} GB free "
            f"({taken}), and the plan puts {wants} there; stop that process or give this run "
            "other GPUs (CUDA_VISIBLE_DEVICES)"
        )


# What vLLM and torch say when an engine finds no GPU memory for itself or its KV cache
NO_ROOM = ("No available memory for the cache blocks", "CUDA out of memory")


def engine_room_line(error: BaseException, gpus: list[GpuState] | None, own_pid: int) -> str | None:
    """Where a generator's engine could not start for want of GPU memory, one line on what held
    its GPUs at that moment (`gpus`: `read_gpus()` in the generator's process, whose
    CUDA_VISIBLE_DEVICES are its GPUs): the start-up check passed, so memory was taken after it,
    usually by a process outside the run (another run, a notebook). None for any other error,
    or where nvidia-smi gave nothing."""
    said = str(error)
    if not any(marker in said for marker in NO_ROOM) or not gpus:
        return None
    by_name = _by_name(gpus)
    mine = [by_name[v] for v in visible_gpus() if v in by_name] or gpus
    parts = []
    for g in mine:
        holders = ", ".join(
            f"pid {pid} {name} {gb:.1f} GB{' (this engine)' if pid == own_pid else ''}"
            for pid, name, gb in g.processes
        )
        parts.append(
            f"GPU {g.index} had {g.used_gb:.1f} of {g.total_gb:.0f} GB in use"
            + (f" by {holders}" if holders else "")
        )
    first = said.strip().splitlines()[0] if said.strip() else type(error).__name__
    return (
        f"the generator's engine found no room on its GPU: {'; '.join(parts)}; the run's "
        "start-up check found room there: if a process listed is not this run's (another run, "
        f"a notebook), stop it or give this run other GPUs (CUDA_VISIBLE_DEVICES) [{first}]"
    )


@contextlib.contextmanager
def engine_room_explained() -> Iterator[None]:
    """Around an engine's start: an error for want of GPU memory becomes `engine_room_line`'s
    (a RuntimeError from the original), any other passes as it is."""
    try:
        yield
    except Exception as e:
        line = engine_room_line(e, read_gpus(), os.getpid())
        if line is None:
            raise
        raise RuntimeError(line) from e
