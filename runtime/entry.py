"""Command-line entry of the runtime: `python -m runtime` on nodes, `forgesky local` on a laptop."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from recipes import UserError


def build_parser(prog: str = "python -m runtime") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run GRPO post-training for a recipe on this machine (GPUs if present, else CPU).",
    )
    p.add_argument("--recipe", required=True, help="catalog name (forgesky recipes) or a YAML path")
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
    return p


def _default_gpus(recipe) -> int:
    if recipe.resources.accelerator == "cpu":
        return 0
    per_node = os.environ.get("SKYPILOT_NUM_GPUS_PER_NODE")
    nodes = os.environ.get("SKYPILOT_NUM_NODES", "1")
    if per_node:
        return int(per_node) * int(nodes)
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA means no GPUs
        return 0


def parse_config(argv: list[str] | None, prog: str = "python -m runtime"):
    """Parse arguments into a RunConfig: recipe (with overrides) and its plan."""
    from recipes import apply_overrides, load_recipe, plan
    from runtime.config import RunConfig

    args = build_parser(prog).parse_args(argv)
    recipe = load_recipe(args.recipe)
    overrides = list(args.overrides)
    if args.steps is not None:
        if args.steps < 1:
            raise UserError(f"--steps must be at least 1 (got {args.steps})")
        overrides.append(f"grpo.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"grpo.seed={args.seed}")
    if args.checkpoint_every is not None:
        if args.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every must be >= 0 (got {args.checkpoint_every})")
        overrides.append(f"grpo.checkpoint_interval={args.checkpoint_every}")
    if overrides:
        recipe = apply_overrides(recipe, overrides)
    gpus = args.gpus if args.gpus is not None else _default_gpus(recipe)
    run_plan = plan(recipe, gpus)
    run_dir = Path(args.run_dir or Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    wandb_mode = args.wandb or os.environ.get("WANDB_MODE") or "disabled"
    if wandb_mode not in ("online", "offline", "disabled"):
        raise UserError(f"WANDB_MODE must be online, offline or disabled (got {wandb_mode!r})")
    return RunConfig(recipe=recipe, plan=run_plan, run_dir=run_dir, wandb_mode=wandb_mode)


def main(argv: list[str] | None = None, prog: str = "python -m runtime") -> int:
    """Run the controller; user errors end as one line and exit code 2."""
    try:
        config = parse_config(argv, prog)
    except UserError as e:
        print(f"{prog.split()[0]}: error: {e}", file=sys.stderr)
        return 2
    from runtime.run import run

    return run(config)
