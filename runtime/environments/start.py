"""The run's environments from its recipe's `env` section: worker processes on the node (the
default), or in this process for CPU tests and tiny runs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from recipes.environment import node_env_plan
from recipes.errors import UserError


def node_workers(recipe: Any, plan: Any) -> int:
    """The environment workers this node starts: env.workers_per_node, or with auto the plan's
    count (recipes/environment.py `env_plan`) for the cores this process may run on."""
    env = recipe.env
    if env.workers_per_node != "auto":
        return env.workers_per_node
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    planned = node_env_plan(
        recipe, plan.cpu, plan.placements, plan.generator_replicas, cores or 1, "this node"
    )
    assert planned is not None  # the recipe has an env section
    return planned.workers


async def start_environments(
    env: Any,
    *,
    in_process: bool = False,
    workers: int | None = None,
    nodes: Sequence[tuple[str, Any, int]] = (),
) -> Any:
    """Hosting for `env` (recipes/environment.py), started: every worker ready, or the first
    environment built and its tools listed. An environment that cannot be hosted is one line:
    UserError in-process, EnvironmentsLost from the workers (each failed to start).

    `workers`: how many (`node_workers`); by default env.workers_per_node, or one where that is
    auto and no plan says more. `nodes`: CPU nodes' (name, EnvironmentNode actor, workers),
    started beside this node's workers; the episodes then spread over them all (nodes.py)."""
    from runtime.environments.host import EnvironmentProblem, Spec
    from runtime.environments.sandbox import SandboxUnavailable

    spec = Spec.from_section(env)
    if in_process:
        from runtime.environments.local import LocalEnvironments

        try:
            return LocalEnvironments(
                spec, call_timeout_s=env.call_timeout_s, episode_timeout_s=env.episode_timeout_s
            )
        except (EnvironmentProblem, SandboxUnavailable) as e:
            raise UserError(f"env.name {env.name}: {e}") from None
    from runtime.environments.workers import Workers

    hosting = Workers(
        spec,
        workers or (1 if env.workers_per_node == "auto" else env.workers_per_node),
        call_timeout_s=env.call_timeout_s,
        episode_timeout_s=env.episode_timeout_s,
    )
    try:
        await hosting.start()
    except BaseException:  # it cannot start, or the run stopped meanwhile: no worker stays
        await hosting.shutdown()
        raise
    if nodes:
        try:
            return await onto_nodes(hosting, env, nodes)
        except BaseException:
            await hosting.shutdown()
            raise
    return hosting


async def onto_nodes(local: Any, env: Any, nodes: Sequence[tuple[str, Any, int]]) -> Any:
    """`local` (this node's workers, started) and the CPU nodes' workers, started now, as one
    hosting the episodes spread over (nodes.py `Spread`). `nodes`: (name, EnvironmentNode
    actor, workers) of each CPU node."""
    from runtime.environments.nodes import RemoteNode, Spread

    remote = [RemoteNode(name, actor, n, env.call_timeout_s) for name, actor, n in nodes]
    try:
        await asyncio.gather(*(r.start(env) for r in remote))
    except BaseException:
        await asyncio.gather(*(r.shutdown() for r in remote))
        raise
    where = ", ".join(f"{r.workers} on {r.name}" for r in remote)
    print(f"environment workers: {len(local.workers)} on node 0, {where}", flush=True)
    return Spread(local, len(local.workers), remote)
