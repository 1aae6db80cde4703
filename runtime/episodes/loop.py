"""The episode loop: many episodes at once, one generator call per turn for all of them.

Each round samples the next turn of every episode still running in one batched call, parses
each turn in its family's format (runtime/episodes/formats.py), steps the environments of the
turns that called tools (concurrently: a slow tool holds up only the round, never another
episode's step), appends the tool messages and starts the next round. An episode ends when the
model answers without a tool call, the environment says it is done, it has had `max_turns`
turns, or its tokens after the prompt reach `max_tokens`; `close` then gives its reward (None:
the episode is dropped and counted).

The training sequence of an episode is its prompt and every turn; `generated` marks the tokens
the model sampled (the only ones with loss, KL and log-probs), and `versions` the policy
version of the turn that sampled each (-1 on the environment's and the template's tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.environments.api import Environments, ToolCall
from runtime.episodes.formats import ToolFormat

NOT_GENERATED = -1  # the version of a token the model did not sample


@dataclass(frozen=True)
class Limits:
    """An episode's bounds: turns of the model, tokens after the prompt (the model's and the
    tools'), tokens of one turn, tokens of the whole episode (its opening prompt included;
    None: no bound past `max_tokens`); `turn_rewards` adds the steps' rewards to the closing
    one."""

    max_turns: int
    max_tokens: int
    max_turn_tokens: int
    turn_rewards: bool = False
    max_episode_tokens: int | None = None
    # an opening prompt keeps its last max_prompt_tokens tokens, as a single-turn prompt does
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")


@dataclass(frozen=True)
class Turn:
    """One sampled turn: its tokens, their log-probs, the version that sampled them, and
    whether it stopped on an end token ("stop") or at the length limit ("length")."""

    ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str


# (prompts as token ids, most new tokens, seed) -> one turn per prompt, in order
Generate = Callable[[list[list[int]], int, int], Awaitable[list[Turn]]]


@dataclass
class Episode:
    """One episode's record (see the module docstring)."""

    row: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # malformed turns and calls that failed
    malformed: int = 0
    tool_s: float = 0.0
    turn_reward: float = 0.0
    reward: float | None = None
    answer: str = ""
    end: str = ""  # answer, done, max_turns, max_tokens
    finish_reason: str = "stop"  # "length" when the last turn was cut
    episode: str = ""
    _running: bool = True

    @property
    def dropped(self) -> bool:
        return self.reward is None

    @property
    def oldest_version(self) -> int:
        generated = [v for v in self.versions if v != NOT_GENERATED]
        return min(generated) if generated else 0

    def _add(self, ids: Sequence[int], logprobs: Sequence[float] | None, version: int) -> None:
        self.tokens.extend(ids)
        self.generated.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version if logprobs is not None else NOT_GENERATED] * len(ids))


def malformed_text(reason: str) -> str:
    """The observation that answers a turn whose tool call could not be read."""
    return f"error: malformed tool call ({reason}); write one call per block, valid JSON"


