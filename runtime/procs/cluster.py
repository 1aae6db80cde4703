"""Which node this process runs on and where the others are.

SkyPilot starts the same `run` on every node of a cluster with `SKYPILOT_NODE_RANK` (0 is the
head) and `SKYPILOT_NODE_IPS` (one address per line, in rank order). Every node listens on one
fixed port: a worker node's Monarch worker loop, and on the head the controller's node watch
(runtime/procs/nodewatch.py), which the workers dial to join the run.

Torch-free and Monarch-free: `python -m runtime` decides its role from this before importing
either.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recipes import UserError
from recipes.names import WORKER_PORT as DEFAULT_WORKER_PORT
from recipes.names import WORKER_PORT_ENV as PORT_ENV

RANK_ENV = "SKYPILOT_NODE_RANK"
IPS_ENV = "SKYPILOT_NODE_IPS"


@dataclass(frozen=True)
class Cluster:
    """The nodes of a run: this node's rank, every node's address (rank order), the port."""

    rank: int = 0
    ips: tuple[str, ...] = ("127.0.0.1",)
    port: int = DEFAULT_WORKER_PORT

    @property
    def nodes(self) -> int:
        return len(self.ips)

    @property
    def multi_node(self) -> bool:
        return len(self.ips) > 1

    @property
    def ip(self) -> str:
        """This node's address."""
        return self.ips[self.rank]

    @property
    def head(self) -> str:
        """The controller's node (rank 0)."""
        return self.ips[0]

    def name(self, node: int) -> str:
        """How messages name a node: `node 2 (10.0.0.7)`."""
        return f"node {node} ({self.ips[node]})"

    def names(self, nodes: list[int]) -> str:
        """`node 2 (10.0.0.7)`, or `nodes 1 (10.0.0.6), 2 (10.0.0.7)`."""
        if len(nodes) == 1:
            return self.name(nodes[0])
        return "nodes " + ", ".join(f"{n} ({self.ips[n]})" for n in nodes)

    def address(self, node: int) -> tuple[str, int]:
        """(host, port) of a node's fixed port, for sockets."""
        return self.ips[node], self.port

    def url(self, node: int, port: int | None = None) -> str:
        """A Monarch channel address on a node, `tcp://10.0.0.7:26600` (`[v6]` bracketed)."""
        ip = self.ips[node]
        host = f"[{ip}]" if ":" in ip else ip
        return f"tcp://{host}:{self.port if port is None else port}"


def cluster_from_env(environ: Mapping[str, str] | None = None, port: int | None = None) -> Cluster:
    """The cluster SkyPilot describes in the environment; one local node when it says nothing.

    `port` (the --worker-port option) wins over FORGESKY_WORKER_PORT and the default.
    Raises UserError for values that do not make sense.
    """
    env = os.environ if environ is None else environ
    if port is None:
        raw = env.get(PORT_ENV, "").strip()
        try:
            port = int(raw) if raw else DEFAULT_WORKER_PORT
        except ValueError:
            raise UserError(f"{PORT_ENV}={raw!r} is not a port number") from None
    if not 0 < port < 65536:
        raise UserError(f"worker port must be between 1 and 65535, got {port}")
    ips = tuple(line.strip() for line in env.get(IPS_ENV, "").splitlines() if line.strip())
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise UserError(f"{IPS_ENV} lists {ip!r}, which is not an IP address") from None
    raw_rank = env.get(RANK_ENV, "0").strip() or "0"
    try:
        rank = int(raw_rank)
    except ValueError:
        raise UserError(f"{RANK_ENV}={raw_rank!r} is not a node rank") from None
    if not ips:
        if rank != 0:
            raise UserError(f"{RANK_ENV}={rank} but {IPS_ENV} is not set")
        return Cluster(port=port)
    if not 0 <= rank < len(ips):
        raise UserError(f"{RANK_ENV}={rank} but {IPS_ENV} lists {len(ips)} node(s)")
    if len(set(ips)) != len(ips):
        raise UserError(f"{IPS_ENV} lists an address twice: {', '.join(ips)}")
    return Cluster(rank=rank, ips=ips, port=port)


def check_plan_fits(plan: Any, cluster: Cluster, available_bytes: int | None = None) -> None:
    """Raise UserError unless the plan uses exactly the cluster's nodes and node 0 has the host
    memory the plan needs (a reference on the CPU, checkpoint writes staged in memory, the
    export at the end writing a file at a time; `available_bytes`: this host's, by default)."""
    if plan.num_nodes + getattr(plan, "env_nodes", 0) != cluster.nodes:
        _wrong_nodes(plan, cluster)
    reference = getattr(plan, "reference_host_gb", None) or 0.0
    staged = getattr(plan, "checkpoint_host_gb", None) or 0.0
    export = getattr(plan, "export_host_gb", None) or 0.0
    if (reference or staged) and cluster.rank == 0:
        if available_bytes is None:
            import psutil

            available_bytes = psutil.virtual_memory().available
        free = f"this node has {available_bytes / 1e9:.0f} GB free"
        if reference * 1e9 > available_bytes:
            raise UserError(
                f"layout.reference.device cpu: the reference needs ~{reference:.0f} GB of host "
                f"memory and {free}; put it on a GPU (layout.reference.device=gpu) or disable it"
            )
        if (reference + staged + export) * 1e9 > available_bytes:
            also = f" beside the CPU reference's ~{reference:.0f} GB" if reference else ""
            raise UserError(
                f"checkpoints: each write stages the trainer's state (~{staged:.0f} GB) in host "
                f"memory, the export at the end holds a file of the model there at a time "
                f"(~{export:.0f} GB){also}, and {free}; use a node with more memory"
            )


def _wrong_nodes(plan: Any, cluster: Cluster) -> None:
    where = (
        f"this cluster has {cluster.nodes} ({IPS_ENV})"
        if cluster.multi_node
        else f"this is one machine ({IPS_ENV} not set)"
    )
    what = f"{plan.total_gpus} GPUs" if not plan.cpu else "CPU"
    count = plan.num_nodes + getattr(plan, "env_nodes", 0)
    nodes = f"{count} node{'s' if count != 1 else ''}"
    if getattr(plan, "env_nodes", 0):
        nodes += f" ({plan.env_nodes} of them CPU nodes for the environments)"
    raise UserError(
        f"the plan for {plan.recipe_name} on {what} uses {nodes} but {where}; "
        f"run it on {nodes} (forgesky launch sets num_nodes)"
    )
