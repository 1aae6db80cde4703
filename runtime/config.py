"""What one run needs to know: the recipe, its plan and where its outputs go."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunConfig:
    recipe: Any  # recipes.Recipe
    plan: Any  # recipes.Plan
    run_dir: Path
    wandb_mode: str = "disabled"

    @property
    def steps(self) -> int:
        return self.recipe.grpo.steps

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"
