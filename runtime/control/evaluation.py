"""Evaluation during training: held-out prompts on the generators, at a version boundary.

Before the first step, every `eval.every` steps and after the last one, version v is evaluated
on the recipe's held-out split: each generator replica takes its share of the prompts once it
has loaded v (between two of its generate calls, so training goes on meanwhile and waits only
for what the generators spend on the evaluation), decodes one greedy completion per prompt and,
for pass@k, samples `eval.samples` at the run's temperature; the reward procs score them. A completion
is correct when the recipe's `eval.reward` (default: its first reward) scores at least
`eval.correct_at`.

A recipe with an `env` section is evaluated over episodes instead: each held-out prompt is
played as an episode in the run's environment (the same tools, turns and budgets as training;
the prompt's environment seed fixed, so every evaluation faces the same worlds), one greedy and
`eval.samples` sampled, turn by turn on the generator as the rollouts do, and an episode is
correct when the environment's reward is at least `eval.correct_at` (a dropped one is not).

Metrics (`eval/*`, with `eval/version`, the policy version evaluated): `pass@1` (greedy),
`mean@n` (the share of the n samples that are correct), `pass@k` (the unbiased estimator
1 - C(n-c, k) / C(n, k) over n samples with c correct), `reward_mean` (the greedy completions'
total reward), `prompts`, `seconds`; over episodes also `turns_mean`, `tool_calls_mean` and
`tool_errors_mean` (a greedy episode's model turns, tool calls and failed calls) and `dropped`
(episodes their environment lost). They join the next
step record, and the final evaluation the last step's (it supersedes an evaluation that is still
running when the last step ends).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from runtime.control.handles import ServiceHandles
from runtime.control.progress import Progress
from runtime.control.turns import GpuTurns


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --- one evaluation's arithmetic, shared with `forgesky eval` (runtime/evaluate.py) -------------


@dataclass(frozen=True)
class PromptResult:
    """How one held-out prompt fared: its greedy completion's correctness and total reward, and
    how many of its sampled completions were correct (None: none were sampled)."""

    greedy_correct: bool
    greedy_reward: float
    sampled_correct: int | None


def needs_samples(config: Any) -> bool:
    return config.samples_drawn > 1 or config.k > 1


def score_items(
    prompts: list[Any], greedy: list[str], sampled: list[str]
) -> list[tuple[str, str, str]]:
    """The (prompt, completion, answer) triples to score: every greedy completion (one a
    prompt), then the sampled ones (prompt-major, the same count a prompt)."""
    n = len(sampled) // len(prompts) if prompts else 0
    return [(p.text, text, p.answer) for p, text in zip(prompts, greedy, strict=True)] + [
        (prompts[i // n].text, text, prompts[i // n].answer) for i, text in enumerate(sampled)
    ]


def judge(
    scores: list[tuple[float, dict[str, float]]], prompts: int, config: Any, reward: str
) -> list[PromptResult]:
    """The scores of `score_items` as one PromptResult a prompt: a completion is correct when
    `reward` scores at least `config.correct_at`."""
    head, tail = scores[:prompts], scores[prompts:]
    n = len(tail) // prompts if prompts else 0

    def correct(parts: dict[str, float]) -> bool:
        return parts[reward] >= config.correct_at

    return [
        PromptResult(
            greedy_correct=correct(parts),
            greedy_reward=total,
            sampled_correct=sum(correct(p) for _, p in tail[i * n : (i + 1) * n]) if n else None,
        )
        for i, (total, parts) in enumerate(head)
    ]


def judge_episodes(greedy: list[Any], sampled: list[Any], config: Any) -> list[PromptResult]:
    """One PromptResult a prompt from its greedy episode and its sampled ones (prompt-major, the
    same count a prompt; runtime/episodes/loop.py Episode): an episode is correct when its
    environment's reward is at least `config.correct_at`; a dropped episode (no reward) is
    not, and counts 0 in the reward mean."""
    n = len(sampled) // len(greedy) if greedy else 0

    def correct(ep: Any) -> bool:
        return ep.reward is not None and ep.reward >= config.correct_at

    return [
        PromptResult(
            greedy_correct=correct(ep),
            greedy_reward=ep.reward or 0.0,
            sampled_correct=sum(map(correct, sampled[i * n : (i + 1) * n])) if n else None,
        )
        for i, ep in enumerate(greedy)
    ]


def episode_figures(greedy: list[Any], sampled: list[Any]) -> dict[str, float]:
    """What the evaluation's episodes did: a greedy episode's turns (over those kept), tool
    calls and failed calls, and the episodes lost (greedy and sampled)."""
    kept = [ep for ep in greedy if not ep.dropped]
    figures = {
        "eval/tool_calls_mean": statistics.fmean(ep.tool_calls for ep in greedy),
        "eval/tool_errors_mean": statistics.fmean(ep.tool_errors for ep in greedy),
        "eval/dropped": float(sum(ep.dropped for ep in [*greedy, *sampled])),
    }
    if kept:
        figures["eval/turns_mean"] = statistics.fmean(ep.turns for ep in kept)
    return figures


def episode_seeds(prompts: list[Any], seed: int) -> list[int]:
    """The environment seed of each held-out prompt: from its row, so a prompt faces the same
    world in every evaluation, however the prompts are shared out."""
    return [(seed + 7919 * p.id) & 0x7FFFFFFF for p in prompts]


def summarize(results: list[PromptResult], config: Any) -> dict[str, float]:
    """eval/pass@1 (greedy), eval/reward_mean (greedy) and eval/prompts; with samples drawn,
    eval/mean@n (the share of the n samples a prompt that are correct) and for k > 1
    eval/pass@k."""
    metrics = {
        "eval/prompts": float(len(results)),
        "eval/pass@1": statistics.mean(float(r.greedy_correct) for r in results),
        "eval/reward_mean": statistics.mean(r.greedy_reward for r in results),
    }
    if needs_samples(config):
        n, k = config.samples_drawn, config.k
        correct = [r.sampled_correct or 0 for r in results]
        metrics[f"eval/mean@{n}"] = statistics.mean(c / n for c in correct)
        if k > 1:
            metrics[f"eval/pass@{k}"] = statistics.mean(pass_at_k(n, c, k) for c in correct)
    return metrics


class Evaluator:
    def __init__(
        self,
        recipe: Any,
        services: ServiceHandles,
        progress: Progress,
        turns: GpuTurns,
        prompts: list[Any] | None = None,
        episodes: Any = None,
    ) -> None:
        from runtime.tasks.data import build_prompt_source

        self.recipe = recipe
        # the run's episodes (runtime/episodes/rollout.EpisodeRollout) where it has an env
        self.episodes = episodes
        self.config = recipe.eval
        self.services = services
        self.progress = progress
        self.turns = turns
        if prompts is None:
            source = build_prompt_source(
                recipe.dataset, split=self.config.split, path=self.config.path, shuffle=False
            )
            prompts = source.take(min(self.config.prompts, len(source)))
        self.prompts = prompts
        # the reward that says a completion is correct (none: the environment's says)
        self.reward = (
            None if episodes is not None else (self.config.reward or recipe.dataset.rewards[0].name)
        )
        self._tasks: set[asyncio.Task] = set()
        self._results: list[dict[str, float]] = []

    def due(self, step: int) -> bool:
        return bool(self.config.every) and step % self.config.every == 0

    def start(self, version: int) -> None:
        """Evaluate `version` in the background; its metrics join a later step record."""
        task = asyncio.create_task(self.run(version))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            self.services.fail(task.exception())
            return
        self._results.append(task.result())

    def take_results(self) -> dict[str, float]:
        """The metrics of the evaluations finished since the last call (the newest wins)."""
        results, self._results = self._results, []
        return results[-1] if results else {}

    async def run(self, version: int) -> dict[str, float]:
        """Evaluate version `version` (or a newer one a generator holds by then) now."""
        start = time.perf_counter()
        replicas = self.services.generators
        shares = [self.prompts[r::replicas] for r in range(replicas)]
        parts = await asyncio.gather(
            *(self._on_replica(r, share, version) for r, share in enumerate(shares) if share)
        )
        results = [x for part, _, _ in parts for x in part]
        metrics = summarize(results, self.config)
        if self.episodes is not None:
            greedy = [ep for _, _, (g, _) in parts for ep in g]
            sampled = [ep for _, _, (_, s) in parts for ep in s]
            metrics |= episode_figures(greedy, sampled)
        metrics["eval/version"] = float(min(v for _, v, _ in parts))
        metrics["eval/seconds"] = time.perf_counter() - start
        return metrics

    async def _on_replica(
        self, replica: int, prompts: list[Any], version: int
    ) -> tuple[list[PromptResult], int, tuple[list[Any], list[Any]]]:
        """The prompts' results on `replica`, the oldest version that sampled them, and the
        (greedy, sampled) episodes played (none for single-turn prompts)."""
        await self.progress.wait_for(lambda: self.progress.loaded[replica] >= version, _nothing)
        if self.episodes is not None:
            return await self._episodes_on_replica(replica, prompts)
        messages = [p.messages() for p in prompts]
        g, n = self.recipe.grpo, self.config.samples_drawn
        async with self.turns.turn(f"generator{replica}"):
            greedy = await self.services.generate(replica, messages, g.seed, 1, 0.0)
            sampled = []
            if needs_samples(self.config):
                sampled = await self.services.generate(replica, messages, g.seed, n, g.temperature)
        texts = [c["text"] for c in greedy], [c["text"] for c in sampled]
        scores = await self.services.score(score_items(prompts, *texts))
        versions = [c["policy_version"] for c in [*greedy, *sampled]]
        return judge(scores, len(prompts), self.config, self.reward), min(versions), ([], [])

    async def _episodes_on_replica(
        self, replica: int, prompts: list[Any]
    ) -> tuple[list[PromptResult], int, tuple[list[Any], list[Any]]]:
        """The prompts played as episodes on `replica`: each turn takes the GPU's turn, the
        tools run between them (as the rollouts' episodes do)."""
        from runtime.episodes.loop import NOT_GENERATED

        g, n = self.recipe.grpo, self.config.samples_drawn
        unit = f"generator{replica}"

        def at(temperature: float) -> Any:
            async def turn(ids: list[list[int]], most: int, seed: int) -> list[dict[str, Any]]:
                async with self.turns.turn(unit):
                    return await self.services.continue_tokens(
                        replica, ids, seed, most, temperature
                    )

            return turn

        seeds = episode_seeds(prompts, g.seed)
        greedy = await self.episodes.play(prompts, seeds, 1, at(0.0))
        sampled = []
        if needs_samples(self.config):
            sampled = await self.episodes.play(prompts, seeds, n, at(g.temperature))
        versions = [v for ep in [*greedy, *sampled] for v in ep.versions if v != NOT_GENERATED]
        version = min(versions) if versions else self.progress.loaded[replica]
        return judge_episodes(greedy, sampled, self.config), version, (greedy, sampled)

    async def wait(self) -> None:
        """Until the evaluations running now have finished."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _nothing() -> None:
    return None
