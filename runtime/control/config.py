"""What one run needs to know: the recipe, its plan and where its outputs go."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.procs.cluster import Cluster


@dataclass(frozen=True)
class RunConfig:
    recipe: Any  # recipes.Recipe
    plan: Any  # recipes.Plan
    run_dir: Path
    wandb_mode: str = "disabled"
    cluster: Cluster = field(default_factory=Cluster)  # the nodes (one unless on a cluster)
    join_timeout: float = 300.0  # seconds the controller waits for every node to join

    @property
    def steps(self) -> int:
        return self.recipe.grpo.steps

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"
