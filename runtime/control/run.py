"""One run: start the weight store and every service from the plan, train, shut down cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from recipes import UserError
from recipes.architectures import same_shapes
from recipes.memory import checkpoint_bytes, model_file_bytes
from recipes.names import ALL_LINEAR, LORA_TARGETS
from recipes.run_sections import Lora
from runtime.control import checkpoint
from runtime.control.checkpoint import approx_size
from runtime.control.config import RunConfig

# The run's own imports (startup loads torch and Monarch: over a second) are made where used, so
# that the checks below refuse a bad --run-dir at once.
if TYPE_CHECKING:
    from runtime.procs.lifecycle import RunLifecycle

# What run.py records in RUN_DIR/config.json (the recipe, and its plan) has these keys; a
# model's config.json (Hugging Face's) has none of them.
RECORD_KEYS = ("name", "model", "plan")


def recorded_config(recipe: Any, plan: Any) -> dict[str, Any]:
    """What a run records of itself in RUN_DIR/config.json: the recipe and its plan."""
    return {**recipe.model_dump(mode="json"), "plan": plan.to_dict()}


def write_recorded(run_dir: Path, recorded: dict[str, Any]) -> None:
    """Write RUN_DIR/config.json whole or not at all (a run killed meanwhile leaves the old)."""
    path = run_dir / "config.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(recorded, indent=2) + "\n")
    os.replace(tmp, path)


def is_run_record(data: Any) -> bool:
    """Whether `data` (a parsed config.json) is what a run records, not a model's config."""
    return (
        isinstance(data, dict)
        and all(key in data for key in RECORD_KEYS)
        and ("grpo" in data or "sft" in data)  # what it trained by
        and isinstance(data["model"], dict)
    )


def prepare_run_dir(config: RunConfig) -> None:
    """Check the run dir before anything starts, then create it. A UserError where it cannot
    be created or written, where it holds files and is not a run dir (a model folder: the run
    would write over its config.json), or where it holds checkpoints of another model."""
    run_dir = config.run_dir
    where = f"run dir {run_dir}"
    if run_dir.is_dir():
        saved = checkpoint.committed(config.checkpoint_dir)  # one look at the folder for all three
        _check_is_run_dir(run_dir, saved)
        _check_same_model(config, saved)
        _check_steps_left(config, saved)
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise UserError(f"{where}: cannot write to this folder; name another --run-dir")
        return
    if run_dir.exists() or run_dir.is_symlink():
        raise UserError(f"{where} exists and is not a folder; name a new --run-dir")
    try:
        run_dir.mkdir(parents=True)
    except OSError as e:
        raise UserError(
            f"{where}: cannot create the folder ({e.strerror or e}); name another --run-dir"
        ) from None


def _read_record(run_dir: Path) -> tuple[bool, Any]:
    """(whether RUN_DIR/config.json is there, its parsed content or None if unreadable)."""
    path = run_dir / "config.json"
    if not path.exists():
        return False, None
    try:
        return True, json.loads(path.read_text())
    except (OSError, ValueError):
        return True, None


def _check_is_run_dir(run_dir: Path, saved: list[checkpoint.Checkpoint]) -> None:
    """An existing folder is fine empty or as a run dir of this tool (resumed); anything else
    would have the run's files mixed into it and its config.json overwritten."""
    if not any(run_dir.iterdir()):
        return
    present, data = _read_record(run_dir)
    if data is not None and not is_run_record(data):
        raise UserError(
            f"run dir {run_dir} holds a config.json that is not a forgesky run's (a model "
            "folder?), which the run would overwrite; name a new or empty --run-dir"
        )
    if is_run_record(data):
        return
    # config.json cut short (a run killed while writing it) or not written yet: the run's
    # other outputs say whether this is one
    if (run_dir / "metrics.jsonl").is_file() or saved:
        return
    made = run_dir / "checkpoints"
    if made.is_dir() and [p.name for p in run_dir.iterdir()] == [made.name]:
        return  # a new run whose checkpoints/ was made (or linked to another disk) beforehand
    what = "an unreadable config.json" if present else "files"
    raise UserError(
        f"run dir {run_dir} holds {what} and is not a forgesky run directory (no run "
        "config.json, metrics.jsonl or checkpoints/); name a new or empty --run-dir, or a "
        "run directory to resume"
    )


