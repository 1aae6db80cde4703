"""A whole run's predicted wall time and what it costs, for `plan` and `launch`.

wall time = grpo.steps (sft.steps) x the predicted step (recipes/costs.py)
          + start-up (provisioning and the nodes' set-up, the model's download)
          + the evaluations (eval.every, at_start, at_end; costs.eval_seconds)
          + the checkpoint writes (grpo.checkpoint_interval): the copy of the trainer's state
            to host memory that training waits for (the write to disk goes on beside it)

price = the node set's $/hour (recipes/prices.py: SkyPilot's catalog), on demand and spot, at
the cheapest cloud and region that sells a node of that many GPUs of that type, x the hours.

The start-up and the checkpoint copy are assumed (the *_ASSUMED constants) until a GPU run
measures them: bench/run_time_check.py compares each run's measured wall time with the
prediction it recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from recipes.costs import eval_seconds, sft_eval_seconds
from recipes.measured import MEASURED
from recipes.memory import GB, checkpoint_bytes, model_file_bytes
from recipes.prices import Offer, PriceBook, dollars, price_book

# Provisioning a node and SkyPilot's own set-up of it, before the task's set-up: assumed, not
# measured (a cloud's queue and image decide it).
PROVISION_S_ASSUMED = 420.0
# The task's set-up, the node stack's install: measured once (bench/results/node_setup_2026-11-25,
# 42 s from PyPI).
SETUP_S_MEASURED = 42.0
# The model's download from the Hugging Face Hub to each node (GB/s): assumed.
DOWNLOAD_GB_S_ASSUMED = 0.5
# The copy of the trainer's checkpoint state to host memory that a step waits for (GB/s): assumed.
CHECKPOINT_COPY_GB_S_ASSUMED = 10.0
# The end: the last checkpoint written to disk (the run waits for it) and the model exported
# (GB/s to the node's disk): assumed.
DISK_GB_S_ASSUMED = 1.0


@dataclass(frozen=True)
class RunEstimate:
    """A run's predicted wall time, in parts, and its price where the catalog sells the nodes."""

    steps: int
    step_s: float
    startup_s: float  # all of it: provisioning, set-up, download and the processes' start
    provision_s: float  # the part before the run's own processes exist (not measured by them)
    evals: int
    eval_s: float  # all of them
    checkpoints: int
    checkpoint_s: float  # all of them
    finish_s: float  # the last checkpoint's write and the model's export, waited for at the end
    accelerator: str
    nodes: int
    gpus_per_node: int
    on_demand: Offer | None
    spot: Offer | None
    price_source: str
    steps_key: str = "grpo.steps"  # the setting `steps` comes from
    # the length a step is priced at that the recipe does not state (the most it may take):
    # "prompt", "completion", "prompt and completion", or "" where both means are stated
    at_most: str = ""

    @property
    def wall_s(self) -> float:
        return (
            self.steps * self.step_s + self.startup_s + self.eval_s + self.checkpoint_s
            + self.finish_s
        )  # fmt: skip

    @property
    def hours(self) -> float:
        return self.wall_s / 3600

    def hourly(self, spot: bool) -> float | None:
        offer = self.spot if spot else self.on_demand
        price = offer.price(spot) if offer else None
        return None if price is None else price * self.nodes

    def total(self, spot: bool) -> float | None:
        hourly = self.hourly(spot)
        return None if hourly is None else hourly * self.hours

    def lines(self) -> list[str]:
        parts = [f"{self.steps} steps x {self.step_s:.1f} s", f"start-up {span(self.startup_s)}"]
        if self.evals:
            parts.append(f"{self.evals} evaluations {span(self.eval_s)}")
        if self.checkpoints:
            parts.append(f"{self.checkpoints} checkpoint copies {span(self.checkpoint_s)}")
        parts.append(f"the last checkpoint and the export {span(self.finish_s)}")
        out = [f"run: {' + '.join(parts)} = {span(self.wall_s)} predicted ({self.steps_key})"]
        if self.at_most:
            out.append(
                f"  steps priced at the longest {self.at_most} the recipe allows, an upper "
                "bound: --set dataset.prompt_tokens_mean=N --set dataset.response_tokens_mean=M (your "
                "data's means; a run's last line names them) prices yours"
            )
        node = f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} {self.accelerator}"
        if self.on_demand is None and self.spot is None:
            out.append(
                f"price of {node}: no cloud in the price table sells {self.gpus_per_node} "
                f"{self.accelerator} a node"
            )
            out.append(f"prices: {self.price_source} (forgesky prices)")
            return out
        prices = []
        for spot, kind in ((False, "on demand"), (True, "spot")):
            offer = self.spot if spot else self.on_demand
            hourly, total = self.hourly(spot), self.total(spot)
            if offer is None or hourly is None or total is None:
                prices.append(f"{kind}: not sold")
                continue
            prices.append(
                f"{kind} {dollars(hourly)}/h ({offer.where(spot)}) = {dollars(total)} for the run"
            )
        out.append(f"price of {node}: {'; '.join(prices)}")
        out.append(f"prices: {self.price_source} (forgesky prices)")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["wall_s"] = round(self.wall_s, 1)
        for spot, kind in ((False, "on_demand"), (True, "spot")):
            d[f"{kind}_per_hour"] = _round(self.hourly(spot))
            d[f"{kind}_total"] = _round(self.total(spot))
        return d


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def process_start_s(params: int, kind: str = "grpo") -> float:
    """The run's processes from their start to the first step's start and the first steps'
    compile, measured: a line in the weights' size through committed runs (MEASURED["startup"],
    bench/cost_constants.py); an SFT run (the trainer alone) takes the share of it its runs
    measured (MEASURED["sft_startup"])."""
    fit = MEASURED["startup"]
    line = fit["base_s"] + fit["s_per_billion_params"] * params / 1e9
    return line * MEASURED["sft_startup"]["share_of_grpo"] if kind == "sft" else line


