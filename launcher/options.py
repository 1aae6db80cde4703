"""From a recipe and the `render`/`launch` options to a `Job`: everything the task builder needs.

Every check a user can fail happens here, before SkyPilot is imported and long before anything
is provisioned: the recipe and its overrides, the GPU count (the planner), the bucket URL, the
recovery settings, and at launch time the secrets in the environment.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launcher.files import BucketFile, LocalFile, bucket_files, local_files
from launcher.names import RECOVERY_STRATEGIES, WANDB_MODES
from recipes import (
    Plan,
    Recipe,
    UserError,
    apply_overrides,
    launch_gpus,
    load_recipe,
    minimum_gpus,
    plan,
)
from recipes.buckets import bucket_problem, bucket_source
from recipes.memory import disk_errors
from recipes.names import WORKER_PORT, WORKER_PORT_ENV
from recipes.planner import unsold_note
from recipes.prices import price_book
from recipes.run_cost import check_idle
from recipes.sft_rows import check_local_data

PROJECT_DIR = Path(__file__).resolve().parent.parent
CHECKPOINT_MOUNT = "/checkpoints"
# Recipe files from outside the catalog reach the nodes through a file mount here.
RECIPE_MOUNT_DIR = "/forgesky/recipes"
# A recipe's own code (a loss or reward named module:function) reaches the nodes here, which
# the task puts on PYTHONPATH.
CODE_MOUNT_DIR = "/forgesky/code"
SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
# WORKER_PORT (recipes.names, shared with the runtime): the port every node of a multi-node run
# listens on; node 0's controller takes the others' Monarch workers from there. SkyPilot's own
# rules already allow any traffic between the nodes of a cluster (AWS: the security group admits itself; GCP: the VPC admits its internal
# range; Kubernetes: pods reach pods), and Monarch's procs also listen on ephemeral ports, so the
# task opens nothing: `resources.ports` would open the port to the internet, for a service that
# runs whatever code reaches it.
# SkyPilot's cluster-name rule (sky.utils.common_utils.check_cluster_name_is_valid).
_CLUSTER_NAME = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")


@dataclass(frozen=True)
class LaunchOptions:
    """What `forgesky render/launch` were asked for; None means the default."""

    gpus: int | None = None
    gpus_per_node: int | None = None
    managed: bool = False
    spot: bool = False
    infra: str | None = None
    checkpoint_bucket: str | None = None
    recovery: str | None = None
    max_restarts_on_errors: int | None = None
    overrides: tuple[str, ...] = ()
    allow_idle: bool = False  # a --gpus that leaves GPUs without work (refused otherwise)
    name: str | None = None
    steps: int | None = None
    wandb: str | None = None


@dataclass(frozen=True)
class Job:
    """A recipe resolved for one launch: the plan, the names and the knobs on the node."""

    recipe: Recipe
    plan: Plan
    options: LaunchOptions
    name: str
    min_gpus: int
    # What `python -m runtime --recipe` gets on the node, and the file mount that puts it there
    # (remote path, local path) when it is a file rather than a catalog name.
    recipe_ref: str
    recipe_mount: tuple[str, str] | None
    # (remote, local) of every top-level package or module of the user's that the recipe names
    code_mounts: tuple[tuple[str, str], ...]
    # the local data, model and tokenizer files and folders the run reads (launcher.files)
    local_files: tuple[LocalFile, ...]
    # the model and tokenizer folders in a bucket it reads, copied to every node
    bucket_files: tuple[BucketFile, ...]
    # Overrides the node re-applies with --set (model.hf_id travels as $MODEL instead), then
    # each local file's and bucket folder's node path.
    node_overrides: tuple[str, ...]
    envs: dict[str, str] = field(default_factory=dict)

    @property
    def run_dir(self) -> str:
        """Where the runtime keeps metrics and checkpoints on the node."""
        if self.options.checkpoint_bucket:
            return f"{CHECKPOINT_MOUNT}/{self.name}"
        return f"runs/{self.name}"

    @property
    def model_url(self) -> str | None:
        """Where the model folder a finished run writes (RUN_DIR/model) lands in the bucket;
        None without one (then it is on node 0, and goes with the cluster)."""
        if not self.options.checkpoint_bucket:
            return None
        return f"{bucket_source(self.options.checkpoint_bucket)}/{self.name}/model"

    @property
    def recovery_strategy(self) -> str:
        """SkyPilot's name of the managed-job recovery strategy."""
        return (self.options.recovery or RECOVERY_STRATEGIES[0]).upper()

    @property
    def required_secrets(self) -> tuple[str, ...]:
        """Secrets without which the run cannot start."""
        needed = []
        if self.recipe.model.gated:
            needed.append("HF_TOKEN")
        if self.envs["WANDB_MODE"] == "online":
            needed.append("WANDB_API_KEY")
        return tuple(needed)


