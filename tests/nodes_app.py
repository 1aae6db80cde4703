"""A small multi-node controller, run as node 0 by tests/test_multinode.py: it attaches to the
worker nodes as `python -m runtime` does, spawns a two-proc service with GPU assignments on each
node, and prints `procs <json>`: what every proc saw (node, GPUs, threads, service, rank)."""

from __future__ import annotations

import json
import sys

from runtime.procs.cluster import cluster_from_env
from runtime.procs.lifecycle import RunLifecycle, run
from runtime.procs.nodes import attach_nodes, use_tcp
from runtime.procs.spawn import spawn_service


def main() -> int:
    cluster = cluster_from_env()
    use_tcp(cluster)

    async def controller(life: RunLifecycle) -> None:
        hosts = await attach_nodes(life, cluster, join_timeout=120.0)
        seen = []
        for node in range(cluster.nodes):
            mesh = await spawn_service(
                life, f"svc{node}", 2, gpus=[(0, 1), (2,)], threads=3, host=hosts.host(node)
            )
            for info in await life.call(f"svc{node}", mesh.describe()):
                env = info["env"]
                seen.append(
                    {
                        "node": node,
                        "node_rank_env": env.get("SKYPILOT_NODE_RANK"),
                        "gpus": env["CUDA_VISIBLE_DEVICES"],
                        "threads": env["OMP_NUM_THREADS"],
                        "service": env["FORGESKY_SERVICE"],
                        "rank": env["FORGESKY_PROC_RANK"],
                        "poll": env.get("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"),
                    }
                )
        print("procs " + json.dumps(seen), flush=True)

    return run(controller)


if __name__ == "__main__":
    sys.exit(main())
