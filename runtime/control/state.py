"""The controller's part of a checkpoint: where training, data, randomness and rollouts stood.

Saved next to the trainer's state as `controller.pt`; together they make a resume pick up
exactly where the run was: the same step numbers, the same prompts next, the same seeds, the
groups generated but not yet trained on, and the same W&B run.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.control.buffer import Group

FILE = "controller.pt"


@dataclass
class ControllerState:
    step: int
    version: int
    generate_calls: int
    data: dict[str, Any]  # the prompt source's position
    python_rng: Any
    torch_rng: torch.Tensor
    buffer: list[Group]  # oldest first
    wandb_run_id: str | None = None

    @classmethod
    def capture(
        cls,
        *,
        step: int,
        version: int,
        generate_calls: int,
        source: Any,
        groups: list[Group],
        wandb_run_id: str | None,
    ) -> ControllerState:
        return cls(
            step=step,
            version=version,
            generate_calls=generate_calls,
            data=source.state_dict(),
            python_rng=random.getstate(),
            torch_rng=torch.get_rng_state(),
            buffer=list(groups),
            wandb_run_id=wandb_run_id,
        )

    def save(self, directory: Path) -> None:
        state = asdict(self)
        state["buffer"] = [asdict(gr) for gr in self.buffer]
        torch.save(state, directory / FILE)

    @classmethod
    def load(cls, directory: Path) -> ControllerState:
        state = torch.load(directory / FILE, weights_only=False)
        return cls(
            step=state["step"],
            version=state["version"],
            generate_calls=state["generate_calls"],
            data=state["data"],
            python_rng=state["python_rng"],
            torch_rng=state["torch_rng"],
            buffer=[Group(**group) for group in state["buffer"]],
            wandb_run_id=state.get("wandb_run_id"),
        )

    def apply_rngs(self) -> None:
        random.setstate(self.python_rng)
        torch.set_rng_state(self.torch_rng)
