"""The procs of a run: one Monarch proc mesh per service, pinned to its GPUs and CPU threads.

Pinning: each proc gets its own bootstrap environment (Monarch's per-rank `BootstrapCommand`),
so `CUDA_VISIBLE_DEVICES` is in place before the proc imports torch. Monarch's
`per_host={"gpus": n}` would only be a label.

Thread policy: a proc that computes on CPU gets `cores // busy procs on its host` threads (at
least 1) through OMP/MKL/OpenBLAS variables, which torch reads at import. Without that, every
proc starts one thread per core and five procs on a 2-core machine fight over the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
from monarch.actor import (
    Actor,
    HostMesh,
    ProcMesh,
    default_bootstrap_cmd,
    endpoint,
    this_host,
)

from runtime.procs.failures import PROCS_ENV, RANK_ENV, ActorFailure, root_cause
from runtime.procs.host import RUN_ID_ENV, host_gpu_ids, start_monarch
from runtime.procs.mps import PIPE_ENV

T = TypeVar("T")

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SERVICE_ENV = "FORGESKY_SERVICE"
PROBE_SUFFIX = "_probe"

_STOP_FAILED_TIMEOUT_S = 10.0


def proc_bootstrap_cmd() -> BootstrapCommand:
    """Monarch's command for a new proc with runtime.procs.proc_main as its main module: the
    proc prints its stacks on `kill -USR1`, then runs Monarch's proc main."""
    base = default_bootstrap_cmd()
    return BootstrapCommand(base.program, base.arg0, ["-m", "runtime.procs.proc_main"], base.env)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def threads_per_proc(busy_procs: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `busy_procs` procs computing at once on one host."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, busy_procs))


def proc_env(
    service: str,
    rank: int,
    gpus: tuple[int, ...],
    threads: int,
    extra: Mapping[str, str] | None = None,
    procs: int = 1,
) -> dict[str, str]:
    """The environment one proc starts with: its GPUs, its thread budget, its identity (its
    rank among the service's `procs`).

    An empty `gpus` hides every GPU (`CUDA_VISIBLE_DEVICES=""`), so a CPU service on a GPU host
    cannot create a CUDA context on GPU 0 by accident.
    """
    extra = dict(extra or {})
    if "CUDA_VISIBLE_DEVICES" in extra:
        raise ValueError(f"{service}: pass GPUs through `gpus`, not CUDA_VISIBLE_DEVICES in env")
    env = {var: str(threads) for var in THREAD_ENV_VARS}
    env.update(extra)
    # PCI bus order makes the indices match nvidia-smi, which is what placements are written in.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    names = host_gpu_ids(gpus)  # also checks that the run was given these GPUs
    if PIPE_ENV in extra:
        # An MPS client sees the GPUs of its control daemon renumbered from 0, and a host name
        # would miss (NVIDIA's MPS docs). The run's daemon sees the GPUs the run was given, in
        # the order the plan numbers them, so the plan's own indices name the client's GPUs.
        names = [str(g) for g in gpus]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names)
    env[SERVICE_ENV] = service
    env[RANK_ENV] = str(rank)
    env[PROCS_ENV] = str(procs)
    if RUN_ID_ENV in os.environ:
        env[RUN_ID_ENV] = os.environ[RUN_ID_ENV]
    return env


class ProcProbe(Actor):
    """Answers who and where a proc is; spawned on every service mesh to learn its pids."""

    @endpoint
    async def describe(self, with_torch: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "env": dict(os.environ),
        }
        if with_torch:
            import torch

            info["torch_threads"] = torch.get_num_threads()
        return info


class ServiceMesh:
    """The procs of one service (on one or more hosts) and the actors spawned on them."""

    def __init__(self, service: str, procs: ProcMesh, gpus: Sequence[tuple[int, ...]]) -> None:
        self.service = service
        self.procs = procs
        self.gpus = tuple(tuple(g) for g in gpus)
        self.pids: list[int] = []
        self.local = False  # its procs run on this machine (children of this process)
        self.stopped = False
        self.failed = False  # set by whoever learns that one of its actors or procs died
        # Given names of the actor meshes: failures name meshes by them, so they must differ
        # between services (the default is the service's name).
        self.actor_names: set[str] = set()
        self._probe: Any = None

    @classmethod
    async def spawn(
        cls,
        service: str,
        procs: int,
        gpus: Sequence[tuple[int, ...]] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        threads: int | None = None,
        host: HostMesh | None = None,
    ) -> ServiceMesh:
        """Start `procs` procs per host of `host` (default: this machine), pinned and ready.

        `gpus[i]` lists the local GPU indices of proc i (the same on every host); `()` or None
        means CPU. `threads` defaults to `threads_per_proc(procs)`; pass the value for all busy
        procs of the host when several services share it. Raises ActorFailure if the procs
        cannot start.
        """
        start_monarch()
        gpus = [()] * procs if gpus is None else [tuple(g) for g in gpus]
        if len(gpus) != procs:
            raise ValueError(f"{service}: {procs} procs but {len(gpus)} GPU assignments")
        threads = threads_per_proc(procs) if threads is None else threads
        envs = [proc_env(service, rank, gpus[rank], threads, env, procs) for rank in range(procs)]
        base = proc_bootstrap_cmd()

        def bootstrap(point: Any) -> Any:
            return base.with_env(envs[point["procs"]])

        local = host is None
        host = this_host() if host is None else host
        proc_mesh = host.spawn_procs(
            per_host={"procs": procs}, name=service, bootstrap_command=bootstrap
        )
        mesh = cls(service, proc_mesh, gpus)
        mesh.local = local
        mesh._probe = mesh.spawn_actor(ProcProbe, name=service + PROBE_SUFFIX)
        try:
            infos = await mesh.describe()
        except Exception as e:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(mesh.stop(), _STOP_FAILED_TIMEOUT_S)
            raise ActorFailure(service, f"procs did not start: {root_cause(e)}", e) from None
        mesh.pids = [info["pid"] for info in infos]
        return mesh

    def spawn_actor(
        self, actor_class: type[T], *args: Any, name: str | None = None, **kwargs: Any
    ) -> T:
        """Spawn `actor_class` on every proc of this service (Monarch's `ProcMesh.spawn`)."""
        name = name or self.service
        self.actor_names.add(name)
        return self.procs.spawn(name, actor_class, *args, **kwargs)

    async def describe(self, with_torch: bool = False) -> list[dict[str, Any]]:
        """pid, host name and environment of every proc, in rank order."""
        values = await self._probe.describe.call(with_torch)
        return [info for _, info in values.items()]

    def owns(self, mesh_name: str) -> bool:
        """Whether Monarch's name of a failed mesh (`<given name>-<suffix>`) is one of ours."""
        given = given_name(mesh_name)
        return given == self.service or given in self.actor_names

    async def stop(self) -> None:
        """Stop the actors and the procs of this service."""
        if self.stopped:
            return
        self.stopped = True
        await _await(self.procs.stop())


def given_name(mesh_name: str) -> str:
    """The name a mesh was given, of Monarch's name for it (`<given name>-<suffix>`)."""
    return mesh_name.rsplit("-", 1)[0]


async def _await(awaitable: Any) -> Any:
    return await awaitable
