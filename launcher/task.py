"""A resolved `Job` as SkyPilot's own objects: `sky.Task`, `sky.Resources`, `sky.Storage`.

Imported only by the commands that talk to SkyPilot (render, launch): importing SkyPilot takes
seconds, and the catalog commands must stay fast.
"""

from __future__ import annotations

from collections.abc import Mapping

import sky
from launcher.options import CHECKPOINT_MOUNT, CODE_MOUNT_DIR, Job
from launcher.scripts import ENV_TASK, STOPPED_EXIT_CODE, TRAIN_TASK, run_script, setup_script
from launcher.source import ProjectSource
from recipes import UserError
from recipes.names import CPU_NODE_VCPUS

# vCPUs for CPU recipes: the runtime starts one process per service (see recipes.plan).
CPU_NODE_CPUS = f"{CPU_NODE_VCPUS}+"


def disk_gb(job: Job) -> int:
    """The node disk: the recipe's, or what the run writes (recipes.memory.disk_plan)."""
    given = job.recipe.resources.disk_gb
    if given != "auto":
        return given
    from recipes.memory import disk_plan

    return int(disk_plan(job.recipe, bucket=job.options.checkpoint_bucket is not None)["total"])


def build_resources(job: Job, cpus: str | None = None) -> list[sky.Resources]:
    """One `sky.Resources` per accelerator the recipe accepts, in preference order.

    A list is SkyPilot's `ordered:` set: the optimizer tries the recipe's accelerator first and
    falls back to its alternatives (H200 for H100 recipes) when that is unavailable. `cpus`: a
    CPU node of that many vCPUs instead (the environment workers' nodes).
    """
    recipe, options = job.recipe, job.options
    common: dict = {
        "infra": options.infra,
        "disk_size": disk_gb(job),
        "use_spot": True if options.spot else None,
    }
    if options.managed:
        recovery: dict[str, str | int | list[int]] = {"strategy": job.recovery_strategy}
        if options.max_restarts_on_errors is not None:
            recovery["max_restarts_on_errors"] = options.max_restarts_on_errors
        # A run stopped by SIGTERM on a node that stays up (see run_script) always resumes.
        recovery["recover_on_exit_codes"] = [STOPPED_EXIT_CODE]
        common["job_recovery"] = recovery
    try:
        if cpus is not None:
            return [sky.Resources(cpus=cpus, **common)]
        if job.plan.cpu:
            return [sky.Resources(cpus=CPU_NODE_CPUS, **common)]
        # node 0's host memory (recipes.memory.host_plan): the checkpoint's staging copy first
        common["memory"] = f"{job.plan.host['total']:.0f}+"
        per_node = job.plan.gpus_per_node
        accelerators = [recipe.resources.accelerator, *recipe.resources.alternatives]
        unique = list(dict.fromkeys(accelerators))
        return [sky.Resources(accelerators={acc: per_node}, **common) for acc in unique]
    except ValueError as e:
        # SkyPilot parses --infra here ("Cloud 'x' is not a valid cloud among [...]").
        first = (str(e).strip().splitlines() or ["not valid"])[0]
        raise UserError(f"--infra {options.infra!r}: {first}") from None


def build_task(
    job: Job, secrets: Mapping[str, str | None], source: ProjectSource
) -> sky.Task | sky.Dag:
    """The SkyPilot task for `job`; where its plan puts environment workers on CPU nodes, a
    managed job group (`build_job_group`).

    secrets: from `launcher.options.secret_values` (None marks a reference SkyPilot must be
    given at launch). source: how forgesky itself reaches the nodes (launcher.source): a
    checkout is the workdir, synced to every node; a wheel is file-mounted; a release is
    installed from the index.
    """
    if job.plan.env_nodes:
        return build_job_group(job, secrets, source)
    return _task(job, secrets, source, job.name)


def group_name(name: str) -> str:
    """A job group's name: part of a host name on its nodes (`train-0.<name>`), so no dots."""
    return name.replace(".", "-")


def build_job_group(job: Job, secrets: Mapping[str, str | None], source: ProjectSource) -> sky.Dag:
    """Two tasks SkyPilot starts together as one managed job (a job group, `execution:
    parallel`): `train`, the run's GPU nodes, and `envs`, its CPU nodes of
    env.cpu_node_vcpus+ vCPUs for the environment workers. The job ends when `train` does
    (its primary task). Both run `python -m runtime` over one cluster of all the nodes, the GPU
    nodes first: each task's script finds the other's nodes by the names SkyPilot gives them
    (launcher/scripts.py `joined_nodes`)."""
    environment = job.plan.environment
    assert environment is not None and environment.cpu_nodes
    # (launcher/options.py resolve_job refuses it without --managed)
    nodes = (job.plan.num_nodes, environment.cpu_nodes)
    train = _task(job, secrets, source, TRAIN_TASK, env_nodes=nodes)
    envs = _task(job, secrets, source, ENV_TASK, env_nodes=nodes, cpu_node=True)
    dag = sky.Dag()
    dag.name = group_name(job.name)
    dag.add(train)
    dag.add(envs)
    dag.set_execution(sky.dag.DagExecution.PARALLEL)
    dag.primary_tasks = [TRAIN_TASK]
    return dag


def _task(
    job: Job,
    secrets: Mapping[str, str | None],
    source: ProjectSource,
    name: str,
    *,
    env_nodes: tuple[int, int] | None = None,
    cpu_node: bool = False,
) -> sky.Task:
    environment = job.plan.environment
    task = sky.Task(
        name=name,
        setup=setup_script(source.requirement),
        run=run_script(
            recipe_name=job.recipe.name,
            recipe_ref=job.recipe_ref,
            gated=job.recipe.model.gated,
            run_dir=job.run_dir,
            overrides=job.node_overrides,
            code_path=CODE_MOUNT_DIR if job.code_mounts else None,
            env_nodes=env_nodes,
            cpu_node_gpus=job.plan.total_gpus if cpu_node else None,
        ),
        workdir=source.workdir,
        num_nodes=environment.cpu_nodes if cpu_node and environment else job.plan.num_nodes,
        envs=dict(job.envs),
        secrets=dict(secrets),
    )
    mounts = {**source.mounts, **dict(job.code_mounts)}
    # a bucket folder as a plain file mount is SkyPilot's COPY: downloaded to the node's disk
    mounts |= {f.remote: f.source for f in (*job.local_files, *job.bucket_files)}
    if job.recipe_mount is not None:
        remote, local = job.recipe_mount
        mounts[remote] = local
    if mounts:
        task.set_file_mounts(mounts)
    if job.options.checkpoint_bucket:
        # MOUNT_CACHED: checkpoints are written to local disk and uploaded in the background,
        # so a save does not wait on the bucket; SkyPilot flushes the cache before teardown.
        storage = sky.Storage(
            source=job.options.checkpoint_bucket, mode=sky.StorageMode.MOUNT_CACHED
        )
        task.set_storage_mounts({CHECKPOINT_MOUNT: storage})
    # After the storage mounts: SkyPilot marks resources that need FUSE when they are set.
    if cpu_node and environment is not None:
        task.set_resources(build_resources(job, cpus=f"{environment.cpu_node_vcpus}+"))
    else:
        task.set_resources(build_resources(job))
    return task
