"""The controller's side of a multi-node run: the worker nodes joined, attached as one Monarch
host mesh, a host per plan node, watched until the end, and told when the run is over.

    use_tcp(cluster)                          # before Monarch starts in this process
    hosts = await attach_nodes(life, cluster, join_timeout=300)
    mesh = await spawn_service(life, "trainer", 1, host=hosts.host(placement.node))

Node 0 is the controller's own machine: its services run on the controller's local host
(`this_host()`), as in a one-node run, so the head node needs no worker loop; its fixed port
serves the node watch (runtime/procs/nodewatch.py) that the workers dial instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from monarch.actor import HostMesh, attach_to_workers

from recipes import UserError
from runtime.procs.cluster import PORT_ENV, RANK_ENV, Cluster
from runtime.procs.failures import ActorFailure
from runtime.procs.host import RUN_ID_ENV
from runtime.procs.lifecycle import RunLifecycle, RunStopping
from runtime.procs.nodewatch import HEARTBEAT_S, SILENCE_S, NodeWatch

# After every node joined, Monarch's attach takes well under a second; a stuck one is a bug or a
# firewall between the nodes (Monarch's procs listen on ephemeral ports, not only the fixed one).
ATTACH_TIMEOUT_S = 120.0
# The hosts' own shutdown after a normal end; past it the workers are told to exit anyway.
HOST_SHUTDOWN_S = 20.0


class NodeFailure(ActorFailure):
    """A node did not join, or was lost; `str()` is one line naming it."""

    def __init__(self, node: str, cause: str) -> None:
        Exception.__init__(self, f"{node} {cause}")
        self.service = node
        self.cause = cause
        self.original = None


def use_tcp(cluster: Cluster) -> None:
    """Make this process's Monarch reachable from the other nodes: TCP on this node's address.

    Must run before anything starts Monarch here (Monarch's default is Unix sockets, and a
    hostname that resolves to loopback gives it no address to advertise).
    """
    from monarch.actor import enable_transport

    enable_transport(cluster.url(cluster.rank, port=0))


@dataclass
class NodeHosts:
    """Where a plan node's procs run: None for node 0 (the controller's host), else its host."""

    cluster: Cluster
    workers: HostMesh | None = None  # every worker node, in rank order (rank k at index k-1)

    def host(self, node: int) -> HostMesh | None:
        """The host of plan node `node` (None: this machine, Monarch's `this_host()`)."""
        if not 0 <= node < self.cluster.nodes:
            raise ValueError(f"the plan places a service on node {node} of {self.cluster.nodes}")
        if node == 0 or self.workers is None:
            return None
        return self.workers.slice(hosts=node - 1)

    def host_of(self, service: str, placements: Sequence[Any]) -> HostMesh | None:
        """The one host of a service whose procs must share a node (one proc mesh)."""
        nodes = sorted({p.node for p in placements})
        if len(nodes) > 1:
            raise UserError(
                f"the plan puts the {service} on nodes {', '.join(map(str, nodes))}, and this "
                f"runtime runs the {service} on one node; plan with fewer GPUs"
            )
        return self.host(nodes[0] if nodes else 0)


async def attach_nodes(
    life: RunLifecycle,
    cluster: Cluster,
    *,
    join_timeout: float,
    interval: float = HEARTBEAT_S,
    silence: float = SILENCE_S,
) -> NodeHosts:
    """Wait for every worker node to join, attach to them, and watch them until the run ends.

    One node: nothing to do. A node that does not join within `join_timeout` s, or is lost
    later, fails the run with a line naming it (exit code 1, so SkyPilot's recovery can
    restart the job). Registers the workers' end with `life`: call this before spawning any
    service, so it stops last, and from the run's main coroutine itself (not a task of its
    own): how that coroutine ended is the exit code the workers end with.
    """
    if not cluster.multi_node:
        return NodeHosts(cluster)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def lost(rank: int, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is over anyway
            loop.call_soon_threadsafe(life.fail, NodeFailure(cluster.name(rank), f"lost: {reason}"))

    watch = NodeWatch(
        cluster, lost, run_id=os.environ.get(RUN_ID_ENV, ""), interval=interval, silence=silence
    )
    try:
        watch.start()
    except OSError as e:
        raise UserError(
            f"cannot listen on {cluster.head}:{cluster.port} (node 0 in SKYPILOT_NODE_IPS): "
            f"{e.strerror or e}; pick another port with --worker-port or {PORT_ENV}"
        ) from None
    hosts = NodeHosts(cluster)

    async def end() -> None:
        watch.quiesce()
        code = run_exit_code(life, main)
        try:
            # Monarch's host shutdown ends the workers with exit code 0; after a failure they
            # are told the code instead, and end their procs themselves.
            if code == 0 and hosts.workers is not None and not watch.lost:
                await asyncio.wait_for(_awaited(hosts.workers.shutdown()), HOST_SHUTDOWN_S)
        finally:
            watch.finish(code)

    life.register("worker nodes", end, timeout=HOST_SHUTDOWN_S + 10.0)
    hosts.workers = await life.call(
        "nodes", _join_and_attach(cluster, watch, join_timeout), interruptible=True
    )
    return hosts


def run_exit_code(life: RunLifecycle, main: asyncio.Task | None) -> int:
    """The exit code a run is ending with, as `RunLifecycle.run` will return it, once its main
    task is over: 1 after a failure, 2 after a UserError, 1 after a bug, else 0 (also a stop)."""
    if life.failure is not None:
        return 1
    if main is None or not main.done() or main.cancelled():
        return 0
    error = main.exception()
    if error is None or isinstance(error, RunStopping):
        return 0
    return 2 if isinstance(error, UserError) else 1


async def _join_and_attach(cluster: Cluster, watch: NodeWatch, join_timeout: float) -> HostMesh:
    workers = [cluster.name(n) for n in range(1, cluster.nodes)]
    print(
        f"waiting for {len(workers)} worker node(s) to join on port {cluster.port}: "
        f"{', '.join(workers)}",
        flush=True,
    )
    start = time.perf_counter()
    deadline = start + join_timeout
    while watch.missing() and not watch.lost and time.perf_counter() < deadline:
        await asyncio.sleep(0.2)
    if watch.lost:
        rank, reason = next(iter(watch.lost.items()))
        raise NodeFailure(cluster.name(rank), f"lost: {reason}")
    missing = watch.missing()
    if missing:
        there = f"there with {RANK_ENV}={missing[0]}" if len(missing) == 1 else "on them"
        raise NodeFailure(
            cluster.names(missing),
            f"did not join within {join_timeout:g} s: no worker there reached the controller "
            f"at {cluster.head}:{cluster.port} (is `python -m runtime` running {there}?)",
        )
    mesh = attach_to_workers(
        ca="trust_all_connections",
        workers=[cluster.url(n) for n in range(1, cluster.nodes)],
        name="nodes",
    )
    try:
        await asyncio.wait_for(_awaited(mesh.initialized), ATTACH_TIMEOUT_S)
    except TimeoutError:
        raise NodeFailure(
            cluster.names(list(range(1, cluster.nodes))),
            f"joined but Monarch could not attach to them within {ATTACH_TIMEOUT_S:g} s "
            "(is traffic between the nodes allowed on every port?)",
        ) from None
    print(
        f"{len(workers)} worker node(s) attached in {time.perf_counter() - start:.1f} s", flush=True
    )
    return mesh


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
