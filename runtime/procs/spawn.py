"""Starting a service's procs under a run's lifecycle: pinned, watched, stopped at shutdown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from monarch.actor import HostMesh

from runtime.procs.lifecycle import RunLifecycle
from runtime.procs.mesh import ServiceMesh


async def spawn_service(
    life: RunLifecycle,
    service: str,
    procs: int,
    gpus: Sequence[tuple[int, ...]] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    threads: int | None = None,
    host: HostMesh | None = None,
    stop_timeout: float = 30.0,
    interruptible: bool = False,
) -> ServiceMesh:
    """`ServiceMesh.spawn` as a supervised call of `life`: its failures are attributed to
    `service`, and its procs are stopped at shutdown (after everything registered later).

    With `interruptible`, a stop request abandons the spawn (RunStopping); its procs are then
    ended with Monarch at shutdown.
    """
    spawn = ServiceMesh.spawn(service, procs, gpus, env=env, threads=threads, host=host)
    mesh = await life.call(service, spawn, interruptible=interruptible)
    life.own(mesh, stop_timeout)
    return mesh
