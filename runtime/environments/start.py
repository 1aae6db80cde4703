"""The run's environments from its recipe's `env` section: worker processes on the node (the
default), or in this process for CPU tests and tiny runs."""

from __future__ import annotations

from typing import Any

from recipes.errors import UserError
from runtime.environments.hosted import Hosted


async def start_environments(
    env: Any, *, in_process: bool = False, workers: int | None = None
) -> Hosted:
    """Hosting for `env` (recipes/environment.py), started: every worker ready, or the first
    environment built and its tools listed. An environment that cannot be hosted is one line:
    UserError in-process, EnvironmentsLost from the workers (each failed to start)."""
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
        workers or env.workers_per_node,
        call_timeout_s=env.call_timeout_s,
        episode_timeout_s=env.episode_timeout_s,
    )
    try:
        await hosting.start()
    except BaseException:  # it cannot start, or the run stopped meanwhile: no worker stays
        await hosting.shutdown()
        raise
    return hosting