def _check_same_model(config: RunConfig, saved: list[checkpoint.Checkpoint]) -> None:
    """A run dir with a committed checkpoint resumes it: refuse a recipe whose model has other
    parameter shapes than the one the run recorded (the trainer would fail to load it)."""
    if not saved:
        return
    _, data = _read_record(config.run_dir)
    new = config.recipe.model
    if not is_run_record(data):
        # nothing recorded (a run dir whose config.json was lost): the checkpoint's metadata
        # says whether it holds an adapter, of which rank and targets
        _check_same_training(config, _saved_training(saved), new.lora)
        return
    old = data["model"]
    if not same_shapes(old, new.family, new.size):
        raise UserError(
            f"run dir {config.run_dir} holds checkpoints of {old.get('hf_id')} "
            f"({old.get('family')} {old.get('size')}) and this recipe trains {new.hf_id} "
            f"({new.family} {new.size}): it cannot resume them; use a new --run-dir"
        )
    try:
        recorded = _recorded_training(old.get("lora"))
    except ValidationError:  # a hand-edited record: the checkpoint itself says
        recorded = _saved_training(saved)
    _check_same_training(config, recorded, new.lora)


# What a run dir's checkpoints train: None for every parameter, else a LoRA adapter's (rank,
# alpha or None where unknown, targets as Hugging Face projection names).
Training = tuple[int, float | None, tuple[str, ...]] | None


def _recorded_training(lora: Any) -> Training:
    """What the recorded config's `model.lora` trained (as Lora dumps it)."""
    if lora is None:
        return None
    section = Lora.model_validate(lora)
    return section.rank, section.scaling_alpha, section.modules


def _saved_training(saved: list[checkpoint.Checkpoint]) -> Training:
    """What the newest whole checkpoint trained, from its metadata (torch: loaded only here).
    Damaged ones are the resume's to report, which skips them as this does."""
    from runtime.backends.checkpoint_read import saved_kind

    for ckpt in reversed(saved):
        try:
            checkpoint.verify(ckpt)
        except UserError:
            continue
        kind = saved_kind(ckpt.path)
        return None if kind[0] == "full" else (kind[1], None, kind[2])
    return None


def _check_same_training(config: RunConfig, old: Training, lora: Any) -> None:
    """A LoRA adapter's checkpoints resume only into the same adapter (rank, alpha, targets),
    and a full run's only into a full run: the optimizer holds other parameters otherwise."""
    new = None if lora is None else (lora.rank, lora.scaling_alpha, lora.modules)
    if old is None and new is None:
        return
    if old is not None and new is not None:
        if old[0] == new[0] and old[2] == new[2] and old[1] in (None, new[1]):
            return
        trains = f"one of {_adapter_words(new, old[1] is not None)}"
    else:
        trains = "every parameter" if new is None else f"a LoRA adapter ({_adapter_words(new)})"
    holds = "every parameter" if old is None else f"a LoRA adapter ({_adapter_words(old)})"
    raise UserError(
        f"run dir {config.run_dir} holds checkpoints of {holds} and this recipe trains "
        f"{trains}: it cannot resume them; use a new --run-dir"
    )


def _adapter_words(training: Training, alpha: bool = True) -> str:
    """ "rank 8, alpha 16 on all-linear": an adapter as the recipe's model.lora names it."""
    assert training is not None
    rank, scaling_alpha, modules = training
    shown = f", alpha {scaling_alpha:g}" if alpha and scaling_alpha is not None else ""
    where = ALL_LINEAR if modules == LORA_TARGETS else ", ".join(modules)
    return f"rank {rank}{shown} on {where}"


