"""Command-line entry of the runtime: `python -m runtime` on nodes, `forgesky local` on a laptop."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from recipes import UserError
from recipes.errors import OneLineParser
from runtime.procs.cluster import DEFAULT_WORKER_PORT, check_plan_fits, cluster_from_env
from runtime.procs.mps import control_binary, reap_left_daemons, uses_mps

# SkyPilot starts `run` on all nodes at once, after setup finished on every node; this covers
# imports on a slow node, not provisioning.
DEFAULT_JOIN_TIMEOUT_S = 300.0


def build_parser(prog: str = "python -m runtime", named: bool = False) -> argparse.ArgumentParser:
    """`named`: the caller takes the recipe as NAME and passes it as --recipe (`forgesky
    local NAME ...`): the usage names NAME instead."""
    p = OneLineParser(
        prog=prog,
        usage=f"{prog} NAME [options]" if named else None,
        description="Run GRPO or SFT post-training for a recipe on this machine (GPUs if present, else CPU).",
    )
    p.add_argument(
        "--recipe",
        required=True,
        help=argparse.SUPPRESS if named else "catalog name (forgesky recipes) or a YAML path",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs the plan may use (default: SkyPilot's GPUs x nodes, else those visible, "
        "0 for CPU recipes)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="where metrics, curves and checkpoints go; a run dir holding a committed "
        "checkpoint is resumed (default: runs/<recipe>-<time>)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set grpo.learning_rate=3e-3 (repeatable)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="checkpoint every N steps (default: the recipe's grpo.checkpoint_interval)",
    )
    p.add_argument(
        "--wandb",
        choices=["online", "offline", "disabled"],
        default=None,
        help="W&B mode (default: $WANDB_MODE, else disabled)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed (default: the recipe's grpo.seed)")
    nodes = p.add_argument_group(
        "nodes",
        "On a SkyPilot cluster every node runs this same command: node 0 (SKYPILOT_NODE_RANK) "
        "runs the controller, the others serve it their Monarch worker (SKYPILOT_NODE_IPS "
        "lists them all).",
    )
    nodes.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="machines a CPU recipe spreads its services over (default: the nodes in "
        "SKYPILOT_NODE_IPS, else 1); a GPU recipe's nodes follow from --gpus",
    )
    nodes.add_argument(
        "--worker-port",
        type=int,
        default=None,
        help=f"the port every node listens on (default: $FORGESKY_WORKER_PORT, else "
        f"{DEFAULT_WORKER_PORT})",
    )
    nodes.add_argument(
        "--join-timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT_S,
        metavar="SECONDS",
        help="how long the controller waits for every node to join, and a worker for the "
        f"controller (default: {DEFAULT_JOIN_TIMEOUT_S:g})",
    )
    return p


def _default_gpus(recipe) -> int:
    if recipe.resources.accelerator == "cpu":
        return 0
    per_node = os.environ.get("SKYPILOT_NUM_GPUS_PER_NODE")
    nodes = os.environ.get("SKYPILOT_NUM_NODES", "1")
    if per_node:
        return int(per_node) * int(nodes)
    if not _nvidia_driver():
        raise UserError(
            f"{recipe.name} runs on GPUs and this machine has none (no NVIDIA driver); run it "
            "where there are, or `forgesky local tiny` on a CPU"
        )
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA means no GPUs
        return 0


def _nvidia_driver() -> bool:
    """Whether an NVIDIA driver is here (its /proc entry or nvidia-smi): without one there is no
    GPU to count, and torch need not load to say so."""
    return Path("/proc/driver/nvidia/gpus").exists() or shutil.which("nvidia-smi") is not None


def _accelerator(recipe) -> str | None:
    """The GPU type to plan the services' settings for: this node's, when the recipe accepts it
    (an H200 where the recipe asks for H100 and accepts H200), else the recipe's."""
    if recipe.cpu:
        return None
    from runtime.procs.host import gpu_type

    found = gpu_type()
    accepted = [recipe.resources.accelerator, *recipe.resources.alternatives]
    return found if found in accepted else None


def _make_user_code_importable(recipe, source: str) -> None:
    """Check the recipe's own code (a loss or reward named module:function) and let every proc
    import it: the folders it lives in go first on the PYTHONPATH the procs inherit."""
    from recipes.references import check, references, search_path

    refs = references(recipe)
    if not refs:
        return
    roots = check(refs, search_path(source))
    folders = [str(path.parent) for path in roots.values()]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*folders, *current]))
    sys.path[:0] = [f for f in folders if f not in sys.path]


