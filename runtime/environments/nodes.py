"""Environment workers on CPU nodes beside the run's own (the plan's env.cpu_nodes), and the
one Environments the episodes see over node 0's workers and theirs.

A CPU node joins the run like any other worker node (runtime/procs/nodes.py: it dials the
controller, and the controller attaches to its Monarch worker); the controller then spawns one
proc there holding an `EnvironmentNode` actor, which starts that node's environment workers
(workers.py, the same worker processes as node 0's) and answers the episodes opened on it.

`Spread` opens each episode on the hosting (node 0's workers or a CPU node's) with the fewest
open episodes a worker, and sends the episode's steps and close where it opened. A CPU node's
counters (tool calls, errors, seconds, workers lost) come back with each answer. A node that
stops answering drops its episodes (counted); losing the node itself ends the run through the
node watch, as any node's loss does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

from monarch.actor import Actor, concurrent_endpoint, endpoint

from runtime.environments.api import Opening, StepResult, ToolCall, zero_counters

# A node's actor: its answer to a request must come within the call's own time; this is the
# margin for the way there and back.
_MARGIN_S = 10.0


async def served(hosting: Any, op: str, *args: Any) -> tuple[Any, dict]:
    """A CPU node's answer to one request (`op`: open, step or close on its hosting) and its
    counters after it; ("lost", why) where every worker there is gone (the controller's side
    drops the episode)."""
    try:
        answer = await getattr(hosting, op)(*args)
    except Exception as e:
        return ("lost", str(e)), hosting.counters()
    return answer, hosting.counters()


class EnvironmentNode(Actor):
    """A CPU node's environment workers, served to the controller's `Spread`."""

    def __init__(self) -> None:
        self.hosting: Any = None

    @endpoint
    async def start(self, env: Any, workers: int) -> dict[str, Any]:
        """Start `workers` workers for the recipe's `env` section; their pids and this host."""
        from runtime.environments.start import start_environments

        self.hosting = await start_environments(env, workers=workers)
        return {"pids": self.hosting.pids, "host": socket.gethostname(), "pid": os.getpid()}

    @concurrent_endpoint
    async def open(self, row: dict[str, Any], seed: int) -> tuple[Any, dict]:
        return await served(self.hosting, "open", row, seed)

    @concurrent_endpoint
    async def step(self, episode: str, call: ToolCall) -> tuple[Any, dict]:
        return await served(self.hosting, "step", episode, call)

    @concurrent_endpoint
    async def close(self, episode: str, answer: str) -> tuple[Any, dict]:
        return await served(self.hosting, "close", episode, answer)

    @endpoint
    async def stop_workers(self) -> None:
        if self.hosting is not None:
            await self.hosting.shutdown()


class NodeLost(Exception):
    """A CPU node's workers are all gone, or the node no longer answers."""


class RemoteNode:
    """The controller's handle on one CPU node's workers (an `EnvironmentNode` actor)."""

    def __init__(self, name: str, actor: Any, workers: int, call_timeout_s: float) -> None:
        self.name = name
        self.actor = actor
        self.workers = workers
        self.call_timeout_s = call_timeout_s
        self.counts = zero_counters()
        self.pids: list[int | None] = []
        self.open_episodes = 0

    async def start(self, env: Any) -> None:
        info = await self.actor.start.call_one(env, self.workers)
        self.pids = list(info["pids"])

    async def _ask(self, endpoint_: Any, *args: Any) -> Any:
        answer, counts = await asyncio.wait_for(
            endpoint_.call_one(*args), self.call_timeout_s + _MARGIN_S
        )
        self.counts = dict(counts)
        if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "lost":
            raise NodeLost(f"{self.name}: {answer[1]}")
        return answer

    async def open(self, row: dict[str, Any], seed: int) -> Opening:
        return await self._ask(self.actor.open, row, seed)

    async def step(self, episode: str, call: ToolCall) -> StepResult:
        return await self._ask(self.actor.step, episode, call)

    async def close(self, episode: str, answer: str) -> float | None:
        return await self._ask(self.actor.close, episode, answer)

    def counters(self) -> dict[str, float]:
        return dict(self.counts)

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.stop_workers.call_one(), 15.0)


