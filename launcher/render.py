"""A task as the YAML file `sky launch` / `sky jobs launch` reads, with a header saying how.

The YAML is SkyPilot's own serialisation (`Task.to_yaml_config`, resources factored with
`Task.get_resource_config`); this module only orders the keys for people and adds the header.
"""

from __future__ import annotations

from typing import Any

import yaml

import sky
from launcher.files import describe
from launcher.names import RENDERED_MARK
from launcher.options import (
    PROJECT_DIR,
    WORKER_PORT_ENV,
    Job,
    secret_values,
)
from launcher.source import ProjectSource, checkout, project_source
from launcher.task import build_task, group_name

# GPUs per VM that clouds sell; other counts need Kubernetes or a cloud that splits nodes.
VM_GPU_COUNTS = (1, 2, 4, 8)
# Keys in the order a reader wants them: what and where first, the long scripts last.
_KEY_ORDER = (
    "name",
    "resources",
    "num_nodes",
    "workdir",
    "file_mounts",
    "envs",
    "secrets",
    "setup",
    "run",
)


class _Dumper(yaml.SafeDumper):
    """Block style, scripts as literal blocks, no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def task_config(task: sky.Task) -> dict[str, Any]:
    """SkyPilot's YAML config of `task`, keys in reading order, empty sections dropped."""
    config = task.to_yaml_config()
    # Factored form: shared fields once, then `ordered:` with just the accelerators.
    # Underscore keys are SkyPilot internals it re-derives when parsing (e.g. _requires_fuse).
    config["resources"] = {
        k: v for k, v in task.get_resource_config().items() if not k.startswith("_")
    }
    ordered = {k: config[k] for k in _KEY_ORDER if config.get(k) not in (None, {}, "")}
    rest = {k: v for k, v in config.items() if k not in _KEY_ORDER and v not in (None, {}, [])}
    return {**ordered, **rest}