def _check_steps_left(config: RunConfig, saved: list[checkpoint.Checkpoint]) -> None:
    """A resume whose --steps (grpo.steps) is below the step its checkpoint reached has
    nothing to train: said at once, not after every service has started. (At that step
    exactly, as a managed job restarted after its last checkpoint is, the run is over:
    `finished_already`.)"""
    r = config.recipe
    steps = r.grpo.steps if r.kind == "grpo" else r.sft.steps
    if saved and saved[-1].step > steps:
        raise UserError(
            f"run dir {config.run_dir} is at step {saved[-1].step} already and the run is "
            f"{steps} steps: nothing left to train; raise --steps to go on, or `forgesky "
            f"export {config.run_dir} --out DIR` for its model"
        )


def finished_already(config: RunConfig) -> bool:
    """Whether the run dir's newest committed checkpoint is whole and at the run's last step (a
    finished run started again, a managed job recovered after its end): then the run is over
    before anything starts. One line says so; RUN_DIR/model is written from that checkpoint
    where the run ended before it was (in this process: no service is started)."""
    r = config.recipe
    steps = r.grpo.steps if r.kind == "grpo" else r.sft.steps
    saved = checkpoint.committed(config.checkpoint_dir)
    if not saved or saved[-1].step != steps:
        return False
    try:
        checkpoint.verify(saved[-1])
    except UserError:
        return False  # the resume says what is wrong with it, and takes an earlier one
    run_dir, model = config.run_dir, config.run_dir / "model"
    done = f"forgesky: run dir {run_dir} is at step {steps} of {steps} already: nothing to train"
    if _model_step(model) == steps:
        print(
            f"{done}, nothing started; its model is {model} (`forgesky eval {run_dir}` "
            f"evaluates it, `forgesky export {run_dir} --out DIR` writes it elsewhere); raise "
            "--steps to train on",
            flush=True,
        )
        return True
    no_room = model_room_warning(config)
    if no_room:
        print(f"{done}, nothing started", flush=True)
        print(no_room, file=sys.stderr, flush=True)
        return True
    what, size, written = _model_words(config)
    print(
        f"{done}, no service started; writing its {what} from that checkpoint ({size}) ...",
        flush=True,
    )
    from runtime.export import write_run_model

    write_run_model(run_dir, config.recipe, steps)
    print(written, flush=True)
    return True


def _model_words(config: RunConfig) -> tuple[str, str, str]:
    """What RUN_DIR/model is, its size and files, and the line that says it is written: a
    full model, or a LoRA run's adapter as a PEFT folder."""
    recipe, model = config.recipe, config.run_dir / "model"
    size = approx_size(model_file_bytes(recipe))
    if recipe.model.lora is None:
        return (
            "model",
            f"{size} of {recipe.model.dtype} safetensors",
            f"model -> {model} (Hugging Face format: transformers, vLLM)",
        )
    return (
        "adapter",
        f"{size} of fp32 safetensors",
        f"adapter -> {model} (PEFT; `forgesky export {config.run_dir} --merge --out DIR` for a "
        "full model)",
    )