def is_recipe_file(source: str) -> bool:
    """True when NAME on the command line is a file path rather than a catalog name."""
    return "/" in source or source.endswith((".yaml", ".yml")) or Path(source).is_file()


def resolve_recipe(source: str, overrides: tuple[str, ...] = ()) -> Recipe:
    """The recipe `source` names (catalog name or file), with `--set` overrides applied."""
    recipe = load_recipe(source)
    return apply_overrides(recipe, list(overrides)) if overrides else recipe


def check_references(recipe: Recipe, source: str) -> dict[str, Path]:
    """The recipe's own code (module:function losses and rewards), checked without importing
    it; the top-level package or module each lives in, by name."""
    from recipes.references import check, references, search_path

    refs = references(recipe)
    return check(refs, search_path(source if is_recipe_file(source) else None)) if refs else {}


def resolve_job(source: str, options: LaunchOptions) -> Job:
    """Check every option against the recipe and plan the run; raises UserError."""
    overrides = list(options.overrides)
    if options.gpus_per_node is not None:
        if options.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node must be at least 1 (got {options.gpus_per_node})")
        # Through the recipe, so the node (which plans from the recipe) agrees.
        overrides.append(f"resources.gpus_per_node={options.gpus_per_node}")
    recipe = resolve_recipe(source, tuple(overrides))
    if options.steps is not None:
        if options.steps < 1:
            raise UserError(f"--steps must be at least 1 (got {options.steps})")
        # what the nodes run (MAX_STEPS below): the time, price and disk said here count it
        recipe = apply_overrides(recipe, [f"{recipe.kind}.steps={options.steps}"])
    need = minimum_gpus(recipe)
    # By default a count clouds sell; the planner refuses counts below the minimum (0 included)
    # with the per-service breakdown.
    gpus = launch_gpus(recipe) if options.gpus is None else options.gpus
    run_plan = plan(recipe, gpus)
    if options.gpus is not None and not options.allow_idle:
        check_idle(recipe, run_plan, gpus)
    check_local_data(recipe)  # an SFT recipe's local data, read without a tokenizer
    _check_managed_options(options)
    if run_plan.env_nodes and not options.managed:
        n = run_plan.env_nodes
        raise UserError(
            f"{recipe.name}: its environment workers take {n} CPU node{'' if n == 1 else 's'} "
            "beside the GPU nodes, which SkyPilot starts together only as a managed job group: "
            "add --managed (or set env.cpu_nodes=0)"
        )
    if options.checkpoint_bucket is not None:
        check_bucket_url(options.checkpoint_bucket)
    else:
        # plan() took the least a node fills (with a bucket); without one, every checkpoint kept
        for line in disk_errors(recipe, bucket=False):
            raise UserError(line)
    if options.wandb is not None and options.wandb not in WANDB_MODES:
        raise UserError(f"--wandb must be one of {', '.join(WANDB_MODES)} (got {options.wandb!r})")
    name = options.name or default_name(recipe.name, recipe.kind)
    if not _CLUSTER_NAME.fullmatch(name):
        raise UserError(
            f"--name {name!r} is not a valid cluster/job name: start with a letter, then "
            "letters, digits, '-', '_' or '.', ending with a letter or digit"
        )
    if is_recipe_file(source):
        remote = f"{RECIPE_MOUNT_DIR}/{Path(source).name}"
        recipe_ref, mount = remote, (remote, str(Path(source).resolve()))
    else:
        recipe_ref, mount = recipe.name, None
    code = check_references(recipe, source)
    code_mounts = tuple(
        (f"{CODE_MOUNT_DIR}/{local.name}", str(local)) for _, local in sorted(code.items())
    )
    files, buckets = local_files(recipe), bucket_files(recipe)
    # The node reads each local file and bucket folder where it is mounted: the recipe's own
    # value is replaced.
    node_paths = {f.field: f.remote for f in (*files, *buckets)}
    envs = {
        # Knobs of the task, like SkyPilot's torchforge example: change them with
        # `sky launch --env KEY=VALUE` without re-rendering.
        "MODEL": node_paths.pop("model.hf_id", recipe.model.hf_id),
        "MIN_GPUS": str(need),
        "MAX_STEPS": "" if options.steps is None else str(options.steps),
        "WANDB_MODE": options.wandb or "disabled",
    }
    if run_plan.num_nodes + run_plan.env_nodes > 1:
        envs[WORKER_PORT_ENV] = str(WORKER_PORT)
    replaced = {"model.hf_id", *node_paths}
    node_overrides = (
        tuple(o for o in overrides if o.partition("=")[0].strip() not in replaced)
        + tuple(f"{setting}={remote}" for setting, remote in node_paths.items())
        + price_overrides(recipe, run_plan, options.spot, options.infra)
    )
    say_if_unsold(run_plan, gpus, options.infra)  # every check passed: a note, not an error
    return Job(
        recipe=recipe,
        plan=run_plan,
        options=options,
        name=name,
        min_gpus=need,
        recipe_ref=recipe_ref,
        recipe_mount=mount,
        code_mounts=code_mounts,
        local_files=files,
        bucket_files=buckets,
        node_overrides=node_overrides,
        envs=envs,
    )