def run_estimate(
    recipe: Any, plan: Any, book: PriceBook | None = None, cloud: str | None = None
) -> RunEstimate | None:
    """The whole run on `plan` (None for a CPU plan, or one without a predicted step), priced
    on `cloud` where given, else on the cheapest cloud."""
    if plan.cpu or plan.predicted_step_s is None:
        return None
    book = book or price_book()
    e = recipe.eval
    if recipe.kind == "sft":
        g = recipe.sft
        steps = g.steps
        # a held-out loss at the start and the end, and every eval.every steps between
        evals = (2 + (steps - 1) // e.every if e.every else 2) if e.enabled else 0
        one_eval = sft_eval_seconds(recipe, plan.accelerator, plan.trainer_gpus)
    else:
        g = recipe.grpo
        steps = g.steps
        evals = 0
        if e.enabled:
            evals = (1 if e.at_start else 0) + (steps // e.every if e.every else 0)
            if e.at_end and not (e.every and steps % e.every == 0):
                evals += 1
        one_eval = eval_seconds(recipe, plan.accelerator, plan.placements)
    checkpoints = steps // g.checkpoint_interval if g.checkpoint_interval else 0
    state = checkpoint_bytes(recipe.arch, recipe.model.lora)
    copy_s = state / GB / CHECKPOINT_COPY_GB_S_ASSUMED
    finish_s = (state + model_file_bytes(recipe)) / GB / DISK_GB_S_ASSUMED
    download_s = 2 * recipe.arch.params / GB / DOWNLOAD_GB_S_ASSUMED
    provision_s = PROVISION_S_ASSUMED + SETUP_S_MEASURED
    per_node = plan.gpus_per_node
    unstated = []
    if recipe.kind == "grpo":
        d = recipe.dataset
        unstated = [w for w, v in (("prompt", d.prompt_tokens_mean),
                                   ("completion", d.response_tokens_mean)) if v is None]  # fmt: skip
    return RunEstimate(
        at_most=" and ".join(unstated),
        steps=steps,
        step_s=plan.predicted_step_s,
        startup_s=provision_s + download_s + process_start_s(recipe.arch.params, recipe.kind),
        provision_s=provision_s,
        evals=evals,
        eval_s=evals * one_eval,
        checkpoints=checkpoints,
        checkpoint_s=checkpoints * copy_s,
        finish_s=finish_s,
        accelerator=plan.accelerator,
        nodes=plan.num_nodes,
        gpus_per_node=per_node,
        on_demand=book.cheapest(plan.accelerator, per_node, spot=False, cloud=cloud),
        spot=book.cheapest(plan.accelerator, per_node, spot=True, cloud=cloud),
        price_source=book.words,
        steps_key=f"{recipe.kind}.steps",
    )


def check_idle(recipe: Any, run_plan: Any, gpus: int, book: PriceBook | None = None) -> None:
    """UserError where `gpus` leaves GPUs or nodes without work and fewer GPUs (a count VM
    clouds sell, whole nodes past one) give the same placements: the line names that count and
    what the idle GPUs would cost. `--allow-idle` is the way to keep them."""
    from recipes.errors import UserError
    from recipes.planner import SOLD_GPUS_PER_NODE, plan

    idle = len(run_plan.idle_gpus)
    if run_plan.cpu or not idle:
        return
    used, gpn = gpus - idle, run_plan.gpus_per_node
    if used > gpn:
        fewer = -(-used // gpn) * gpn
    else:
        fewer = next((n for n in SOLD_GPUS_PER_NODE if used <= n <= gpn), used)
    if fewer >= gpus:
        return
    try:
        same = plan(recipe, fewer, accelerator=run_plan.accelerator)
    except UserError:
        return
    if same.placements != run_plan.placements:
        return
    idle_nodes = run_plan.num_nodes - same.num_nodes
    where = f" ({idle_nodes} whole node{'s' if idle_nodes != 1 else ''})" if idle_nodes else ""
    book = book or price_book()
    offer = book.cheapest(run_plan.accelerator, gpn, spot=False)
    cost = ""
    if offer is not None and offer.on_demand is not None:
        hourly = offer.on_demand / gpn * idle
        run = run_estimate(recipe, run_plan, book)
        total = f", {dollars(hourly * run.hours)} over the run" if run else ""
        cost = f"; the idle ones would cost {dollars(hourly)}/h on demand{total}"
    raise UserError(
        f"--gpus {gpus} leaves {idle} GPU{'s' if idle != 1 else ''} without work{where}: "
        f"--gpus {fewer} gives the same plan{cost} (--allow-idle keeps them)"
    )
