"""`forgesky`: the recipe catalog, plans, and GRPO runs on SkyPilot clusters or this machine.

The catalog commands (recipes, show, plan, validate, cp) import neither SkyPilot nor torch, so
they answer at once; render/launch and the cluster commands (launcher.cloud_commands) import
SkyPilot when they run, and `local`, `eval` and `export` import the runtime. Options several
commands share are in launcher.arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from launcher.arguments import (
    add_command,
    add_launch_options,
    add_plan_options,
    add_set,
    confirm,
    options_from_args,
    plan_overrides,
)
from launcher.cloud_commands import add_commands as add_cloud_commands
from launcher.names import PROG, RENDERED_MARK
from recipes.errors import OneLineParser, UserError

# The package a command imports -> the extra of pyproject.toml that installs it: `pip install
# forgesky` alone plans and checks recipes; rendering and launching need SkyPilot, running
# the runtime (`local`, `eval`, `export`) its stack.
EXTRA_OF = {
    "sky": "launch",
    "torch": "runtime",
    "monarch": "runtime",
    "torchtitan": "runtime",
    "transformers": "runtime",
    "huggingface_hub": "runtime",
    "safetensors": "runtime",
    "datasets": "runtime",
    "psutil": "runtime",
    "wandb": "runtime",
    "matplotlib": "runtime",
    "tqdm": "runtime",
    "pygtrie": "runtime",
    "triton": "runtime",
    "vllm": "gpu",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one forgesky command; returns the exit code (2 for mistakes the user can fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = argv
    try:
        return args.handler(args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"{PROG}: error: `{PROG} {args.command}` needs the {e.name} package, which this "
            f"install lacks: pip install 'forgesky[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`forgesky plan ... | head`): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        # SkyPilot's errors that are the state of the world (launcher.cloud.CLOUD_ERRORS): one
        # line, exit 1; any other is a bug and keeps its traceback
        cloud = sys.modules.get("launcher.cloud")
        if cloud is None or not isinstance(e, cloud.CLOUD_ERRORS):
            raise
        print(f"{PROG}: error: {cloud.error_line(e)}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = OneLineParser(
        prog=PROG,
        description="GRPO post-training of Qwen3/Llama models on cloud GPUs through SkyPilot.",
        epilog="NAME is a catalog recipe (forgesky recipes) or a recipe YAML file.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = add_command(sub, "recipes", "list the recipe catalog", _cmd_recipes)
    p.add_argument("--json", action="store_true", help="one JSON object per recipe, in a list")

    p = add_command(sub, "show", "print a recipe's YAML and its minimum GPUs", _cmd_show)
    p.add_argument("recipe", metavar="NAME")

    p = add_command(sub, "plan", "where each service runs on N GPUs", _cmd_plan)
    p.add_argument("recipe", metavar="NAME")
    add_plan_options(p)
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also the layouts the planner weighed, with their predicted step times",
    )
    p.add_argument(
        "--cheapest",
        action="store_true",
        help="rank every GPU type x count x on-demand/spot by the run's predicted price",
    )
    p.add_argument("--deadline", metavar="TIME", help="with --cheapest: done within, e.g. 8h")
    p.add_argument("--budget", metavar="USD", help="with --cheapest: costing at most, e.g. 200")

    p = add_command(
        sub,
        "prices",
        "the hourly GPU prices plans use (SkyPilot's catalog), and their source",
        _cmd_prices,
        epilog="--refresh asks SkyPilot's catalog (sky.catalog; it fetches what is stale) and "
        "rewrites the table plans read; --refresh --snapshot rebuilds it from the committed "
        "snapshot of SkyPilot's catalog files (recipes/price_catalog), for machines offline.",
    )
    p.add_argument("--refresh", action="store_true", help="rewrite the table from sky.catalog")
    p.add_argument(
        "--snapshot", action="store_true", help="with --refresh: from the committed snapshot"
    )
    p.add_argument("--json", action="store_true", help="the table as JSON")

    p = add_command(sub, "render", "print the SkyPilot task YAML for a run", _cmd_render)
    p.add_argument("recipe", metavar="NAME")
    add_launch_options(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    p = add_command(
        sub, "launch", "launch a run on SkyPilot (a cluster, or a managed job)", _cmd_launch
    )
    p.add_argument("recipe", metavar="NAME")
    add_launch_options(p)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--dryrun",
        action="store_true",
        help="check everything and print the task, but call no cloud",
    )
    p.add_argument(
        "--down", action="store_true", help="tear the cluster down when the run ends (clusters)"
    )

    add_cloud_commands(sub)

    p = add_command(sub, "cp", "copy a recipe to a file to edit", _cmd_cp)
    p.add_argument("recipe", metavar="NAME")
    p.add_argument("dest", metavar="FILE", help="file (or directory) to write")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")

    p = add_command(sub, "validate", "check a recipe file (schema, layout, plan)", _cmd_validate)
    p.add_argument("recipe", metavar="FILE")
    add_plan_options(p)

    p = add_command(
        sub,
        "eval",
        "evaluate a finished model on its recipe's held-out data, as a run does",
        _cmd_eval,
        epilog="SOURCE: a run directory (its newest committed checkpoint and recorded recipe), "
        "one of its checkpoints, a model folder forgesky wrote (its forgesky.json records the "
        "recipe), any Hugging Face model folder (needs --recipe) or a LoRA adapter folder in "
        "PEFT's format (merged into the recipe's base). What is evaluated is the "
        "recipe's eval section: --set eval.prompts=64, eval.k=8, ...",
    )
    p.add_argument("source", metavar="SOURCE", help="run directory, checkpoint or model folder")
    p.add_argument(
        "--recipe",
        default=None,
        help="catalog name or YAML path (default: the one the run or the export recorded)",
    )
    add_set(p, "eval.prompts=64")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the result as JSON")

    p = add_command(
        sub,
        "export",
        "write a run's trained policy as a Hugging Face model folder (and push it to the Hub)",
        _cmd_export,
        epilog="A run writes RUN_DIR/model when it finishes; this exports any committed "
        "checkpoint. The folder loads with transformers' from_pretrained and vllm.LLM. A LoRA "
        "run exports its adapter as a PEFT folder (peft.PeftModel.from_pretrained, vLLM's "
        "LoRARequest); --merge writes it merged into its base as a full model folder.",
    )
    p.add_argument("source", metavar="RUN_DIR", help="run directory, or one of its checkpoints")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the folder to write: a new or empty one (one that holds anything is refused)",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument(
        "--recipe", default=None, help="catalog name or YAML path (default: the run's own)"
    )
    p.add_argument(
        "--push-to-hub",
        default=None,
        metavar="REPO",
        help="then upload to this Hub repository, private if new (token: HF_TOKEN)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write its adapter merged into the base, a full model folder",
    )

    p = add_command(
        sub,
        "local",
        "run a recipe on this machine (python -m runtime)",
        _cmd_local,
        epilog="Options after NAME go to the runtime: [--gpus N] [--steps N] [--run-dir DIR] "
        "[--set k=v ...] [--checkpoint-every N] [--wandb online|offline|disabled] [--seed N] "
        "(forgesky local NAME --help lists them all)",
    )
    p.add_argument("recipe", metavar="NAME")
    rest = p.add_argument(
        "runtime_args", nargs=argparse.REMAINDER, metavar="OPTIONS", help=argparse.SUPPRESS
    )
    rest.required = False  # none is fine; argparse counts a REMAINDER positional as required
    return parser


def render_text(args: argparse.Namespace) -> str:
    """What `forgesky render` writes for these arguments (python -m launcher.write_sky too)."""
    return _rendered(args)[1]


def _rendered(args: argparse.Namespace) -> tuple[Any, str]:
    """The resolved job (launcher.options.Job) and the file `forgesky render` writes."""
    import shlex

    from launcher.options import resolve_job

    # the recipe and the plan first: bad input is refused before SkyPilot loads (seconds)
    job = resolve_job(args.recipe, options_from_args(args))
    from launcher.render import render_job

    return job, render_job(job, f"{PROG} {shlex.join(args.argv)}", args.output)


# --- commands ------------------------------------------------------------------------------


def _cmd_recipes(args: argparse.Namespace) -> int:
    from launcher.catalog import recipe_rows, recipes_table

    rows = recipe_rows()
    print(_json(rows) if args.json else recipes_table(rows))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from launcher.catalog import show

    print(show(args.recipe))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from recipes import apply_overrides, launch_gpus, load_recipe, plan

    if args.cheapest or args.deadline is not None or args.budget is not None:
        return _cmd_cheapest(args)
    recipe = apply_overrides(load_recipe(args.recipe), list(plan_overrides(args)))
    if recipe.kind == "grpo" and (
        recipe.grpo.loss.count(":")
        or any(":" in r.name for r in recipe.dataset.rewards)
        or (recipe.env is not None and not recipe.env.builtin)
    ):
        from launcher.options import check_references

        check_references(recipe, args.recipe)
    gpus = launch_gpus(recipe) if args.gpus is None else args.gpus
    run_plan = plan(recipe, gpus)
    if args.gpus is not None and not args.allow_idle:
        from recipes.run_cost import check_idle

        check_idle(recipe, run_plan, gpus)
    from recipes.files import bucket_reads
    from recipes.sft_rows import check_local_data

    check_local_data(recipe)  # an SFT recipe's local data, read without a tokenizer
    from launcher.options import say_if_unsold

    say_if_unsold(run_plan, gpus)  # on stderr: --json stays JSON
    from recipes.run_cost import run_estimate

    run = run_estimate(recipe, run_plan)
    if args.json:
        print(_json({**run_plan.to_dict(), "run": run.to_dict() if run else None}))
    else:
        print(run_plan.describe())
        for setting in bucket_reads(recipe):
            print(
                f"{setting.field}: {setting.value}, a folder in a bucket: launch copies it to "
                "every node (not read now)"
            )
        if run is not None:
            print("\n".join(run.lines()))
        if args.explain:
            print(run_plan.explain())
    return 0


def _cmd_cheapest(args: argparse.Namespace) -> int:
    from launcher.money import cheapest

    return cheapest(args)


def _cmd_prices(args: argparse.Namespace) -> int:
    from launcher.money import prices

    return prices(args)


def _cmd_validate(args: argparse.Namespace) -> int:
    from launcher.catalog import validate

    print(validate(args.recipe, args.gpus, plan_overrides(args), allow_idle=args.allow_idle))
    return 0


def _cmd_cp(args: argparse.Namespace) -> int:
    from launcher.catalog import copy_recipe

    target = copy_recipe(args.recipe, args.dest, force=args.force)
    print(f"wrote {target}; edit it, then: {PROG} plan {target} · {PROG} launch {target}")
    return 0


def _writable_task_file(path: str) -> None:
    """-o FILE: a new file, an empty one or a task file render wrote earlier (rendering again
    is how another GPU count is had); anything else, a recipe above all, is refused."""
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        raise UserError(f"-o {path}: a folder; name a file (e.g. -o {target / 'task.yaml'})")
    try:
        head = target.read_text(errors="replace")[:2000] if target.exists() else ""
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if head.strip() and f"# {RENDERED_MARK}`{PROG} render" not in head:
        raise UserError(
            f"-o {path}: the file exists and is not a task {PROG} rendered (a recipe?); "
            "name another file or remove it first"
        )


def _cmd_render(args: argparse.Namespace) -> int:
    if args.output:
        _writable_task_file(args.output)  # before anything is planned or imported
    job, text = _rendered(args)
    if job.recipe.model.gated and not os.environ.get("HF_TOKEN"):
        # nothing is launched here, so no refusal: the file needs the token where it runs
        print(
            f"note: {job.recipe.model.hf_id} is gated on the Hugging Face Hub; export HF_TOKEN "
            "(a token with access to it) where you run the file: it is passed as a secret",
            file=sys.stderr,
        )
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as e:
            raise UserError(f"cannot write {args.output}: {e.strerror}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    if args.down and options.managed:
        raise UserError("--down applies to clusters; a managed job's cluster goes when it ends")
    from launcher.options import PROJECT_DIR, SECRETS, resolve_job, secret_values
    from launcher.source import project_source

    job = resolve_job(args.recipe, options)
    project = project_source(PROJECT_DIR)
    # Preflight on this machine: a missing token fails here, not after provisioning.
    secrets = secret_values(job, os.environ)
    from launcher import cloud
    from launcher.files import describe
    from launcher.render import render
    from launcher.task import build_task

    task = build_task(job, secrets, project)
    kind = "managed job" if options.managed else "cluster"
    shown_name = job.name
    if job.plan.env_nodes:  # CPU nodes for the environments: a job group (launcher/task.py)
        from launcher.task import group_name

        kind, shown_name = "managed job group (train, envs)", group_name(job.name)
    spot = " on spot instances" if options.spot else ""
    print(job.plan.describe())
    _print_run_cost(job.recipe, job.plan, options.infra)
    given = [k for k in SECRETS if secrets.get(k)]
    print(
        f"{kind} {shown_name}{spot}; secrets from your environment: "
        f"{', '.join(given) if given else 'none'}"
    )
    print(f"{PROG} on the nodes: {project.summary}")
    for line in describe((*job.local_files, *job.bucket_files)):
        print(f"to every node: {line}")
    if options.managed and options.spot and not options.checkpoint_bucket:
        print(
            f"{PROG}: warning: no --checkpoint-bucket: a preempted job restarts from step 0",
            file=sys.stderr,
        )
    _print_model_folder(job, gone=options.managed or args.down)
    if args.dryrun:
        import shlex

        # The placeholder task: the real one carries secret values, which are never printed.
        shown = build_task(job, secret_values(job, None), project)
        sys.stdout.write(render(job, shown, f"{PROG} {shlex.join(args.argv)}", project))
        print(f"{PROG}: dry run: nothing launched", file=sys.stderr)
        return 0
    if not args.yes:
        confirm(f"Launch {kind} {shown_name}?", f"not launching {kind} {shown_name}")
    print(cloud.launch(task, job.name, managed=options.managed, down=args.down))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from runtime.evaluate import run

    return run(args.source, args.recipe, list(args.overrides), args.out)


def _cmd_export(args: argparse.Namespace) -> int:
    from runtime.export import run

    return run(
        args.source,
        args.out,
        step=args.step,
        recipe_name=args.recipe,
        push_to_hub=args.push_to_hub,
        merge=args.merge,
    )


# What `local` imports first (the runtime extra's core), looked for before the run folder is
# made: a launcher-only install is told in one line and leaves nothing behind.
RUNTIME_CORE = ("torch", "monarch", "torchtitan", "transformers")


def _cmd_local(args: argparse.Namespace) -> int:
    rest = list(args.runtime_args)
    if "--recipe" in rest:
        raise UserError("forgesky local takes the recipe as NAME, not --recipe")
    import importlib.util

    for name in RUNTIME_CORE:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    from runtime.entry import main as runtime_main

    return runtime_main(["--recipe", args.recipe, *rest], prog=f"{PROG} local", named=True)


# --- helpers -------------------------------------------------------------------------------


def _print_run_cost(recipe: Any, run_plan: Any, infra: str | None) -> None:
    from recipes.prices import price_book
    from recipes.run_cost import run_estimate

    book = price_book()
    run = run_estimate(recipe, run_plan, book, book.cloud_of(infra))
    if run is not None:
        print("\n".join(run.lines()))


def _print_model_folder(job: Any, *, gone: bool) -> None:
    """Where the run's model folder will be: in the bucket (an SFT run's, the start of a GRPO
    run), else on node 0, or a warning where the cluster goes when the run ends."""
    url = job.model_url
    if url is not None:
        then = f"; GRPO from it: --set model.hf_id={url}" if job.recipe.kind == "sft" else ""
        print(f"model folder at the end: {url}{then}")
    elif gone:
        print(
            f"{PROG}: warning: no --checkpoint-bucket: the model folder goes with the cluster "
            "when the run ends",
            file=sys.stderr,
        )
    else:
        print(
            f"model folder at the end: {job.run_dir}/model on node 0 of {job.name} "
            "(--checkpoint-bucket puts it in a bucket)"
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("forgesky")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _json(data: object) -> str:
    import json  # only --json pays for it

    return json.dumps(data, indent=2)


if __name__ == "__main__":
    sys.exit(main())
