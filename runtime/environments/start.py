"""The run's environments from its recipe's `env` section: worker processes on the node (the
default), or in this process for CPU tests and tiny runs."""

from __future__ import annotations

import os
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
) -> Any:
    """Hosting for `env` (recipes/environment.py), started: every worker ready, or the first
    environment built and its tools listed. An environment that cannot be hosted is one line:
    UserError in-process, EnvironmentsLost from the workers (each failed to start).

    `workers`: how many (`node_workers`); by default env.workers_per_node, or one where that is
    auto and no plan says more. The CPU nodes' workers join these through nodes.py
    `onto_nodes`."""
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
    return hosting
