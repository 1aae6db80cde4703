"""The trainer actor: owns the policy and its optimizer, publishes each policy version."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from monarch.actor import Actor, endpoint

from runtime import services


class TrainerActor(Actor):
    def __init__(self) -> None:
        self.backend: Any = None
        self.store: Any = None
        self.recipe: Any = None

    @endpoint
    async def setup(self, recipe: Any, store: Any) -> dict[str, Any]:
        """Build the model (pretrained or seeded init) and the optimizer."""
        self.recipe, self.store = recipe, store
        torch.manual_seed(recipe.grpo.seed)
        spec = services.model_spec(recipe)
        self.backend = services.build_trainer(recipe)
        return {
            "params": spec.num_params(),
            "device": str(services.device()),
            "backend": type(self.backend).__name__,
        }

    @endpoint
    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on a collated batch (see Controller._train_batch)."""
        from runtime.grpo import policy_loss

        g = self.recipe.grpo
        start = time.perf_counter()
        stats = self.backend.train_step(
            batch["tokens"],
            batch["response_mask"],
            batch["advantages"],
            batch["old_logprobs"],
            batch["ref_logprobs"],
            policy_loss,
            variant=g.loss,
            clip_low=g.clip_low,
            clip_high=g.clip_high,
            kl_beta=g.kl_beta,
            max_response_tokens=g.max_response_tokens,
        )
        stats["time/train_s"] = time.perf_counter() - start
        return stats

    @endpoint
    async def publish(self, version: int) -> dict[str, float]:
        """Put the current weights (HF names) into the store as `version`."""
        stats = await self.store.publish(version, self.backend.hf_state_dict())
        return {"bytes": stats.bytes, "seconds": stats.seconds}

    @endpoint
    async def drop(self, version: int) -> None:
        await self.store.drop(version)

    @endpoint
    async def save(self, directory: str) -> None:
        """Write model, optimizer, scheduler and step into a checkpoint directory."""
        torch.save(self.backend.state_dict(), Path(directory) / "trainer.pt")

    @endpoint
    async def load(self, directory: str) -> int:
        """Restore from a checkpoint directory; returns the restored optimizer step."""
        state = torch.load(Path(directory) / "trainer.pt", map_location=services.device())
        self.backend.load_state_dict(state)
        return self.backend.step
