"""What several `forgesky` subcommands share: the way a subcommand is added, the plan and launch
options, --set and --managed, the `LaunchOptions` they describe, and the yes/no question asked
before anything is launched or torn down. Imports neither SkyPilot nor torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from launcher.names import RECOVERY_STRATEGIES, WANDB_MODES
from recipes.errors import UserError

Handler = Callable[[argparse.Namespace], int]


def add_command(
    sub: Any, name: str, help_text: str, handler: Handler, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand of `sub` whose description is its help line, run by `handler`."""
    p = sub.add_parser(
        name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".", **kwargs
    )
    p.set_defaults(handler=handler)
    return p


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """--gpus, --gpus-per-node and --set: what a plan depends on."""
    p.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="total GPUs (default: MIN GPUS, a GPU or more for each service, or SHARING where "
        "the recipe has layout.share all; rounded up to a count VM clouds sell: 1, 2, 4 or 8 a "
        "node)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="K",
        help="GPUs per node (default: the recipe's resources.gpus_per_node, 8)",
    )
    p.add_argument(
        "--gpu-type",
        metavar="TYPE",
        help="plan for and ask for this GPU type only: H100, H200, A100-80GB, B200 "
        "(sets resources.accelerator, no alternatives)",
    )
    p.add_argument(
        "--allow-idle",
        action="store_true",
        help="accept a --gpus that leaves GPUs or nodes without work (refused otherwise)",
    )
    add_set(p, "grpo.steps=20")


def add_set(p: argparse.ArgumentParser, example: str) -> None:
    """--set KEY=VALUE (repeatable), shown with `example`."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a recipe field, e.g. --set {example} (repeatable)",
    )


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """The plan options and where and how a run is launched (`render`, `launch`)."""
    add_plan_options(p)
    p.add_argument("--managed", action="store_true", help="a managed job (sky jobs launch)")
    p.add_argument("--spot", action="store_true", help="spot instances")
    p.add_argument("--infra", metavar="X", help="where to run: aws, gcp/us-central1, k8s, ...")
    p.add_argument(
        "--checkpoint-bucket",
        metavar="URL",
        help="bucket for checkpoints (s3://, gs://, r2://, ...), mounted at /checkpoints",
    )
    p.add_argument(
        "--recovery",
        choices=RECOVERY_STRATEGIES,
        help="managed-job recovery after preemption (default: eager_next_region)",
    )
    p.add_argument(
        "--max-restarts-on-errors",
        type=int,
        metavar="K",
        help="managed jobs: restart up to K times when the run itself fails",
    )
    p.add_argument(
        "--name",
        dest="cluster_name",
        metavar="CLUSTER",
        help="cluster or job name (default: grpo-NAME, sft-NAME for an SFT recipe)",
    )
    p.add_argument("--steps", type=int, metavar="N", help="training steps (sets MAX_STEPS)")
    p.add_argument("--wandb", choices=WANDB_MODES, help="W&B mode (sets WANDB_MODE)")


def add_managed(p: argparse.ArgumentParser) -> None:
    """--managed: managed jobs instead of clusters."""
    p.add_argument("--managed", action="store_true", help="managed jobs instead of clusters")


def plan_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The --set overrides, with --gpus-per-node and --gpu-type as the recipe fields they set."""
    overrides = [*args.overrides, *gpu_type_overrides(args)]
    if args.gpus_per_node is not None:
        overrides.append(f"resources.gpus_per_node={args.gpus_per_node}")
    return tuple(overrides)


def gpu_type_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """--gpu-type TYPE as the recipe fields it sets; an unknown TYPE names the close ones."""
    if args.gpu_type is None:
        return ()
    from recipes.gpus import check_gpu_type

    name = check_gpu_type(args.gpu_type)
    return (f"resources.accelerator={name}", "resources.alternatives=[]")


def options_from_args(args: argparse.Namespace) -> Any:
    """The `launcher.options.LaunchOptions` that `render`/`launch` arguments describe."""
    from launcher.options import LaunchOptions

    return LaunchOptions(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        managed=args.managed,
        spot=args.spot,
        infra=args.infra,
        checkpoint_bucket=args.checkpoint_bucket,
        recovery=args.recovery,
        max_restarts_on_errors=args.max_restarts_on_errors,
        overrides=(*args.overrides, *gpu_type_overrides(args)),
        allow_idle=args.allow_idle,
        name=args.cluster_name,
        steps=args.steps,
        wandb=args.wandb,
    )


def confirm(question: str, refusal: str) -> None:
    """Ask `question` on the terminal; UserError (`refusal`) unless the answer is yes, or
    when there is no terminal to ask on (--yes is then the way)."""
    if not sys.stdin.isatty():
        raise UserError(f"{refusal} without confirmation (stdin is not a terminal); pass --yes")
    if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
        raise UserError(f"{refusal}: not confirmed")
