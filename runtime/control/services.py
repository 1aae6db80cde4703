"""The run's services as the controller sees them (`handles.ServiceHandles`), answered by the
actor meshes through the run's lifecycle: every call supervised, a failure ends the run."""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from runtime.control.watchdog import Watchdog
from runtime.procs.failures import ActorFailure, first_cause, is_consequence, root_cause
from runtime.procs.lifecycle import RunLifecycle

# How long the other ranks of a service get to report a failure of their own when the first
# failure to arrive is a consequence of one (a collective its peer aborted): the peer's own
# error, out of memory say, may reach the controller a moment later.
RANK_CAUSE_GRACE_S = 5.0


async def each_rank(
    mesh: Any, endpoint: str, *args: Any, grace: float = RANK_CAUSE_GRACE_S
) -> list[Any]:
    """`endpoint(*args)` on every actor of `mesh`; their answers in rank order.

    Each rank is called on its own rather than the mesh at once, so the first rank that fails
    ends the wait: its peers may be waiting for it in a collective (a rank out of memory in its
    loss leaves the others in the backward's reduce-scatter) and would never answer. Where that
    first failure is a consequence of another's (`failures.is_consequence`), the others get
    `grace` s to fail too, and the one raised is `failures.first_cause` of them all.

    Every rank's message is sent before the first await: two calls in flight at once (a LoRA
    run's train step and reference scoring, both collectives) reach every rank in the same
    order, as Monarch delivers one sender's messages to an actor in order."""
    ranks = mesh.flatten("rank")
    calls = [
        asyncio.ensure_future(_awaited(getattr(ranks.slice(rank=i), endpoint).call_one(*args)))
        for i in range(len(ranks))
    ]
    failed: list[BaseException] = []

    def arrived(call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is not None:
            failed.append(call.exception())  # type: ignore[arg-type]

    for call in calls:
        call.add_done_callback(arrived)
    try:
        await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        if failed:
            loop = asyncio.get_running_loop()
            end = loop.time() + grace
            while all(is_consequence(root_cause(e)) for e in failed):
                pending = [c for c in calls if not c.done()]
                if not pending or (left := end - loop.time()) <= 0:
                    break
                await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            raise first_cause(failed)
        return [call.result() for call in calls]
    finally:
        for call in calls:
            call.cancel()  # no-op for those done; nobody awaits the others' answers


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def rank_figures(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """A training step's figures from every trainer rank's answer: rank 0's, the largest of every
    rank's memory figures and compiled graphs beside its own (`memory/ranks_max/...`: rank 0
    holds the published versions, the others do not; `compile/ranks_max/graphs`: a rank that
    compiled again holds up the others at the next collective), every rank's profile summary
    where the step was profiled (runtime.backends.profiling.every_rank), and the guards behind
    a graph compiled again of the first rank that has any (`compile/reasons`, named by rank
    past rank 0)."""
    from runtime.backends.profiling import every_rank

    stats = dict(answers[0])
    every_rank(answers, stats)
    if len(answers) > 1:
        for key in [k for k in stats if k.startswith("memory/")]:
            most = max(a.get(key, 0.0) for a in answers)
            stats[key.replace("memory/", "memory/ranks_max/", 1)] = most
        if "compile/graphs" in stats:
            stats["compile/ranks_max/graphs"] = max(a.get("compile/graphs", 0.0) for a in answers)
        if not stats.get("compile/reasons"):
            for rank, answer in enumerate(answers[1:], start=1):
                if answer.get("compile/reasons"):
                    stats["compile/reasons"] = [
                        f"rank {rank}: {r}" for r in answer["compile/reasons"]
                    ]
                    break
    return stats


@dataclass
class Services:
    """The actor meshes of one run and the supervised way to call them."""

    life: RunLifecycle
    trainer: Any
    generator_actors: list[Any]
    reference: Any | None
    reward: Any
    reward_procs: int
    pad_id: int
    watchdog: Watchdog | None = None  # deadlines for every call (None: wait as long as it takes)
    # A LoRA run's reference: the base with the adapter off, scored by the trainer's ranks.
    reference_in_trainer: bool = False
    # The CPU nodes' environment hosts (runtime/environments/nodes.py): (name, actor, workers)
    environment_nodes: list[tuple[str, Any, int]] = field(default_factory=list)

    @property
    def generators(self) -> int:
        return len(self.generator_actors)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_in_trainer

    @property
    def reference_unit(self) -> str:
        """Whose GPU turn reference scoring takes (runtime/control/turns.py)."""
        return "trainer" if self.reference_in_trainer else "reference"

    async def call(self, service: str, awaitable: Any, kind: str) -> Any:
        """A supervised call of `service`; `kind` names it for the watchdog's deadlines."""
        if self.watchdog is None:
            return await self.life.call(service, awaitable)
        return await self.watchdog.call(self.life, service, kind, awaitable)

    async def train_calls(self, endpoint: str, *args: Any, kind: str | None = None) -> list[Any]:
        """Call a trainer endpoint on every rank (they run collectives together); every rank's
        answer, in rank order."""
        return await self.call(
            "trainer", each_rank(self.trainer, endpoint, *args), kind=kind or endpoint
        )

    async def train_call(self, endpoint: str, *args: Any, kind: str | None = None) -> Any:
        """`train_calls`, rank 0's answer: the ranks' answers agree or only rank 0's matters
        (it alone publishes and saves)."""
        return (await self.train_calls(endpoint, *args, kind=kind))[0]

    async def generate(
        self,
        replica: int,
        prompts: list[list[dict[str, str]]],
        seed: int,
        n: int | None = None,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        gen = self.generator_actors[replica]
        call = gen.generate.call_one(prompts, seed, n, temperature)
        return await self.call(f"generator{replica}", call, kind="generate")

    async def continue_tokens(
        self,
        replica: int,
        prompts: list[list[int]],
        seed: int,
        max_new_tokens: int,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        gen = self.generator_actors[replica]
        call = gen.continue_tokens.call_one(prompts, seed, max_new_tokens, temperature)
        return await self.call(f"generator{replica}", call, kind="generate")

    async def score(
        self, items: list[tuple[str, str, str]]
    ) -> list[tuple[float, dict[str, float]]]:
        """Score on every reward proc at once, in contiguous slices."""
        n = self.reward_procs
        size = -(-len(items) // n)
        parts = [items[i * size : (i + 1) * size] for i in range(n)]
        calls = [
            self.call("reward", self.reward.slice(procs=i).score.call_one(part), kind="score")
            for i, part in enumerate(parts)
            if part
        ]
        return [score for chunk in await asyncio.gather(*calls) for score in chunk]

    async def reference_logprobs(self, tokens: Tensor, mask: Tensor) -> list[list[float]]:
        # every reference rank scores its share of the rows (one rank: all of them)
        if self.reference_in_trainer:
            # Its ranks run collectives as a train step does: each_rank sends to every rank in
            # one go, so a step and a scoring reach all of them in the same order.
            scoring = each_rank(self.trainer, "reference_logprobs", tokens, mask)
            answers = await self.call("trainer", scoring, kind="logprobs")
        else:
            assert self.reference is not None
            scoring = each_rank(self.reference, "logprobs", tokens, mask)
            answers = await self.call("reference", scoring, kind="logprobs")
        shares = sorted((a["first"], a["logprobs"]) for a in answers)
        return [row for _, rows in shares for row in rows]

    async def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """Rank 0's figures over every rank's (`rank_figures`)."""
        return rank_figures(await self.train_calls("train_step", batch))

    async def publish(self, version: int) -> dict[str, Any]:
        return await self.train_call("publish", version)

    async def load_version(
        self, replica: int, version: int, direct: dict[str, Any] | None = None
    ) -> dict[str, float]:
        gen = self.generator_actors[replica]
        call = gen.update_weights.call_one(version, direct)
        return await self.call(f"generator{replica}", call, kind="load")

    async def version_loaded(self, version: int) -> None:
        await self.train_call("version_loaded", version)

    async def drop(self, version: int) -> None:
        await self.train_call("drop", version)

    async def weight_endpoints(self) -> tuple[Any, list[Any]]:
        trainer = await self.train_call("weight_endpoint")
        gens = await asyncio.gather(
            *(
                self.call(f"generator{r}", g.weight_endpoint.call_one(), kind="weight_endpoint")
                for r, g in enumerate(self.generator_actors)
            )
        )
        return trainer, list(gens)

    async def open_weights(
        self, paths: list[str], ipc_opens: list[int] | None = None
    ) -> dict[str, Any]:
        return await self.train_call("connect_weights", paths, ipc_opens)

    async def connect_generator(self, replica: int, path: str, link: Any) -> None:
        gen = self.generator_actors[replica]
        call = gen.connect_weights.call_one(path, link)
        await self.call(f"generator{replica}", call, kind="connect")

    async def close_weights(self) -> None:
        await self.train_call("close_weights")

    async def save(self, directory: str) -> None:
        await self.train_call("save", directory)

    async def saved(self, wait: bool) -> bool:
        # waiting for a background write is a kind of its own: it may take a whole write
        return bool(await self.train_call("saved", wait, kind="saved, waiting" if wait else None))

    async def written_after_failure(self, probe_s: float, wait_s: float) -> bool:
        """After the run has failed (its supervision refuses every call then): whether the
        trainer's last checkpoint write reached disk on every rank. Each rank must answer a
        look within `probe_s` (a rank dead, or busy in a collective whose peer is gone, does
        not: the write counts as lost) and the write must end within `wait_s` more."""
        try:
            if all(await asyncio.wait_for(each_rank(self.trainer, "saved", False), probe_s)):
                return True
            return all(await asyncio.wait_for(each_rank(self.trainer, "saved", True), wait_s))
        except Exception:  # noqa: BLE001 - a rank gone, the write failed, or the time is up
            return False

    async def restore(self, directory: str) -> int:
        return await self.train_call("load", directory)

    async def export(self, directory: str, provenance: dict[str, Any]) -> None:
        await self.train_call("export", directory, provenance)

    def fail(self, error: BaseException) -> None:
        """A background task of the controller died: end the run with its cause."""
        if isinstance(error, ActorFailure):
            self.life.fail(error)
            return
        traceback.print_exception(error)  # a bug here keeps its traceback
        self.life.fail(ActorFailure("controller", root_cause(error), error))
