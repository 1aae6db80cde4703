"""Episodes in the run's rollout loop: one call's prompts become groups of episodes, run with
the generator replica's turns batched across them, and come back as the rollout groups the
buffer and the trainer take (runtime/control/buffer.py), with a response mask and per-token
policy versions."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from runtime.control.buffer import Group
from runtime.environments.api import Environments
from runtime.episodes.formats import ToolFormat, tool_format
from runtime.episodes.loop import Episode, EpisodeRunner, Generate, Limits, Turn, episode_stats

# (prompts as token ids, most new tokens, seed) -> the generator's completions (dicts)
Continue = Callable[[list[list[int]], int, int], Awaitable[list[dict[str, Any]]]]


def environments_for(env: Any) -> Environments:
    """The environments a recipe's `env` section names."""
    if env.name == "builtin:tiny-tools":
        from runtime.episodes.local import tiny_tools_environments

        return tiny_tools_environments()
    from runtime.environments.host import Spec
    from runtime.environments.local import LocalEnvironments

    return LocalEnvironments(
        Spec.from_section(env),
        call_timeout_s=env.call_timeout_s,
        episode_timeout_s=env.episode_timeout_s,
    )


class EpisodeRollout:
    """The episodes of a run: their environments, format and limits."""

    def __init__(
        self, environments: Environments, fmt: ToolFormat, limits: Limits, group_size: int
    ) -> None:
        self.environments = environments
        self.fmt = fmt
        self.limits = limits
        self.group_size = group_size
        self._episodes: list[Episode] = []  # since the last take_stats

    @classmethod
    def from_recipe(cls, recipe: Any, tokenizer: Any = None) -> EpisodeRollout:
        if tokenizer is None:
            from runtime.backends.build import load_tokenizer

            tokenizer = load_tokenizer(recipe)
        e, g = recipe.env, recipe.grpo
        limits = Limits(
            max_turns=e.max_turns,
            max_tokens=g.max_response_tokens,
            max_turn_tokens=e.max_turn_tokens or g.max_response_tokens,
            turn_rewards=e.turn_rewards,
            max_episode_tokens=e.episode_tokens(g),
        )
        fmt = tool_format(recipe.model.family, tokenizer, recipe.model.thinking)
        return cls(environments_for(e), fmt, limits, g.group_size)

    async def play(
        self, prompts: list[Any], seeds: list[int], n: int, generate: Continue
    ) -> list[Episode]:
        """`n` episodes of each prompt, prompt-major, each opened with its prompt's environment
        seed: a prompt's episodes face the same world, so their rewards compare."""
        rows, opened = [], []
        for p, seed in zip(prompts, seeds, strict=True):
            row = {"id": p.id, "question": p.text, "answer": p.answer, "messages": p.messages()}
            rows += [row] * n
            opened += [seed & 0x7FFFFFFF] * n
        runner = EpisodeRunner(self.environments, self.fmt, _turns(generate), self.limits)
        return await runner.run(rows, opened)

    async def groups(self, prompts: list[Any], seed: int, generate: Continue) -> list[Group]:
        """`group_size` episodes of each prompt (`play`, a seed a prompt drawn from the call's),
        as one group per prompt, in order."""
        n = self.group_size
        seeds = [seed + 7919 * i for i in range(len(prompts))]
        episodes = await self.play(prompts, seeds, n, generate)
        self._episodes += episodes
        return [episode_group(p, episodes[i * n : (i + 1) * n]) for i, p in enumerate(prompts)]

    def take_stats(self) -> dict[str, float]:
        """The `episode/` metrics of the episodes since the last call."""
        stats = episode_stats(self._episodes) if self._episodes else {}
        self._episodes = []
        return stats


def _turns(generate: Continue) -> Generate:
    async def turns(prompts: list[list[int]], most: int, seed: int) -> list[Turn]:
        out = await generate(prompts, most, seed)
        return [
            Turn(
                c["response_ids"],
                # none where the turn was not sampled for training (an evaluation's)
                c["response_logprobs"] or [0.0] * len(c["response_ids"]),
                c["policy_version"],
                c["finish_reason"],
            )
            for c in out
        ]

    return turns


def episode_group(prompt: Any, episodes: list[Episode]) -> Group:
    """One prompt's episodes as a rollout group: the response is every turn after the opening,
    masked to the model's tokens; `policy_version` the oldest turn's. A group with a dropped
    episode has no rewards (`dropped`): the rollout loop leaves it out and counts it."""
    first = episodes[0].prompt_ids
    if any(ep.prompt_ids != first for ep in episodes):
        raise ValueError(
            f"prompt {prompt.id}: the episodes of one group opened differently; an environment "
            "must open alike for the same row and seed"
        )
    dropped = any(ep.dropped for ep in episodes)
    return Group(
        prompt_id=prompt.id,
        prompt=prompt.text,
        answer=prompt.answer,
        prompt_tokens=list(first),
        responses=[ep.tokens for ep in episodes],
        response_logprobs=[ep.logprobs for ep in episodes],
        texts=[ep.answer for ep in episodes],
        policy_version=min(ep.oldest_version for ep in episodes),
        rewards=[] if dropped else [float(ep.reward) for ep in episodes],  # type: ignore[arg-type]
        reward_parts={} if dropped else {"environment": [float(ep.reward) for ep in episodes]},  # type: ignore[arg-type]
        truncated=[ep.finish_reason == "length" for ep in episodes],
        response_masks=[ep.generated for ep in episodes],
        token_versions=[ep.versions for ep in episodes],
    )
