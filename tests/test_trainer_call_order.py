"""A LoRA run's trainer ranks serve two kinds of collective call, a train step and the reference's
scoring (the base with the adapter off), and the controller issues them from different loops,
so they can be in flight at once. Each rank must run them in the same order, or the ranks meet
in different collectives and hang: real Monarch procs, two FSDP ranks over gloo."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from monarch.actor import endpoint
from runtime_helpers import ROOT, token_batch

from recipes import apply_overrides, load_recipe, plan
from runtime.actors import TrainerActor
from runtime.backends import build
from runtime.control.services import Services, each_rank
from runtime.control.startup import group_env
from runtime.procs.mesh import ServiceMesh

pytestmark = pytest.mark.slow

# the procs import this module (the actor below) and this tree's runtime
PATHS = [str(Path(__file__).parent), str(ROOT), os.environ.get("PYTHONPATH", "")]
ENV = {"PYTHONPATH": os.pathsep.join(p for p in PATHS if p)}
TRAIN, SCORE = "train_step", "reference_logprobs"


class RecordingTrainer(TrainerActor):
    """The trainer actor, noting which of the two calls each of its ranks runs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.handled: list[str] = []

    @endpoint
    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        self.handled.append(TRAIN)
        return await TrainerActor.train_step._method(self, batch)

    @endpoint
    async def reference_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> Any:
        self.handled.append(SCORE)
        return await TrainerActor.reference_logprobs._method(self, tokens, mask)

    @endpoint
    async def calls(self) -> list[str]:
        return self.handled


class Supervision:
    """What Services calls through (RunLifecycle.call): each call a task of its own, as there;
    without the run's signal handling, which is not under test."""

    async def call(self, service: str, awaitable: Any, **_: Any) -> Any:
        return await asyncio.ensure_future(awaitable)


def test_a_train_step_and_a_reference_scoring_in_flight_at_once_reach_both_ranks_in_order():
    recipe = apply_overrides(load_recipe("tiny-lora"), ["trainer.ranks=2"])
    settings = plan(recipe, 0).settings
    assert settings.trainer.ranks == 2
    spec = build.model_spec(recipe)
    tokens, mask, advantages = token_batch(spec.vocab_size, 8, 14)
    batch = {
        "tokens": tokens,
        "response_mask": mask,
        "advantages": advantages,
        "old_logprobs": None,
        "ref_logprobs": None,
    }

    async def scenario() -> tuple[list[list[str]], list[Any], list[str]]:
        mesh = await ServiceMesh.spawn("trainer", 2, env={**ENV, **group_env(2)}, threads=1)
        try:
            trainer = mesh.spawn_actor(RecordingTrainer)
            await each_rank(trainer, "setup", recipe, settings, None)
            services = Services(
                Supervision(), trainer, [], None, None, 1, 0, reference_in_trainer=True
            )
            issued, scored = [], []
            for round in range(4):
                # as the controller does: the train loop and the rollout loop each issue theirs,
                # in either order, and both are in flight together
                order = [TRAIN, SCORE] if round % 2 == 0 else [SCORE, TRAIN]
                calls = {
                    TRAIN: lambda: services.train_step(batch),
                    SCORE: lambda: services.reference_logprobs(tokens, mask),
                }
                tasks = {name: asyncio.ensure_future(calls[name]()) for name in order}
                await asyncio.wait_for(asyncio.gather(*tasks.values()), timeout=120)
                issued += order
                scored.append(tasks[SCORE].result())
            return await each_rank(trainer, "calls"), scored, issued
        finally:
            await mesh.stop()

    handled, scored, issued = asyncio.run(scenario())
    assert handled == [issued, issued]
    # the reference is the frozen base whatever the steps between did to the adapter
    assert all(rows == scored[0] for rows in scored) and len(scored[0]) == tokens.shape[0]
