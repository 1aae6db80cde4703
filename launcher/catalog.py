"""The recipe commands that stay on the laptop: list, show, copy, validate.

No SkyPilot and no torch here: these answer in a fraction of a second. `recipes` and `show NAME`
read the catalog's index (recipes/catalog/index.json, written with sky/ by
`python -m launcher.write_sky` from the validated recipes, and checked by a test), so listing
the catalog needs no schema at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from recipes.errors import UserError

INDEX = Path(__file__).resolve().parent.parent / "recipes" / "catalog" / "index.json"


def compute_rows() -> list[dict[str, Any]]:
    """One dict per catalog recipe, from the validated recipes: what the index holds."""
    from recipes import dedicated_gpus, list_recipes, load_recipe, minimum_gpus

    rows = []
    for name in list_recipes():
        recipe = load_recipe(name)
        rows.append(
            {
                "name": recipe.name,
                "model": recipe.model.hf_id,
                "family": recipe.model.family,
                "size": recipe.model.size,
                "params": recipe.arch.params,
                "min_gpus": dedicated_gpus(recipe),
                "min_gpus_shared": minimum_gpus(recipe),
                "accelerator": recipe.resources.accelerator,
                "gated": recipe.model.gated,
                "description": recipe.description,
                "derived": derived_summary(recipe),
            }
        )
    return rows


def index_text() -> str:
    """The catalog index as written to recipes/catalog/index.json."""
    return json.dumps(compute_rows(), indent=1) + "\n"


def _index() -> list[dict[str, Any]]:
    return json.loads(INDEX.read_text())


def recipe_rows() -> list[dict[str, Any]]:
    """One dict per catalog recipe: what `forgesky recipes --json` prints."""
    return [{k: v for k, v in row.items() if k != "derived"} for row in _index()]


def recipes_table(rows: list[dict[str, Any]]) -> str:
    """The catalog as a table for people."""
    header = ("NAME", "MODEL", "PARAMS", "MIN GPUS", "SHARING", "ON", "GATED")
    body = [
        (
            r["name"],
            r["model"],
            _params(r["params"]),
            str(r["min_gpus"]),
            str(r["min_gpus_shared"]) if r["min_gpus_shared"] < r["min_gpus"] else "-",
            r["accelerator"],
            "yes" if r["gated"] else "no",
        )
        for r in rows
    ]
    table = [header, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]
    lines.append("")
    lines.append(
        "MIN GPUS: every service on GPUs of its own; SHARING: the least GPUs where services "
        "share them and take turns"
    )
    lines.append("forgesky show NAME · forgesky plan NAME --gpus N · forgesky cp NAME my.yaml")
    return "\n".join(lines)


def recipe_source(source: str) -> Path:
    """The YAML file behind NAME: the catalog file, or the path itself."""
    from launcher.options import is_recipe_file
    from recipes.loader import catalog_path

    if is_recipe_file(source):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"recipe file not found: {source}")
        return path
    return catalog_path(source)


def show(source: str) -> str:
    """The recipe's YAML as written, then what forgesky derives from it."""
    row = next((r for r in _index() if r["name"] == source), None)
    if row is not None:  # a catalog recipe: validated when the index was written
        derived = row["derived"]
    else:
        from recipes import load_recipe

        derived = derived_summary(load_recipe(source))
    path = INDEX.parent / f"{source}.yaml" if row is not None else recipe_source(source)
    return f"{path.read_text().rstrip()}\n\n{derived}"


def derived_summary(recipe: Any) -> str:
    """Comment lines: the minimum GPUs and where to go next."""
    from recipes import dedicated_gpus, minimum_gpus

    if recipe.cpu:
        return f"# derived: runs on CPU (0 GPUs); forgesky local {recipe.name}"
    need, least = dedicated_gpus(recipe), minimum_gpus(recipe)
    lay = recipe.layout
    if recipe.kind == "sft":
        return (
            f"# derived: minimum {need} x {recipe.resources.accelerator} = trainer {need} (SFT: "
            f"no generator, no reference); see forgesky plan {recipe.name} --gpus {need}"
        )
    reference = f" + reference {lay.reference.gpus}" if lay.reference.on_gpu else ""
    inside = " (the reference in its processes)" if lay.reference.in_trainer else ""
    line = (
        f"# derived: minimum {need} x {recipe.resources.accelerator} = generator "
        f"{lay.generator.tp * lay.generator.replicas}{reference} + trainer {lay.trainer.gpus}"
        f"{inside}; see forgesky plan {recipe.name} --gpus {need}"
    )
    if least < need:
        line += (
            f"\n# derived: {least} x {recipe.resources.accelerator} with services sharing GPUs; "
            f"forgesky plan {recipe.name} --gpus {least} --explain"
        )
    return line


def copy_recipe(source: str, dest: str, force: bool = False) -> Path:
    """Copy a recipe's YAML (comments and all) to `dest` for editing; returns the new file."""
    src = recipe_source(source)
    if not dest.strip():
        raise UserError("cp needs a FILE or folder to copy the recipe to; got a blank one")
    target = Path(dest)
    if dest.endswith(("/", os.sep)) and not target.is_dir():
        raise UserError(f"cannot write into {dest}: no such directory")
    if target.is_dir():
        target = target / src.name
    if target.exists() and not force:
        raise UserError(f"{target} already exists; pass --force to overwrite it")
    if target.resolve() == src.resolve():
        raise UserError(f"{target} is the recipe itself; copy it somewhere else")
    if not target.parent.is_dir():
        raise UserError(f"cannot write {target}: directory {target.parent} does not exist")
    target.write_text(src.read_text())
    return target


def validate(
    source: str, gpus: int | None, overrides: tuple[str, ...], *, allow_idle: bool = False
) -> str:
    """Load, override and plan a recipe; one line saying it is fine (else UserError)."""
    from launcher.files import local_files
    from launcher.options import check_references, say_if_unsold
    from recipes import (
        apply_overrides,
        dedicated_gpus,
        launch_gpus,
        load_recipe,
        minimum_gpus,
        plan,
    )
    from recipes.sft_rows import check_local_data

    recipe = apply_overrides(load_recipe(source), list(overrides))
    check_references(recipe, source)
    local_files(recipe)  # what launch would refuse to bring to the nodes
    count = launch_gpus(recipe) if gpus is None else gpus
    run_plan = plan(recipe, count)
    check_local_data(recipe)  # an SFT recipe's local data, read without a tokenizer
    if gpus is not None and not allow_idle:
        from recipes.run_cost import check_idle

        check_idle(recipe, run_plan, count)
    say_if_unsold(run_plan, count)
    if run_plan.cpu:
        return f"{source}: ok (recipe {recipe.name}, {recipe.model.hf_id}; plans on CPU)"
    need, shared = dedicated_gpus(recipe), minimum_gpus(recipe)
    each = "for the trainer (SFT)" if recipe.kind == "sft" else "with a GPU for each service"
    least = f"minimum {need} GPU{'' if need == 1 else 's'} {each}" + (
        f", {shared} with services sharing" if shared < need else ""
    )
    return (
        f"{source}: ok (recipe {recipe.name}, {recipe.model.hf_id}, {least}; plans on "
        f"{count} x {run_plan.accelerator})"
    )


def _params(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.{1 if count < 1e7 else 0}f}M"
    return f"{count / 1e3:.0f}K"