def _model_step(model: Path) -> int | None:
    """The step RUN_DIR/model was written at (None: none, or not readable as one)."""
    try:
        step = json.loads((model / "forgesky.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


async def _main(life: RunLifecycle, config: RunConfig) -> None:
    from runtime.control.controller import FINISH_PROBE_S, Controller, room_warning
    from runtime.control.metrics import MetricsLogger
    from runtime.control.startup import start_services

    recipe = config.recipe
    print(config.plan.describe(), flush=True)
    warning = room_warning(config.checkpoint_dir, checkpoint_bytes(recipe.arch, recipe.model.lora))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    environments = None
    if getattr(recipe, "env", None) is not None:
        # before any service: an environment that cannot be hosted (not importable, tools the
        # chat template cannot express, no sandbox) ends the run in one line with no GPU held
        from runtime.environments.start import node_workers, start_environments

        # as many as the plan says for this node's cores, or env.workers_per_node
        workers = node_workers(recipe, config.plan)
        print(f"starting environment workers ({workers}) ...", flush=True)
        environments = await start_environments(recipe.env, workers=workers)
        life.register("environment workers", environments.shutdown, timeout=15.0)
    start = time.perf_counter()
    services = ["weight store", "trainer", "generator"]
    if config.plan.reference_in_trainer:
        services += ["reference (in the trainer)"]
    elif config.plan.reference_enabled:
        services += ["reference"]
    print(f"starting services ({', '.join([*services, 'reward'])}) ...", flush=True)

    async def start_up() -> Controller:
        started = await start_services(life, config)
        print(
            f"services ready in {time.perf_counter() - start:.1f} s; run dir {config.run_dir}",
            flush=True,
        )
        controller = Controller(config, started, life.stopping)
        # stopped before the services (newest first): a checkpoint being written when the run
        # ended early is committed if it lands in time
        life.register(
            "checkpoint in flight",
            controller.finish_checkpoint,
            timeout=recipe.grpo.checkpoint_finish_s + FINISH_PROBE_S + 5.0,
            after_failure=True,
        )
        controller.environments = environments
        await controller.prepare()
        return controller

    # a stop before the first step abandons the start-up: nothing is trained, nothing saved
    controller = await life.start(start_up())
    recorded = recorded_config(recipe, config.plan)
    write_recorded(config.run_dir, recorded)
    metrics = MetricsLogger(
        config.run_dir,
        wandb_mode=config.wandb_mode,
        run_name=config.run_dir.name,
        config=recorded,
        resume_id=controller.wandb_run_id,
        total_steps=recipe.grpo.steps,
        usd_per_hour=usd_per_hour(recipe, config.plan),
        started=start,
        resumed_from=controller.resumed_from,
    )
    controller.metrics = metrics

    async def close_metrics() -> None:
        metrics.close()

    life.register("metrics", close_metrics)
    controller.start_rollouts()
    await controller.train()
    await controller.stop_rollouts()
    if controller.step > (controller.resumed_from or 0):  # a stop before any step saves nothing
        await controller.save_checkpoint()
    finished = controller.step >= recipe.grpo.steps
    no_room = model_room_warning(config) if finished else None
    if no_room:
        print(no_room, file=sys.stderr, flush=True)
    elif finished:
        provenance = {
            "recipe": recipe.name,
            "step": controller.step,
            "run_dir": str(config.run_dir),
        }
        what, size, written = _model_words(config)
        print(f"writing the {what} ({size}) ...", flush=True)
        await controller.services.export(str(config.run_dir / "model"), provenance)
        print(written, flush=True)
    status = "finished" if finished else "stopped"
    print(_summary_line(metrics, recipe, config.plan, controller.step), flush=True)
    print(f"{status} at step {controller.step}; outputs in {config.run_dir}", flush=True)


def usd_per_hour(recipe: Any, run_plan: Any) -> float | None:
    """The node set's dollars an hour from the recipe (resources.usd_per_node_hour), or None."""
    price = recipe.resources.usd_per_node_hour
    return None if price is None else price * max(run_plan.num_nodes, 1)


def _summary_line(metrics: Any, recipe: Any, run_plan: Any, step: int) -> str:
    g = recipe.grpo
    return summary_line(metrics, recipe, run_plan, step, step * g.prompts_per_step * g.group_size)


def summary_line(metrics: Any, recipe: Any, run_plan: Any, step: int, samples: int) -> str:
    """Write RUN_DIR/summary.json (measured wall time beside the plan's prediction of it, the
    dollars) and say it in one line. `samples`: completions (GRPO) or rows (SFT) trained on."""
    from recipes.run_cost import run_estimate

    estimate = run_estimate(recipe, run_plan)
    predicted = None
    if estimate is not None:
        # what this process can measure: the whole run less the provisioning before it
        predicted = {
            **estimate.to_dict(),
            "wall_s_on_the_nodes": round(estimate.wall_s - estimate.provision_s, 1),
        }
        at = _at_run_lengths(metrics, recipe, run_plan)
        if at is not None:
            # the same run with each step at the lengths it had, not the recipe's maxima
            on_nodes = predicted["wall_s_on_the_nodes"]
            at["wall_s_on_the_nodes"] = round(
                on_nodes + estimate.steps * (at["step_s"] - estimate.step_s), 1
            )
            predicted["at_run_lengths"] = at
    done = metrics.summary(step, samples, predicted)
    words = f"run: {done['measured_wall_s'] / 60:.1f} min on the nodes"
    if predicted is not None:
        words += f" (predicted {predicted['wall_s_on_the_nodes'] / 60:.1f} min)"
        at = predicted.get("at_run_lengths")
        if at is not None and _lengths_differ(recipe, at):
            words += (
                f"; at this run's lengths the plan says {at['wall_s_on_the_nodes'] / 60:.1f} min:"
                f" --set dataset.prompt_tokens_mean={round(at['prompt_tokens'])}"
                f" --set dataset.response_tokens_mean={round(at['response_tokens'])} for the next plan"
            )
    if "cost_usd" in done:
        words += (
            f"; ${done['cost_usd']:,.2f} ({recipe.resources.price_source or 'the recipe'}), "
            f"${done['usd_per_1k_samples']:,.4f} per 1,000 samples"
        )
    if done["recoveries"]:
        n = done["recoveries"]
        words += (
            f"; {n} {'recovery' if n == 1 else 'recoveries'}, {done['recovery_lost_s']:.0f} s lost"
        )
    return words


def _lengths_differ(recipe: Any, at: dict[str, Any]) -> bool:
    """Whether a run's mean lengths are 10 % or more off those its plan priced a step at."""
    from recipes.costs import ranking_lengths

    planned = ranking_lengths(recipe)
    ran = (at["prompt_tokens"], at["response_tokens"])
    return any(abs(r - p) >= 0.1 * p for p, r in zip(planned, ran, strict=True))


def _at_run_lengths(metrics: Any, recipe: Any, run_plan: Any) -> dict[str, Any] | None:
    """The cost model's step at the run's mean prompt and completion lengths (its metrics), where
    the plan priced it at the recipe's maxima; None for an SFT run or one without steps."""
    from recipes.gpu_plan import predict_layout
    from runtime.control.metrics import read_metrics

    if recipe.kind != "grpo" or run_plan.settings is None:
        return None
    rows = [r for r in read_metrics(metrics.path) if "response/len_mean" in r]
    prompts = [r["prompt/len_mean"] for r in rows if "prompt/len_mean" in r]
    if not rows or not prompts:
        return None
    prompt = sum(prompts) / len(prompts)
    response = sum(r["response/len_mean"] for r in rows) / len(rows)
    step = predict_layout(
        recipe, run_plan.accelerator, run_plan.placements, run_plan.settings, prompt, response
    )
    return {
        "prompt_tokens": round(prompt, 1),
        "response_tokens": round(response, 1),
        "step_s": round(step.seconds, 3),
    }


def model_room_warning(config: RunConfig) -> str | None:
    """At the end of a run: a warning where RUN_DIR/model would not fit on its disk (the
    model is then not written; the run's last checkpoint still holds it)."""
    from runtime.export import room_short

    short = room_short(config.run_dir / "model", model_file_bytes(config.recipe))
    if short is None:
        return None
    return (
        f"forgesky: warning: the model is not written: {config.run_dir} {short} "
        f"(`forgesky export {config.run_dir} --out DIR` writes it from the last checkpoint)"
    )


def run(config: RunConfig) -> int:
    """Run to the end, a stop or a failure; the process exit code."""
    from runtime.procs.lifecycle import RunLifecycle

    config.run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    life = RunLifecycle("forgesky")
    return asyncio.run(life.run(lambda lf: _main(lf, config)))
