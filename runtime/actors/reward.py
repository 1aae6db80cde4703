"""The reward actor: scores completions on CPU procs with the recipe's reward mix."""

from __future__ import annotations

from typing import Any

from monarch.actor import Actor, endpoint


class RewardActor(Actor):
    def __init__(self) -> None:
        self.mix: Any = None

    @endpoint
    async def setup(self, rewards: list[dict[str, Any]]) -> list[str]:
        """Resolve every reward now, so a missing module fails before training starts. A recipe
        with episodes may have none (its environments score): nothing to resolve."""
        from runtime.tasks.rewards import build_reward_fn

        if not rewards:
            return []
        self.mix = build_reward_fn(rewards)
        return list(self.mix.fns)

    @endpoint
    async def score(
        self, items: list[tuple[str, str, str]]
    ) -> list[tuple[float, dict[str, float]]]:
        """(prompt, completion, answer) triples -> (total, per-reward scores)."""
        return [self.mix(prompt, completion, answer) for prompt, completion, answer in items]
