"""Node 0 of a run whose environment workers reach onto a CPU node, run by
tests/test_env_nodes.py: it attaches to the worker node as `python -m runtime` does, starts the
plan's environment hosting (one worker here, the CPU node's beside it), opens episodes of
tool_envs:ToolsEnv, calls its `pid` tool in each and prints `answers <json>`: the pids that
answered, node 0's workers and the CPU node's, and the counters."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from recipes.loader import apply_overrides, load_recipe
from recipes.planner import plan
from runtime.environments.api import ToolCall
from runtime.environments.nodes import onto_nodes, start_environment_nodes
from runtime.environments.start import start_environments
from runtime.procs.cluster import cluster_from_env
from runtime.procs.lifecycle import RunLifecycle, run
from runtime.procs.nodes import attach_nodes, use_tcp


def main() -> int:
    cluster = cluster_from_env()
    use_tcp(cluster)
    recipe = apply_overrides(load_recipe("tiny-tools"), sys.argv[1:])
    run_plan = plan(recipe, 0, nodes=cluster.nodes - run_plan_env_nodes(recipe))

    async def controller(life: RunLifecycle) -> None:
        hosts = await attach_nodes(life, cluster, join_timeout=120.0)
        nodes = await start_environment_nodes(life, hosts, run_plan)
        local = await start_environments(recipe.env, workers=1)
        try:
            envs = await onto_nodes(local, recipe.env, nodes)
        except BaseException:
            await local.shutdown()
            raise
        try:
            opened = [await envs.open({"key": "k"}, seed=i) for i in range(4)]
            steps = [envs.step(o.episode, ToolCall("pid", {})) for o in opened]
            results = await asyncio.gather(*steps)
            closed = [await envs.close(o.episode, "done") for o in opened]
            answers = {
                "node0_workers": envs.pids,
                "cpu_node_workers": [n.pids for n in envs.nodes],
                "cpu_nodes": [n.name for n in envs.nodes],
                "texts": [r.text for r in results],
                "errors": [r.error for r in results],
                "closed": closed,
                "counters": envs.counters(),
                # the session each worker runs in: its node's `python -m runtime`
                "sessions": {
                    str(pid): os.getsid(pid)
                    for pid in [*envs.pids, *(p for n in envs.nodes for p in n.pids)]
                },
            }
            print("answers " + json.dumps(answers), flush=True)
        finally:
            await envs.shutdown()

    return run(controller)


def run_plan_env_nodes(recipe) -> int:
    return recipe.env.cpu_nodes if recipe.env.cpu_nodes != "auto" else 0


if __name__ == "__main__":
    sys.exit(main())