def dump_yaml(config: dict[str, Any]) -> str:
    """YAML text of a task config, a blank line between top-level sections."""
    return "\n".join(
        yaml.dump({key: value}, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
        for key, value in config.items()
    )


def header(job: Job, command: str, path: str | None, project: ProjectSource) -> str:
    """The comment block on top of a rendered task: what it is and the exact commands.

    command: the forgesky command line that writes this file; path: the file, as the user will
    type it (None when printed to stdout); project: how forgesky reaches the nodes.
    """
    recipe, plan, options = job.recipe, job.plan, job.options
    file = path or "<file>"
    if plan.cpu:
        hardware = "one CPU node"
    else:
        alternatives = [
            a for a in recipe.resources.alternatives if a != recipe.resources.accelerator
        ]
        alt = f" ({' or '.join(alternatives)} also accepted)" if alternatives else ""
        nodes = f"{plan.num_nodes} nodes x " if plan.num_nodes > 1 else ""
        hardware = f"{nodes}{plan.gpus_per_node} x {recipe.resources.accelerator}{alt}"
    if plan.env_nodes and plan.environment is not None:
        n = plan.env_nodes
        hardware += (
            f" and {n} CPU node{'' if n == 1 else 's'} of {plan.environment.cpu_node_vcpus}+ "
            "vCPUs for the environment workers (a job group: the tasks train and envs)"
        )
    secret_flags = "".join(f" --secret {key}" for key in job.required_secrets)
    lines = [
        f"forgesky recipe {recipe.name}: {recipe.description}",
        f"{recipe.model.hf_id} on {hardware}; the recipe needs at least {job.min_gpus} "
        f"GPU{'s' if job.min_gpus != 1 else ''}"
        + (
            f" ({plan.dedicated_gpus} with every service on GPUs of its own)."
            if job.min_gpus < plan.dedicated_gpus
            else "."
        ),
        f"{RENDERED_MARK}`{command}`: edit the recipe, not this file.",
    ]
    if job.local_files:
        lines += [
            "Local files reach every node as file_mounts (a managed job's through SkyPilot's "
            "jobs bucket);",
            "the run reads them at their node paths:",
            *(f"  {line}" for line in describe(job.local_files, sizes=False)),
        ]
    if job.bucket_files:
        lines += [
            "Folders in a bucket are copied to every node as file_mounts (SkyPilot's COPY, by the "
            "store's own tool);",
            "the run reads them at their node paths:",
            *(f"  {line}" for line in describe(job.bucket_files)),
        ]
    lines += [
        "",
        "Run from the repository root (workdir: . is synced to every node):"
        if project.kind == "checkout"
        else f"Run from any folder; forgesky reaches the nodes as {project.summary}:",
    ]
    if options.managed:
        # a job group (CPU nodes for the environments): its name without dots
        name = group_name(job.name) if plan.env_nodes else job.name
        lines += [
            f"  sky jobs launch -n {name} {file}{secret_flags}",
            f"  sky jobs logs -n {name}",
            f"  sky jobs cancel -n {name}",
        ]
    else:
        lines += [
            f"  sky launch -c {job.name} {file}{secret_flags}",
            f"  sky logs {job.name}",
            f"  sky down {job.name}",
        ]
    hf = "" if "HF_TOKEN" in job.required_secrets else ", --secret HF_TOKEN (a Hub token)"
    lines += [
        "Knobs: --env MAX_STEPS=20 (a short run), --env WANDB_MODE=online --secret WANDB_API_KEY",
        f"(secrets are read from your environment){hf}.",
        "GPU counts cannot be templated in SkyPilot YAML: for another count render another file,",
        f"  forgesky render {recipe.name if job.recipe_mount is None else job.recipe_mount[1]}"
        f" --gpus N{' --managed --spot' if options.managed else ''}"
        f"{f' --checkpoint-bucket {options.checkpoint_bucket}' if options.checkpoint_bucket else ''}"
        " -o task.yaml",
    ]
    if not plan.cpu and plan.gpus_per_node not in VM_GPU_COUNTS:
        vm = min(c for c in VM_GPU_COUNTS if c >= plan.gpus_per_node)
        lines += [
            f"Cloud VMs come with 1, 2, 4 or 8 GPUs; {plan.gpus_per_node} per node suits Kubernetes "
            "and clouds that sell",
            f"any count. Elsewhere use --gpus {vm * plan.num_nodes}: the plan gives the extra GPUs "
            "to generation and training.",
        ]
    if plan.num_nodes > 1:
        lines += [
            f"{plan.num_nodes} nodes, each running the same `run`: node 0 runs the controller, "
            "which waits for the",
            f"others and attaches to their Monarch workers on port ${WORKER_PORT_ENV}.",
            "Traffic between the nodes stays inside the cluster (SkyPilot allows it); nothing is "
            "opened",
            "to the internet. A lost node stops the run (exit 1) within a minute, naming it, so "
            "that a",
            "managed job's recovery can take over.",
        ]
    if options.managed and not options.checkpoint_bucket:
        lines += [
            "Checkpoints stay on the node here: after a preemption the job starts again from step 0.",
            "To resume instead, keep them in a bucket (mounted at /checkpoints):",
            f"  forgesky render {recipe.name} --managed --spot --checkpoint-bucket s3://<bucket>/forgesky",
        ]
    return "\n".join(f"# {line}".rstrip() for line in lines)


def render(
    job: Job,
    task: sky.Task | sky.Dag,
    command: str,
    project: ProjectSource,
    path: str | None = None,
) -> str:
    """The whole file: the header and SkyPilot's YAML of `task`; of a job group (launcher/task.py
    `build_job_group`), SkyPilot's documents one after another, its own header first."""
    head = header(job, command, path, project)
    if isinstance(task, sky.Task):
        return f"{head}\n\n{dump_yaml(task_config(task))}"
    group: dict[str, Any] = {
        "name": task.name,
        "execution": task.execution.value,
        "primary_tasks": list(task.primary_tasks or ()),
    }
    docs = [dump_yaml(group), *(dump_yaml(task_config(t)) for t in task.tasks)]
    return f"{head}\n\n" + "\n---\n\n".join(docs)


def render_job(job: Job, command: str, path: str | None = None) -> str:
    """`forgesky render`: the file for a resolved job (`resolve_job`), secrets as placeholders
    only.

    From a checkout the file names the workdir relatively (`.`): it is run from the repository
    root, like the files in sky/. An installed forgesky brings its wheel or release instead.
    """
    project = project_source(PROJECT_DIR)
    if project.kind == "checkout":
        project = checkout(".")
    task = build_task(job, secret_values(job, None), project)
    return render(job, task, command, project, path)