def _check_model_folder(recipe) -> None:
    """A local model folder the run starts from is there and holds its weights: checked before
    anything starts. On a node the folder may be a copy of one in a bucket (launcher/files.py),
    empty or missing where the run that writes it had not finished."""
    from recipes.files import looks_local

    folder = Path(recipe.model.hf_id).expanduser()
    if looks_local(recipe.model.hf_id) and not folder.exists():
        raise UserError(
            f"model.hf_id {recipe.model.hf_id!r}: no such folder; name a Hugging Face model "
            "folder, or a Hub model (Qwen/Qwen3-1.7B)"
        )
    if recipe.model.init != "hub" or not folder.is_dir():
        return
    missing = [name for name in ("config.json", "*.safetensors") if not any(folder.glob(name))]
    if missing:
        raise UserError(
            f"model.hf_id {recipe.model.hf_id!r}: no {' or '.join(missing)} in the folder; name a "
            "Hugging Face model folder (a run's RUN_DIR/model once the run has finished; a LoRA "
            "run's adapter as `forgesky export --merge` writes it)"
        )


def parse_config(argv: list[str] | None, prog: str = "python -m runtime", named: bool = False):
    """Parse arguments into a RunConfig: recipe (with overrides) and its plan."""
    from recipes import apply_overrides, load_recipe, plan
    from recipes.files import bucket_reads
    from recipes.sft_rows import check_local_data
    from runtime.control.config import RunConfig

    args = build_parser(prog, named).parse_args(argv)
    recipe = load_recipe(args.recipe)
    overrides = list(args.overrides)
    section = recipe.kind  # grpo or sft: where steps, seed and the checkpoint interval live
    if args.steps is not None:
        if args.steps < 1:
            raise UserError(f"--steps must be at least 1 (got {args.steps})")
        overrides.append(f"{section}.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"{section}.seed={args.seed}")
    if args.checkpoint_every is not None:
        if args.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every must be >= 0 (got {args.checkpoint_every})")
        overrides.append(f"{section}.checkpoint_interval={args.checkpoint_every}")
    if overrides:
        recipe = apply_overrides(recipe, overrides)
    for setting in bucket_reads(recipe):
        # on the nodes the launcher has put a copy in its place (launcher/files.py)
        raise UserError(
            f"{setting.field} {setting.value!r}: a folder in a bucket, which {prog} cannot read "
            "(forgesky launch copies it to the nodes); copy it to this machine (aws s3 sync, "
            "gcloud storage cp -r, ...) and name that folder"
        )
    _check_model_folder(recipe)
    gpus = args.gpus if args.gpus is not None else _default_gpus(recipe)
    cluster = cluster_from_env(port=args.worker_port)
    nodes = args.nodes
    env = getattr(recipe, "env", None)
    if nodes is None and recipe.cpu:
        # the cluster's nodes less the CPU nodes the recipe names for its environments
        extra = env.cpu_nodes if env is not None and env.cpu_nodes != "auto" else 0
        nodes = max(1, cluster.nodes - extra)
    if env is not None and env.cpu_nodes == "auto" and not recipe.cpu:
        # CPU nodes for the environments are those the cluster has beyond the run's own (a
        # job group's envs task, launcher/task.py); on one machine none: node 0's cores serve
        recipe = apply_overrides(recipe, ["env.cpu_nodes=0"])
        own = plan(recipe, gpus, nodes=nodes, accelerator=_accelerator(recipe)).num_nodes
        if cluster.nodes > own:
            recipe = apply_overrides(recipe, [f"env.cpu_nodes={cluster.nodes - own}"])
    run_plan = plan(recipe, gpus, nodes=nodes, accelerator=_accelerator(recipe))
    check_local_data(recipe)  # an SFT recipe's local data, before anything starts
    if args.join_timeout <= 0:
        raise UserError(f"--join-timeout must be positive (got {args.join_timeout:g})")
    run_dir = Path(args.run_dir or Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    wandb_mode = args.wandb or os.environ.get("WANDB_MODE") or "disabled"
    if wandb_mode not in ("online", "offline", "disabled"):
        raise UserError(f"WANDB_MODE must be online, offline or disabled (got {wandb_mode!r})")
    _make_user_code_importable(recipe, args.recipe)
    return RunConfig(
        recipe=recipe,
        plan=run_plan,
        run_dir=run_dir,
        wandb_mode=wandb_mode,
        cluster=cluster,
        join_timeout=args.join_timeout,
    )


def _run_sft(config: Any, over: bool) -> int:
    """An SFT recipe's run (runtime.sft.run): on GPUs, or on CPU with trainer.ranks above 1,
    the trainer actor's ranks (runtime.sft.ranks); else one process, the CPU trainer."""
    if over:
        return 0
    from runtime.sft.ranks import on_ranks
    from runtime.sft.run import prepare, run

    ranks = on_ranks(config.recipe, config.plan)
    try:
        if ranks and config.cluster.multi_node:
            raise UserError(f"{config.recipe.name}: an SFT run is one node's")
        # what needs the tokenizer, checked before anything starts
        data = prepare(config.recipe)
    except UserError as e:
        print(f"forgesky: error: {e}", file=sys.stderr)
        return 2
    if ranks:
        from runtime.sft.ranks import run_on_ranks

        return run_on_ranks(
            config.recipe, config.run_dir, config.plan, data=data, wandb_mode=config.wandb_mode
        )
    import threading

    from runtime.procs.signals import StopSignals

    stop = threading.Event()

    def on_stop() -> None:
        if not stop.is_set():
            stop.set()
            print(
                "forgesky: stopping: finishing the step in flight (Ctrl-C again to force)",
                file=sys.stderr,
                flush=True,
            )

    def on_force() -> None:
        print("forgesky: forced exit", file=sys.stderr, flush=True)
        os._exit(130)

    signals = StopSignals(on_stop, on_force)
    signals.install()
    try:
        run(
            config.recipe,
            config.run_dir,
            data=data,
            stopping=stop.is_set,
            wandb_mode=config.wandb_mode,
        )
    except UserError as e:
        print(f"forgesky: error: {e}", file=sys.stderr)
        return 2
    finally:
        signals.uninstall()
    return 0


def main(
    argv: list[str] | None = None, prog: str = "python -m runtime", named: bool = False
) -> int:
    """Run the controller, or on a worker node serve it; user errors end as one line and
    exit code 2."""
    from runtime.procs.host import stacks_on_signal

    stacks_on_signal()  # kill -USR1 PID: this process's stacks; before any thread starts
    over = False  # the run dir holds a finished run: nothing to start
    try:
        config = parse_config(argv, prog, named)
        check_plan_fits(config.plan, config.cluster)
        if not config.plan.cpu:
            from runtime.procs.gpu_check import check_gpus_free, read_gpus

            # an MPS daemon a killed run left holds the GPUs through its server
            for line in reap_left_daemons():
                print(f"forgesky: {line}", flush=True)
            check_gpus_free(config.plan, config.cluster.rank, read_gpus())
        if uses_mps(config.plan) and config.cluster.rank == 0:
            control_binary()  # where the node has none: one line, nothing started
        if not (config.cluster.multi_node and config.cluster.rank > 0):
            # the controller's outputs: W&B first, as the run dir is created last
            from runtime.control.metrics import check_wandb_login, check_wandb_reachable
            from runtime.control.run import finished_already, prepare_run_dir

            existing = config.run_dir.is_dir()
            if existing:
                prepare_run_dir(config)  # checks only, for a folder that is there
            # a run at its last step already needs nothing more: no W&B, no service
            over = existing and finished_already(config)
            if not over:
                check_wandb_login(config.wandb_mode)
                check_wandb_reachable(config.wandb_mode)
            if not existing and config.recipe.kind == "grpo":
                prepare_run_dir(config)  # an SFT run makes it once its data is checked
    except UserError as e:
        print(f"forgesky: error: {e}", file=sys.stderr)  # as the run's other lines say
        return 2
    cluster = config.cluster
    if config.recipe.kind == "sft":
        return _run_sft(config, over)
    if over:
        if cluster.multi_node:
            from runtime.procs.nodewatch import release_workers

            release_workers(cluster, 0, join_timeout=config.join_timeout)
        return 0
    if cluster.multi_node and cluster.rank > 0:
        from runtime.procs.worker import run_worker

        return run_worker(cluster, join_timeout=config.join_timeout)
    if cluster.multi_node:
        from runtime.procs.nodes import use_tcp

        use_tcp(cluster)
    from runtime.control.run import run

    return run(config)
