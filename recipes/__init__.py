"""Recipes: what a GRPO run is (schema, catalog) and where it runs (planner, memory estimate).

Torch-free and SkyPilot-free: the launcher on a laptop and the runtime on a node both import it.
"""

from recipes.architectures import Arch, architecture
from recipes.errors import UserError
from recipes.loader import apply_overrides, catalog_path, list_recipes, load_recipe, validate_recipe
from recipes.memory import estimate_memory
from recipes.planner import Placement, Plan, minimum_gpus, plan
from recipes.schema import Recipe

__all__ = [
    "Arch",
    "Placement",
    "Plan",
    "Recipe",
    "UserError",
    "apply_overrides",
    "architecture",
    "catalog_path",
    "estimate_memory",
    "list_recipes",
    "load_recipe",
    "minimum_gpus",
    "plan",
    "validate_recipe",
]
