"""Evaluation during training: held-out prompts on the generators, at a version boundary.

Every `eval.every` steps (and after the last one), version v is evaluated on the recipe's
held-out split: each generator replica takes its share of the prompts once it has loaded v
(between two of its generate calls, so training goes on meanwhile and waits only for what the
generators spend on the evaluation), samples a greedy completion per prompt and, for pass@k,
`eval.samples` completions at the run's temperature; the reward procs score them. A completion
is correct when the recipe's `eval.reward` (default: its first reward) scores at least
`eval.correct_at`.

Metrics (`eval/*`, with `eval/version`, the policy version evaluated): `pass@1` (greedy),
`pass@k` (the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples with c correct),
`reward_mean` (the greedy completions' total reward), `prompts`, `seconds`. They join the next
step record, and the final evaluation the last step's (it supersedes an evaluation that is still
running when the last step ends).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

from runtime.control.handles import ServiceHandles
from runtime.control.progress import Progress
from runtime.control.turns import GpuTurns


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluator:
    def __init__(
        self,
        recipe: Any,
        services: ServiceHandles,
        progress: Progress,
        turns: GpuTurns,
        prompts: list[Any] | None = None,
    ) -> None:
        from runtime.tasks.data import build_prompt_source

        self.recipe = recipe
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
        self.reward = self.config.reward or recipe.dataset.rewards[0].name
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
        greedy = [x for part in parts for x in part["greedy"]]
        sampled = [x for part in parts for x in part["sampled"]]
        versions = [v for part in parts for v in part["versions"]]
        metrics = {
            "eval/version": float(min(versions)),
            "eval/prompts": float(len(greedy)),
            "eval/pass@1": statistics.mean(correct for correct, _ in greedy),
            "eval/reward_mean": statistics.mean(total for _, total in greedy),
        }
        k, n = self.config.k, self.config.samples_drawn
        if n > 1 or k > 1:
            metrics[f"eval/pass@{k}"] = statistics.mean(pass_at_k(n, c, k) for c in sampled)
        metrics["eval/seconds"] = time.perf_counter() - start
        return metrics

    async def _on_replica(self, replica: int, prompts: list[Any], version: int) -> dict:
        await self.progress.wait_for(lambda: self.progress.loaded[replica] >= version, _nothing)
        messages = [p.messages() for p in prompts]
        g = self.recipe.grpo
        n = self.config.samples_drawn
        async with self.turns.turn(f"generator{replica}"):
            greedy = await self.services.generate(replica, messages, g.seed, 1, 0.0)
            sampled = []
            if n > 1 or self.config.k > 1:
                sampled = await self.services.generate(replica, messages, g.seed, n, g.temperature)
        scores = await self.services.score(
            [(p.text, c["text"], p.answer) for p, c in zip(prompts, greedy, strict=True)]
            + [
                (prompts[i // n].text, c["text"], prompts[i // n].answer)
                for i, c in enumerate(sampled)
            ]
        )
        head, tail = scores[: len(prompts)], scores[len(prompts) :]
        greedy_out = [
            (float(parts[self.reward] >= self.config.correct_at), total) for total, parts in head
        ]
        per_prompt = [
            sum(
                parts[self.reward] >= self.config.correct_at
                for _, parts in tail[i * n : (i + 1) * n]
            )
            for i in range(len(prompts) if sampled else 0)
        ]
        versions = [c["policy_version"] for c in [*greedy, *sampled]]
        return {"greedy": greedy_out, "sampled": per_prompt, "versions": versions}

    async def wait(self) -> None:
        """Until the evaluations running now have finished."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _nothing() -> None:
    return None