class Spread:
    """The Environments protocol (api.py) over node 0's workers and the CPU nodes'."""

    def __init__(self, local: Any, local_workers: int, nodes: list[RemoteNode]) -> None:
        self.local = local
        self.local_workers = local_workers
        self.nodes = nodes
        # episode id -> (the hosting, its own id there)
        self._where: dict[str, tuple[Any, str]] = {}
        self._open: dict[int, int] = {}
        self._gone: set[str] = set()  # episodes of a CPU node that no longer answers
        self._lost = zero_counters()
        self._n = 0

    @property
    def hostings(self) -> list[tuple[Any, int]]:
        return [(self.local, self.local_workers), *((n, n.workers) for n in self.nodes)]

    def _pick(self) -> Any:
        return min(self.hostings, key=lambda hw: self._open.get(id(hw[0]), 0) / hw[1])[0]

    async def open(self, row: dict[str, Any], seed: int) -> Opening:
        hosting = self._pick()
        self._open[id(hosting)] = self._open.get(id(hosting), 0) + 1
        self._n += 1
        episode = f"s{self._n}"
        self._where[episode] = (hosting, "")
        if hosting is self.local:  # its failures are its own (dropped episodes, every worker lost)
            opened = await hosting.open(row, seed)
        else:
            try:
                opened = await hosting.open(row, seed)
            except Exception:  # the node's workers are gone, or the node does not answer
                self._lose(episode)
                return Opening(episode, [])
        self._where[episode] = (hosting, opened.episode)
        return Opening(episode, opened.tools, opened.messages)

    def _lose(self, episode: str) -> None:
        """A CPU node's episode that cannot go on: dropped, its steps end it, close gives None."""
        if episode not in self._gone:
            self._gone.add(episode)
            self._lost["episodes_dropped"] += 1

    async def step(self, episode: str, call: ToolCall) -> StepResult:
        hosting, inner = self._where[episode]
        if hosting is self.local:
            return await hosting.step(inner, call)
        if episode not in self._gone:
            try:
                return await hosting.step(inner, call)
            except Exception:
                self._lose(episode)
        self._lost["tool_calls"] += 1
        self._lost["tool_errors"] += 1
        return StepResult(
            "the tool's worker stopped; the episode ends here", done=True, error="crashed"
        )

    async def close(self, episode: str, answer: str) -> float | None:
        hosting, inner = self._where.pop(episode)
        self._open[id(hosting)] -= 1
        if hosting is self.local:
            return await hosting.close(inner, answer)
        if episode in self._gone:
            self._gone.discard(episode)
            return None
        try:
            return await hosting.close(inner, answer)
        except Exception:
            self._lost["episodes_dropped"] += 1
            return None

    def counters(self) -> dict[str, float]:
        total = dict(self._lost)
        for hosting, _ in self.hostings:
            for name, value in hosting.counters().items():
                total[name] = total.get(name, 0.0) + value
        return total

    @property
    def pids(self) -> list[int | None]:
        return list(self.local.pids)

    @property
    def open_episodes(self) -> int:
        return len(self._where)

    async def shutdown(self) -> None:
        await asyncio.gather(*(n.shutdown() for n in self.nodes), self.local.shutdown())


async def start_environment_nodes(life: Any, hosts: Any, plan: Any) -> list[tuple[str, Any, int]]:
    """The plan's CPU nodes for environments (plan nodes num_nodes on): an `EnvironmentNode`
    actor spawned on each, supervised by `life`, as (name, actor, workers) for
    `start_environments`. None where the plan has no such nodes."""
    from runtime.procs.spawn import spawn_service

    env = getattr(plan, "environment", None)
    if env is None or not env.cpu_nodes:
        return []
    first = plan.num_nodes
    meshes = await asyncio.gather(
        *(
            spawn_service(life, f"environments{k}", 1, threads=1, host=hosts.host(first + k))
            for k in range(env.cpu_nodes)
        )
    )
    return [
        (
            hosts.cluster.name(first + k),
            mesh.spawn_actor(EnvironmentNode, name=f"environments{k}"),
            env.cpu_node_workers,
        )
        for k, mesh in enumerate(meshes)
    ]


async def onto_nodes(local: Any, env: Any, nodes: Sequence[tuple[str, Any, int]]) -> Any:
    """`local` (this node's workers, started) and the CPU nodes' workers, started now, as one
    hosting the episodes spread over (`Spread`). `nodes`: (name, EnvironmentNode
    actor, workers) of each CPU node."""
    remote = [RemoteNode(name, actor, n, env.call_timeout_s) for name, actor, n in nodes]
    try:
        await asyncio.gather(*(r.start(env) for r in remote))
    except BaseException:
        await asyncio.gather(*(r.shutdown() for r in remote))
        raise
    where = ", ".join(f"{r.workers} on {r.name}" for r in remote)
    print(f"environment workers: {len(local.workers)} on node 0, {where}", flush=True)
    return Spread(local, len(local.workers), remote)
