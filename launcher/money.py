"""The money commands: `forgesky prices` (the price table plans read, and refreshing it from
SkyPilot's catalog) and `forgesky plan NAME --cheapest` (every way to run a recipe, ranked by
its price). Neither loads SkyPilot, but `prices --refresh`, in a child process."""

from __future__ import annotations

import argparse

from launcher.arguments import plan_overrides
from launcher.names import PROG
from recipes.errors import UserError


def _json(data: object) -> str:
    import json

    return json.dumps(data, indent=2)


def cheapest(args: argparse.Namespace) -> int:
    """`plan NAME --cheapest [--deadline T] [--budget USD]`: the ranked table (or JSON)."""
    from recipes import apply_overrides, load_recipe
    from recipes.cheapest import choose, options, parse_duration, parse_money, table
    from recipes.gpus import check_gpu_type
    from recipes.prices import price_book

    if not args.cheapest:
        raise UserError("--deadline and --budget go with --cheapest")
    if args.gpus is not None and args.gpu_type is not None:
        raise UserError(
            "--cheapest with both --gpus and --gpu-type fixed has nothing to rank; "
            "leave one out (or drop --cheapest: forgesky plan shows that one's price)"
        )
    if args.explain:
        raise UserError("--explain goes with a plan, not --cheapest")
    deadline = parse_duration(args.deadline) if args.deadline is not None else None
    budget = parse_money(args.budget) if args.budget is not None else None
    gpu_type = check_gpu_type(args.gpu_type) if args.gpu_type else None
    overrides = [o for o in plan_overrides(args) if not o.startswith("resources.a")]
    recipe = apply_overrides(load_recipe(args.recipe), overrides)
    if recipe.cpu:
        raise UserError(f"{recipe.name} runs on CPU: nothing to buy (forgesky local {recipe.name})")
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: a GPU count is 1 or more")
    book = price_book()
    kept = choose(
        options(recipe, gpu_type=gpu_type, gpus=args.gpus, book=book), deadline, budget, recipe.name
    )
    if args.json:
        print(_json({"prices": book.words, "options": [o.to_dict() for o in kept]}))
    else:
        ways = f"{len(kept)} way{'s' if len(kept) != 1 else ''}"
        print(f"{recipe.name}: {ways} to run it, cheapest first")
        print(table(kept, book))
        best = kept[0]
        print(
            f"{PROG} plan {args.recipe} --gpu-type {best.accelerator} --gpus {best.gpus}: its plan"
        )
    return 0


def prices(args: argparse.Namespace) -> int:
    """`forgesky prices [--refresh [--snapshot]]`: the price table plans read, and its source."""
    from recipes.prices import OFFERS_FILE, dollars, price_book

    if args.snapshot and not args.refresh:
        raise UserError("--snapshot goes with --refresh")
    if args.refresh:
        from launcher.prices import live_offers, snapshot_offers, write

        try:
            data = snapshot_offers() if args.snapshot else live_offers()
        except RuntimeError as e:
            hint = (
                "" if args.snapshot else "; forgesky prices --refresh --snapshot reads the snapshot"
            )
            raise UserError(f"{e}{hint}") from None
        write(data)
        price_book.cache_clear()
        print(
            f"wrote {OFFERS_FILE}: {len(data['offers'])} offers, {data['source']}, {data['date']}"
        )
    book = price_book()
    if args.json:
        print(
            _json(
                {"source": book.source, "date": book.date, "offers": [vars(o) for o in book.offers]}
            )
        )
        return 0
    rows = [("TYPE", "GPUS", "CLOUD", "INSTANCE", "ON DEMAND $/H", "REGION", "SPOT $/H", "REGION")]
    for o in book.offers:
        rows.append(
            (
                o.accelerator,
                str(o.count),
                o.cloud,
                o.instance_type,
                dollars(o.on_demand) if o.on_demand is not None else "-",
                o.on_demand_region or "-",
                dollars(o.spot) if o.spot is not None else "-",
                o.spot_region or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"prices: {book.words} (cheapest region of each instance type)")
    return 0
