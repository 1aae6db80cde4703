"""A resolved `Job` as SkyPilot's own objects: `sky.Task`, `sky.Resources`, `sky.Storage`.

Imported only by the commands that talk to SkyPilot (render, launch): importing SkyPilot takes
seconds, and the catalog commands must stay fast.
"""

from __future__ import annotations

from collections.abc import Mapping

import sky
from launcher.options import CHECKPOINT_MOUNT, CODE_MOUNT_DIR, Job
from launcher.scripts import STOPPED_EXIT_CODE, run_script, setup_script
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


def build_resources(job: Job) -> list[sky.Resources]:
    """One `sky.Resources` per accelerator the recipe accepts, in preference order.

    A list is SkyPilot's `ordered:` set: the optimizer tries the recipe's accelerator first and
    falls back to its alternatives (H200 for H100 recipes) when that is unavailable.
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


def build_task(job: Job, secrets: Mapping[str, str | None], source: ProjectSource) -> sky.Task:
    """The SkyPilot task for `job`.

    secrets: from `launcher.options.secret_values` (None marks a reference SkyPilot must be
    given at launch). source: how forgesky itself reaches the nodes (launcher.source): a
    checkout is the workdir, synced to every node; a wheel is file-mounted; a release is
    installed from the index.
    """
    task = sky.Task(
        name=job.name,
        setup=setup_script(source.requirement),
        run=run_script(
            recipe_name=job.recipe.name,
            recipe_ref=job.recipe_ref,
            gated=job.recipe.model.gated,
            run_dir=job.run_dir,
            overrides=job.node_overrides,
            code_path=CODE_MOUNT_DIR if job.code_mounts else None,
        ),
        workdir=source.workdir,
        num_nodes=job.plan.num_nodes,
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
    task.set_resources(build_resources(job))
    return task
