"""Episodes in the run's rollout loop: one call's prompts become groups of episodes, run with
the generator replica's turns batched across them, and come back as the rollout groups the
buffer and the trainer take (runtime/control/buffer.py), with a response mask and per-token
policy versions. The episodes' environments are the run's environment workers
(runtime/environments/workers.py), started with the run and shut down with it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from runtime.control.buffer import Group
from runtime.environments.api import Environments
from runtime.episodes.formats import ToolFormat, tool_format
from runtime.episodes.loop import Episode, EpisodeRunner, Generate, Limits, Turn, episode_stats

# (prompts as token ids, most new tokens, seed) -> the generator's completions (dicts)
Continue = Callable[[list[list[int]], int, int], Awaitable[list[dict[str, Any]]]]


def limits_of(recipe: Any) -> Limits:
    """An episode's bounds from the recipe's `env` and `grpo` sections."""
    e, g = recipe.env, recipe.grpo
    return Limits(
        max_turns=e.max_turns,
        max_tokens=g.max_response_tokens,
        max_turn_tokens=e.max_turn_tokens or g.max_response_tokens,
        turn_rewards=e.turn_rewards,
        max_episode_tokens=e.episode_tokens(g),
        max_prompt_tokens=g.max_prompt_tokens,
    )


class Spans:
    """Wall seconds during which at least one of some spans that may overlap was open: a
    replica's episode calls (its lanes), or its turn calls. `clock`: the seconds' source."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._open = 0
        self._since = 0.0
        self._seconds = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        if not self._open:
            self._since = self._clock()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if not self._open:
                self._seconds += self._clock() - self._since

    def take(self, now: float) -> float:
        """The seconds since the last take, a span still open counted up to `now`."""
        seconds, self._seconds = self._seconds, 0.0
        if self._open:
            seconds += now - self._since
            self._since = now
        return seconds


class EpisodeRollout:
    """The episodes of a run: their environments, format and limits, and the `episode/`
    metrics of the episodes since the last step record. `batches_in_flight`: the episode
    calls a generator replica runs at once (env.batches_in_flight; the rollout loop's lanes)."""

    def __init__(
        self,
        environments: Environments,
        fmt: ToolFormat,
        limits: Limits,
        group_size: int,
        batches_in_flight: int = 1,
    ) -> None:
        self.environments = environments
        self.fmt = fmt
        self.limits = limits
        self.group_size = group_size
        self.batches_in_flight = batches_in_flight
        # since the last take_stats: the episodes, the seconds waiting on the environments
        # (summed over the calls), and per replica the spans of its calls and of its turns
        self._episodes: list[Episode] = []
        self._env_wait_s = self._open_s = self._close_s = 0.0
        self._calls: defaultdict[int, Spans] = defaultdict(Spans)
        self._sampling: defaultdict[int, Spans] = defaultdict(Spans)
        self._counted = environments.counters()

    @classmethod
    async def start(
        cls,
        recipe: Any,
        tokenizer: Any = None,
        *,
        in_process: bool = False,
        environments: Any = None,
        workers: int | None = None,
    ) -> EpisodeRollout:
        """The run's episodes, their environment workers started (`workers` of them, by default
        env.workers_per_node; `in_process`: hosted in this process instead, for tests;
        `environments`: a hosting started already). A hosting that cannot start ends the run in
        one line."""
        from runtime.environments.start import start_environments

        if tokenizer is None:
            from runtime.backends.build import load_tokenizer

            tokenizer = load_tokenizer(recipe)
        fmt = tool_format(recipe.model.family, tokenizer, recipe.model.thinking)
        if environments is None:
            environments = await start_environments(
                recipe.env, in_process=in_process, workers=workers
            )
        return cls(
            environments,
            fmt,
            limits_of(recipe),
            recipe.grpo.group_size,
            recipe.env.batches_in_flight,
        )

    async def shutdown(self) -> None:
        """Stop the environments' workers (the run's end, a stop, a failure)."""
        stop = getattr(self.environments, "shutdown", None)
        if stop is not None:
            await stop()

    async def play(
        self, prompts: list[Any], seeds: list[int], n: int, generate: Continue
    ) -> list[Episode]:
        """`n` episodes of each prompt, prompt-major, each opened with its prompt's environment
        seed: a prompt's episodes face the same world, so their rewards compare. Neither the
        episodes nor their seconds join the rollout's metrics (an evaluation's)."""
        runner = self._runner(generate)
        return await runner.run(*self._rows(prompts, seeds, n))

    async def groups(
        self, prompts: list[Any], seed: int, generate: Continue, replica: int = 0
    ) -> list[Group]:
        """`group_size` episodes of each prompt (as `play`, a seed a prompt drawn from the
        call's), as one group per prompt, in order; `replica` the generator replica whose
        turns they take (for the idle metrics: its calls may overlap)."""
        n = self.group_size
        seeds = [seed + 7919 * i for i in range(len(prompts))]
        sampling = self._sampling[replica]

        async def timed(prompts: list[list[int]], most: int, seed: int) -> list[dict[str, Any]]:
            with sampling.span():
                return await generate(prompts, most, seed)

        runner = self._runner(timed)
        try:
            with self._calls[replica].span():
                episodes = await runner.run(*self._rows(prompts, seeds, n))
        finally:
            self._env_wait_s += runner.env_wait_s
            self._open_s += runner.open_s
            self._close_s += runner.close_s
        self._episodes += episodes
        return [episode_group(p, episodes[i * n : (i + 1) * n]) for i, p in enumerate(prompts)]

    def _runner(self, generate: Continue) -> EpisodeRunner:
        return EpisodeRunner(self.environments, self.fmt, _turns(generate), self.limits)

    @staticmethod
    def _rows(
        prompts: list[Any], seeds: list[int], n: int
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The rows and environment seeds of `n` episodes of each prompt, prompt-major."""
        rows, opened = [], []
        for p, seed in zip(prompts, seeds, strict=True):
            row = {"id": p.id, "question": p.text, "answer": p.answer, "messages": p.messages()}
            rows += [row] * n
            opened += [seed & 0x7FFFFFFF] * n
        return rows, opened

    def take_stats(self) -> dict[str, float]:
        """The `episode/` metrics since the last call (docs/tools.md, Metrics): the counts in
        every record (0 where no call ended since the last), the means where an episode ended."""
        stats = episode_stats(self._episodes)
        counters = self.environments.counters()
        stats["episode/workers_lost"] = counters["workers_lost"] - self._counted["workers_lost"]
        # a replica idles while one of its calls is open and none of its turns samples (or
        # waits for its GPU's turn); summed over the replicas
        now = time.perf_counter()
        calls = sum(spans.take(now) for spans in self._calls.values())
        sampling = sum(spans.take(now) for spans in self._sampling.values())
        idle = max(0.0, calls - sampling)
        stats["episode/env_wait_s"] = self._env_wait_s
        stats["episode/open_s"] = self._open_s
        stats["episode/close_s"] = self._close_s
        stats["episode/sampling_s"] = sampling
        stats["episode/generator_idle_s"] = idle
        if calls > 0:
            stats["episode/generator_idle_share"] = idle / calls
        self._episodes, self._counted = [], counters
        self._env_wait_s = self._open_s = self._close_s = 0.0
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
    kept = [ep for ep in episodes if not ep.dropped]
    first = kept[0].prompt_ids if kept else episodes[0].prompt_ids
    if any(ep.prompt_ids != first for ep in kept):
        raise ValueError(
            f"prompt {prompt.id}: the episodes of one group opened differently; an environment "
            "must open alike for the same row and seed"
        )
    dropped = len(kept) < len(episodes)
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
