"""`forgesky plan NAME --cheapest`: every GPU type x count x on-demand/spot a run can take,
ranked by its predicted price, with its predicted wall time.

A type is any of recipes/gpus.py the planner fits the recipe on; the counts are those a node
is sold with in the price table (recipes/prices.py) and whole nodes of 8 past one; each option
is planned as `plan` would plan it (recipes/planner.py) and priced as its run
(recipes/run_cost.py). Counts that leave GPUs idle where fewer give the same plan are left out
(`plan --gpus` refuses them). Speeds measured on the type itself carry the cost model's error
on the committed GPU runs; speeds scaled from another type by datasheet ratios a wider one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from recipes.errors import UserError
from recipes.gpus import GPU_TYPES
from recipes.measured import MEASURED
from recipes.prices import Offer, PriceBook, dollars, price_book
from recipes.run_cost import RunEstimate, check_idle, run_estimate, span

# The cost model's error on the committed GPU runs, speeds measured on that type
# (bench/results/cost_model_check.json: 30 of 44 held-out runs within 15 %, 14 excused misses).
MEASURED_ERROR = 0.15
# Speeds scaled to a type never measured by memory bandwidth and bf16 peak: assumed wider.
SCALED_ERROR_ASSUMED = 0.35
MULTI_NODE_COUNTS = (16, 32)


@dataclass(frozen=True)
class Option:
    accelerator: str
    gpus: int
    nodes: int
    spot: bool
    offer: Offer
    run: RunEstimate
    measured: bool

    @property
    def total(self) -> float:
        return self.run.total(self.spot) or math.inf

    @property
    def hourly(self) -> float:
        return self.run.hourly(self.spot) or math.inf

    @property
    def error(self) -> float:
        return MEASURED_ERROR if self.measured else SCALED_ERROR_ASSUMED

    def words(self) -> str:
        kind = "spot" if self.spot else "on demand"
        return (
            f"{self.gpus} x {self.accelerator} {kind} ({self.offer.where(self.spot)}): "
            f"{dollars(self.total)} in {_hours(self.run.wall_s)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "accelerator": self.accelerator,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "spot": self.spot,
            "cloud": self.offer.cloud,
            "region": self.offer.spot_region if self.spot else self.offer.on_demand_region,
            "instance_type": self.offer.instance_type,
            "per_hour": round(self.hourly, 2),
            "wall_s": round(self.run.wall_s, 1),
            "total": round(self.total, 2),
            "speeds": "measured" if self.measured else "scaled",
            "error": self.error,
        }


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def parse_duration(text: str, flag: str = "--deadline") -> float:
    """`8h`, `90m`, `1.5h`, `2d`, `3600s` (or plain hours) as seconds; UserError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UserError(
            f"{flag} {text!r}: a positive duration such as 8h, 90m or 2d (hours without a unit)"
        )
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 3600}[m.group(2)]
    return float(m.group(1)) * unit


def parse_money(text: str, flag: str = "--budget") -> float:
    """`200`, `$200`, `199.50` as dollars; UserError for anything else (negative included)."""
    m = re.fullmatch(r"\s*\$?\s*(\d+(?:\.\d+)?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"{flag} {text!r}: a positive amount of dollars such as 200 or $99.50")
    return float(m.group(1))


def options(
    recipe: Any,
    *,
    gpu_type: str | None = None,
    gpus: int | None = None,
    book: PriceBook | None = None,
) -> list[Option]:
    """Every way to run `recipe` the price table sells, cheapest first."""
    from recipes.planner import plan

    book = book or price_book()
    out: list[Option] = []
    for accelerator in (gpu_type,) if gpu_type else GPU_TYPES:
        typed = recipe.model_copy(
            update={
                "resources": recipe.resources.model_copy(
                    update={"accelerator": accelerator, "alternatives": []}
                )
            }
        )
        sold = book.counts(accelerator)
        counts = (gpus,) if gpus else (*sold, *(n for n in MULTI_NODE_COUNTS if 8 in sold))
        measured = accelerator in MEASURED["rates"]  # else scaled from a measured type
        for count in counts:
            try:
                p = plan(typed, count, other_types=False)
                check_idle(typed, p, count, book)
            except UserError:
                continue
            run = run_estimate(typed, p, book)
            if run is None:
                continue
            for spot in (False, True):
                offer = run.spot if spot else run.on_demand
                same = spot and offer is not None and offer == run.on_demand
                if same and offer.spot == offer.on_demand:
                    continue  # a "spot" price no lower than on demand: the same option
                if offer is not None and offer.price(spot) is not None:
                    out.append(Option(accelerator, count, p.num_nodes, spot, offer, run, measured))
    return sorted(out, key=lambda o: (o.total, o.run.wall_s))


def choose(
    found: list[Option], deadline_s: float | None, budget: float | None, name: str
) -> list[Option]:
    """The options within `deadline_s` and `budget`; UserError naming the cheapest and the
    fastest where none is."""
    if not found:
        raise UserError(f"{name}: no GPU type and count in the price table fits it")
    kept = [
        o
        for o in found
        if (deadline_s is None or o.run.wall_s <= deadline_s)
        and (budget is None or o.total <= budget)
    ]
    if kept:
        return kept
    asked = " and ".join(
        a
        for a in (
            f"--deadline {span(deadline_s)}" if deadline_s is not None else "",
            f"--budget {dollars(budget)}" if budget is not None else "",
        )
        if a
    )
    fastest = min(found, key=lambda o: (o.run.wall_s, o.total))
    raise UserError(
        f"nothing meets {asked}: the cheapest is {found[0].words()}, the fastest {fastest.words()}"
    )


def table(kept: list[Option], book: PriceBook, limit: int = 12) -> str:
    """The ranked options for people: cheapest first, then the fastest of them."""
    rows = [("GPUS", "TYPE", "NODES", "OFFER", "$/H", "WALL", "TOTAL", "SPEEDS")]
    for o in kept[:limit]:
        kind = "spot" if o.spot else "on demand"
        rows.append(
            (
                str(o.gpus),
                o.accelerator,
                str(o.nodes),
                f"{kind} {o.offer.where(o.spot)}",
                f"{o.hourly:,.2f}",
                _hours(o.run.wall_s),
                dollars(o.total),
                f"{'measured' if o.measured else 'scaled'} ±{o.error:.0%}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    fastest = min(kept, key=lambda o: (o.run.wall_s, o.total))
    lines.append(f"fastest: {fastest.words()}")
    if len(kept) > limit:
        lines.append(f"({len(kept) - limit} more, dearer; --json lists them all)")
    lines.append(
        f"prices: {book.words}; SPEEDS: the cost model's error on the type measured, wider "
        "where scaled from another type by memory bandwidth and bf16 peak"
    )
    return "\n".join(lines)