def price_overrides(
    recipe: Recipe, run_plan: Plan, spot: bool, infra: str | None = None
) -> tuple[str, ...]:
    """The plan's node price (on the cloud --infra names, else the cheapest) as the recipe
    settings the run counts its dollars by (resources.usd_per_node_hour,
    resources.price_source), unless the recipe sets a price."""
    if run_plan.cpu or recipe.resources.usd_per_node_hour is not None:
        return ()
    book = price_book()
    offer = book.cheapest(run_plan.accelerator, run_plan.gpus_per_node, spot, book.cloud_of(infra))
    price = offer.price(spot) if offer else None
    if offer is None or price is None:
        return ()
    kind = "spot" if spot else "on demand"
    return (
        f"resources.usd_per_node_hour={price}",
        f"resources.price_source={offer.where(spot).replace(',', '')} {kind} ({book.date})",
    )


def say_if_unsold(run_plan: Plan, gpus: int, infra: str | None = None) -> None:
    """On stderr, where a GPU count a node is one VM clouds do not sell (a Kubernetes cluster,
    which --infra k8s names, grants any count)."""
    on_k8s = (infra or "").split("/")[0].lower() in ("k8s", "kubernetes")
    note = None if run_plan.cpu or on_k8s else unsold_note(gpus, run_plan.gpus_per_node)
    if note:
        print(f"forgesky: {note}", file=sys.stderr)


def default_name(recipe_name: str, kind: str = "grpo") -> str:
    """The cluster (or managed job) name for a recipe: <kind>-<recipe> (grpo or sft), cleaned to
    SkyPilot's rule."""
    cleaned = re.sub(r"[^-_.a-zA-Z0-9]+", "-", recipe_name).strip("-_.")
    return f"{kind}-{cleaned}" if cleaned else kind


def secret_values(job: Job, environ: Mapping[str, str] | None) -> dict[str, str | None]:
    """The `secrets:` of the task.

    With environ None (render, sky/ files) no value is read: a secret the run needs is None (a
    SkyPilot reference: `sky launch` refuses to start until `--secret NAME` gives it) and an
    optional one is "" (an empty placeholder `--secret NAME` can fill). With an environment
    (launch) values come from it; a missing required one is a UserError.
    """
    required = job.required_secrets
    if environ is None:
        return {key: (None if key in required else "") for key in SECRETS}
    values: dict[str, str | None] = {}
    for key in SECRETS:
        value = environ.get(key, "")
        if not value and key in required:
            raise UserError(_missing_secret_message(job, key))
        values[key] = value
    return values


def check_bucket_url(url: str) -> None:
    """Raise UserError unless `url` names a bucket SkyPilot can mount (s3://bucket/path, ...)."""
    problem = bucket_problem(url)
    if problem:
        raise UserError(f"--checkpoint-bucket {url!r}: {problem}")


def _check_managed_options(options: LaunchOptions) -> None:
    if options.recovery is not None:
        if options.recovery.lower() not in RECOVERY_STRATEGIES:
            raise UserError(
                f"--recovery must be one of {', '.join(RECOVERY_STRATEGIES)} "
                f"(got {options.recovery!r})"
            )
        if not options.managed:
            raise UserError("--recovery applies to managed jobs: add --managed")
    if options.max_restarts_on_errors is not None:
        if options.max_restarts_on_errors < 0:
            raise UserError(
                f"--max-restarts-on-errors must be 0 or more (got {options.max_restarts_on_errors})"
            )
        if not options.managed:
            raise UserError("--max-restarts-on-errors applies to managed jobs: add --managed")


def _missing_secret_message(job: Job, key: str) -> str:
    if key == "HF_TOKEN":
        return (
            f"{job.recipe.model.hf_id} is gated on the Hugging Face Hub and HF_TOKEN is not set; "
            "export HF_TOKEN=<token with access to it> and launch again"
        )
    return "--wandb online needs WANDB_API_KEY in the environment; export it or use --wandb offline"
