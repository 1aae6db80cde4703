"""Recipes: what a GRPO run is (schema, catalog) and where it runs (planner, memory estimate).

Torch-free and SkyPilot-free: the launcher on a laptop and the runtime on a node both import it.
Names load on first use, so `from recipes import UserError` costs nothing and only the commands
that validate a recipe pay for the schema (pydantic).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Arch": "recipes.architectures",
    "architecture": "recipes.architectures",
    "UserError": "recipes.errors",
    "apply_overrides": "recipes.loader",
    "catalog_path": "recipes.loader",
    "list_recipes": "recipes.loader",
    "load_recipe": "recipes.loader",
    "validate_recipe": "recipes.loader",
    "estimate_memory": "recipes.memory",
    "Placement": "recipes.placements",
    "Plan": "recipes.plan_words",
    "dedicated_gpus": "recipes.gpu_plan",
    "minimum_gpus": "recipes.planner",
    "launch_gpus": "recipes.planner",
    "plan": "recipes.planner",
    "Recipe": "recipes.schema",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