class EpisodeRunner:
    """Runs episodes of one format against one `Environments`, generating through `generate`."""

    def __init__(
        self,
        environments: Environments,
        fmt: ToolFormat,
        generate: Generate,
        limits: Limits,
    ) -> None:
        self.environments = environments
        self.fmt = fmt
        self.generate = generate
        self.limits = limits
        # wall seconds of `run` spent in generator calls, and waiting on the environments
        # (opening the episodes, each round's tool calls, closing them), and of those the
        # opening and the closing alone
        self.generate_s = 0.0
        self.env_wait_s = 0.0
        self.open_s = 0.0
        self.close_s = 0.0

    async def run(self, rows: list[dict[str, Any]], seeds: list[int]) -> list[Episode]:
        """One episode per row (opened with its seed), in order."""
        episodes = [Episode(row=dict(r)) for r in rows]
        start = time.perf_counter()
        openings = await asyncio.gather(
            *(self.environments.open(r, s) for r, s in zip(rows, seeds, strict=True))
        )
        self.open_s = time.perf_counter() - start
        self.env_wait_s += self.open_s
        for ep, opening in zip(episodes, openings, strict=True):
            ep.episode = opening.episode
            messages = opening.messages or ep.row.get("messages") or []
            if not messages:
                raise ValueError("an episode needs messages: from its environment or its row")
            ids = self.fmt.prompt_ids(messages, opening.tools)
            most = self.limits.max_prompt_tokens
            ep.prompt_ids = ids[-most:] if most is not None and len(ids) > most else ids
        seed = seeds[0] if seeds else 0
        round_ = 0
        while running := [ep for ep in episodes if ep._running]:
            # the turn may use what is left of the episode's budget, at most max_turn_tokens
            most = max(self._room(ep) for ep in running)
            prompts = [ep.prompt_ids + ep.tokens for ep in running]
            start = time.perf_counter()
            turns = await self.generate(prompts, most, seed + round_)
            steps = time.perf_counter()
            self.generate_s += steps - start
            round_ += 1
            parsed = [(ep, self._record(ep, t)) for ep, t in zip(running, turns, strict=True)]
            stepping = [(ep, calls, results) for ep, (calls, results) in parsed if ep._running]
            start = time.perf_counter()
            ended = await asyncio.gather(*(self._calls(*s) for s in stepping))
            self.env_wait_s += time.perf_counter() - start
            for (ep, _, results), done in zip(stepping, ended, strict=True):
                self._follow(ep, results, done)
        start = time.perf_counter()
        await asyncio.gather(*(self._close(ep) for ep in episodes))
        self.close_s = time.perf_counter() - start
        self.env_wait_s += self.close_s
        return episodes

    def _left(self, ep: Episode) -> int:
        """The tokens the episode may still add after its prompt."""
        left = self.limits.max_tokens - len(ep.tokens)
        if self.limits.max_episode_tokens is not None:
            left = min(left, self.limits.max_episode_tokens - len(ep.prompt_ids) - len(ep.tokens))
        return left

    def _room(self, ep: Episode) -> int:
        return max(1, min(self.limits.max_turn_tokens, self._left(ep)))

    def _record(self, ep: Episode, turn: Turn) -> tuple[list[ToolCall], list[str]]:
        """Record a turn and parse it: the calls to step and the results so far (a malformed
        turn's error); the episode ends here where the turn answered."""
        room = self._room(ep)
        ids, logprobs, finish = turn.ids, turn.logprobs, turn.finish_reason
        if len(ids) > room:
            ids, logprobs, finish = ids[:room], logprobs[:room], "length"
        ep._add(ids, logprobs, turn.version)
        ep.turns += 1
        ep.finish_reason = finish
        parsed = self.fmt.parse(self.fmt.tokenizer.decode(ids, skip_special_tokens=False))
        ep.answer = parsed.content
        if parsed.malformed is None and not parsed.calls:
            self._end(ep, "answer")
            return [], []
        results: list[str] = []
        if parsed.malformed is not None:
            ep.malformed += 1
            ep.tool_errors += 1
            results.append(malformed_text(parsed.malformed))
        return list(parsed.calls), results

    async def _calls(self, ep: Episode, calls: list[ToolCall], results: list[str]) -> bool:
        """Step one episode's calls in order, appending their results; whether the environment
        ended the episode."""
        for call in calls:
            text, done = await self._step(ep, call)
            results.append(text)
            if done:
                return True
        return False

    def _follow(self, ep: Episode, results: list[str], done: bool) -> None:
        """Append the results of a turn's calls, or end the episode."""
        if done:
            return self._end(ep, "done")
        if ep.turns >= self.limits.max_turns:
            return self._end(ep, "max_turns")
        follow = self.fmt.observation_ids(results, turn_closed=ep.finish_reason == "stop")
        if len(follow) >= self._left(ep):
            return self._end(ep, "max_tokens")
        ep._add(follow, None, NOT_GENERATED)

    async def _step(self, ep: Episode, call: ToolCall) -> tuple[str, bool]:
        ep.tool_calls += 1
        result = await self.environments.step(ep.episode, call)
        ep.tool_s += result.seconds
        if result.error is not None:
            ep.tool_errors += 1
        if result.reward is not None:
            ep.turn_reward += result.reward
        return result.text, result.done

    def _end(self, ep: Episode, why: str) -> None:
        ep.end = why
        ep._running = False

    async def _close(self, ep: Episode) -> None:
        reward = await self.environments.close(ep.episode, ep.answer)
        if reward is not None and self.limits.turn_rewards:
            reward += ep.turn_reward
        ep.reward = reward


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """The `episode/` metrics of some episodes (sums, and means over those kept)."""
    kept = [ep for ep in episodes if not ep.dropped]
    stats = {
        "episode/tool_calls": float(sum(ep.tool_calls for ep in episodes)),
        "episode/tool_errors": float(sum(ep.tool_errors for ep in episodes)),
        "episode/malformed_calls": float(sum(ep.malformed for ep in episodes)),
        "episode/tool_s": sum(ep.tool_s for ep in episodes),
        "episode/dropped": float(len(episodes) - len(kept)),
    }
    if kept:
        stats["episode/turns_mean"] = sum(ep.turns for ep in kept) / len(kept)
    return stats
