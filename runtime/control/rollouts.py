"""Rollouts: one loop per generator replica (with multi-turn episodes env.batches_in_flight of
them, its lanes) that samples groups, scores them (reward procs, then the frozen reference) and
queues them for the trainer, never starting a call whose groups would be too stale to train on
when their turn comes.

The freshness rule. A group sampled by policy version s may be trained on by the trainer at
version V only if V - s <= max_policy_age (older ones are dropped when taken). A call is held
until the version its generator has loaded is at least the version that will consume its last
group minus max_policy_age: the trainer's version, plus one while a step is in flight, plus one
per `prompts_per_step` groups already queued or being generated ahead of it. So generation that
would be dropped as stale is never started.

Order. With several generators (or lanes) a later call can finish first: groups are trained on
in the order their calls were admitted (runtime/control/buffer.py), so the step that consumes a
group is the one the rule counted on.

Overlap. With max_policy_age >= 1 a replica's next call may start while the reference still
scores its last one; every group in flight keeps a place in the buffer, so a put never waits on
a full buffer with a generation behind it. In lock-step (max_policy_age 0) calls never overlap
training.

Episodes. A call of multi-turn episodes holds its replica only while its turns sample: between
turns its episodes wait on their tools. A replica's lanes each run such a call, admitted by the
rule above like any call, and their turns queue at the replica, so one call samples while
another's tools run.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from typing import Any

from runtime.control.batching import collate_groups, spread
from runtime.control.buffer import Group, RolloutBuffer
from runtime.control.handles import ServiceHandles
from runtime.control.progress import Notes, Progress
from runtime.control.turns import GpuTurns


class Rollouts:
    """The rollout loops of a run and the buffer they fill."""

    def __init__(
        self,
        grpo: Any,
        services: ServiceHandles,
        source: Any,
        progress: Progress,
        turns: GpuTurns,
        notes: Notes,
        episodes: Any = None,
    ) -> None:
        self.grpo = grpo
        # multi-turn episodes with tools (runtime/episodes/rollout.EpisodeRollout), or None
        self.episodes = episodes
        self._dropped_episodes = 0
        self.services = services
        self.source = source
        self.progress = progress
        self.turns = turns
        self.notes = notes
        self.buffer = RolloutBuffer(
            grpo.max_policy_age, capacity=grpo.prompts_per_step * (grpo.max_policy_age + 1)
        )
        self.generate_calls = 0  # seeds each call: part of the checkpoint
        self._open = True
        self._tasks: list[asyncio.Task] = []
        # Groups being generated or scored (each keeps a place in the buffer) and calls between
        # taking prompts and queueing their groups.
        self._groups_in_flight = 0
        self._calls_in_flight = 0
        # Per lane (a loop: one a replica, or env.batches_in_flight a replica with episodes),
        # groups generated but not yet queued (their put waits on a full buffer): a checkpoint
        # saves them with the queued ones.
        self._unqueued: dict[int, list[Group]] = {}
        # Per lane, the task scoring its last call's groups and queueing them.
        self._finishing: dict[int, asyncio.Task] = {}
        self._held = False  # no new call starts while a checkpoint is being taken
        # Admission order: the next group's `seq`, and those admitted but not yet queued.
        self._admitted = 0
        self._pending: set[int] = set()
        # Dynamic sampling: groups dropped since the trainer last took a step, and since the last
        # step record.
        self._dropped_since_take = 0
        self._dropped = 0
        # Since the last step record (at `_mark`): generating seconds of the calls that ended,
        # the start of each lane's call in flight, calls ended (all lanes), calls started
        # while the same lane's last groups were still being scored.
        self._mark = time.perf_counter()
        self._generating_s = 0.0
        self._call_started: dict[int, float] = {}
        self._calls_ended = 0
        self._overlapped_calls = 0

    @property
    def per_call(self) -> int:
        """Prompts one generate call samples: the replicas share steps_per_call steps' prompts."""
        g = self.grpo
        return max(1, -(-g.prompts_per_step * g.steps_per_call // self.services.generators))

    # --- the loops ------------------------------------------------------------------------------

    @property
    def lanes(self) -> int:
        """The rollout loops: one a generator replica; with episodes, env.batches_in_flight a
        replica (lane k drives replica k % generators), so one call's turns sample while
        another's episodes wait on their tools."""
        per_replica = self.episodes.batches_in_flight if self.episodes is not None else 1
        return self.services.generators * per_replica

    def start(self) -> None:
        self._mark = time.perf_counter()
        for lane in range(self.lanes):
            task = asyncio.create_task(self._loop(lane))
            task.add_done_callback(self._done)
            self._tasks.append(task)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.services.fail(task.exception())

    async def _loop(self, lane: int) -> None:
        """Generate, then score and reference-score the groups in a task of their own, so the
        generator can start its next call (once it would be fresh enough) while the reference
        scores the last one. A lane's groups enter the buffer in call order (the buffer orders
        the lanes' by admission)."""
        g = self.grpo
        replica = lane % self.services.generators
        per_call = self.per_call
        finishing: asyncio.Task | None = None
        held: list[Group] | None = None  # generated, not yet handed to a _finish task
        try:
            while self._open:
                first = await self._wait_until_fresh_enough(replica, per_call)
                if not self._open:
                    break
                prompts = self.source.take(per_call)
                self.generate_calls += 1
                if finishing is not None and not finishing.done():
                    self._overlapped_calls += 1
                seed = hash((g.seed, self.generate_calls)) & 0x7FFFFFFF
                self._calls_in_flight += 1
                try:
                    # an episode call takes the GPU's turn per generator call, not while its
                    # tools run (_continue)
                    unit = f"generator{replica}"
                    turn = self.turns.turn(unit) if self.episodes is None else nullcontext()
                    async with turn:
                        start = self._call_started[lane] = time.perf_counter()
                        try:
                            if self.episodes is not None:
                                held = await self.episodes.groups(
                                    prompts, seed, self._continue(replica), replica
                                )
                                out = []
                            else:
                                out = await self.services.generate(
                                    replica, [p.messages() for p in prompts], seed
                                )
                        finally:
                            del self._call_started[lane]
                        end = time.perf_counter()
                    self.notes.add("time/generate_s", end - start)
                    # the engine's own seconds in that call (the rest: the call's way there and
                    # back, encoding the prompts, decoding the text)
                    engine = out[0].get("time/generate_s") if out else None
                    if engine is not None:
                        self.notes.add("time/engine_s", engine)
                        for key, value in out[0].items():
                            # its CPU and context switches, the process's garbage collection,
                            # and a push received meanwhile
                            if key.startswith(
                                ("generator/engine_thread_", "generator/push_", "generator/gc_")
                            ):
                                self.notes.add(key, value)
                    self._generating_s += end - max(start, self._mark)
                    self._calls_ended += 1
                    if self.episodes is None:
                        held = groups_of(prompts, out, g.group_size)
                    for i, gr in enumerate(held):
                        gr.seq = first + i
                except BaseException:
                    self._calls_in_flight -= 1
                    raise
                if finishing is not None:
                    await finishing  # the previous call's groups go in first
                finishing = self._finishing[lane] = asyncio.create_task(
                    self._finish(lane, held, per_call)
                )
                held = None
                # A failed scoring stops the run now, not when the next call returns.
                finishing.add_done_callback(self._done)
            if finishing is not None:
                await finishing
        except asyncio.CancelledError:
            if held is not None:  # cancelled behind a put that waited: these are dropped
                self._calls_in_flight -= 1
                self._pending.difference_update(gr.seq for gr in held)
            if finishing is not None and not finishing.done():
                finishing.cancel()
                await asyncio.gather(finishing, return_exceptions=True)
            raise

    def _continue(self, replica: int) -> Any:
        """An episode turn on `replica`: prompts given as token ids, one completion each."""

        async def turn(prompts: list[list[int]], most: int, seed: int) -> list[dict[str, Any]]:
            async with self.turns.turn(f"generator{replica}"):
                start = time.perf_counter()
                out = await self.services.continue_tokens(replica, prompts, seed, most)
                # a turn's seconds from here, and the engine's own in them (the rest: the
                # call's way to the replica and back, the prompts' ids and the completions')
                self.notes.add("episode/turn_s", time.perf_counter() - start)
            engine = out[0].get("time/generate_s") if out else None
            if engine is not None:
                self.notes.add("episode/turn_engine_s", engine)
            return out

        return turn

    async def _finish(self, lane: int, groups: list[Group], per_call: int) -> None:
        """Rewards and reference log-probs for one call's groups, the recipe's reward shaping,
        dynamic sampling's filter, then into the buffer. Episode groups come scored by their
        environments; one with a lost episode is left out (counted)."""
        lost = [gr for gr in groups if gr.response_masks and not gr.rewards]
        self._dropped_episodes += len(lost)
        self._pending.difference_update(gr.seq for gr in lost)
        groups = [gr for gr in groups if gr not in lost]
        try:
            await self._score([gr for gr in groups if not gr.response_masks])
            await self._reference(groups)
        finally:
            self._calls_in_flight -= 1
        for gr in groups:
            shape_rewards(gr, self.grpo)
        kept = [gr for gr in groups if self._keeps(gr)]
        self._pending.difference_update(gr.seq for gr in groups if gr not in kept)
        groups = kept
        # A stop cancels a put waiting on a full buffer: what is left stays in _unqueued.
        pending = self._unqueued[lane] = groups
        while pending:
            await self.buffer.put(pending[0])
            self._pending.discard(pending.pop(0).seq)
        await self.buffer.changed()  # a take may wait for these
        self._groups_in_flight -= per_call
        await self.progress.notify()

    async def _score(self, groups: list[Group]) -> None:
        if not groups:
            return
        items = [(gr.prompt, text, gr.answer) for gr in groups for text in gr.texts]
        start = time.perf_counter()
        scores = await self.services.score(items)
        self.notes.add("time/reward_s", time.perf_counter() - start)
        k = 0
        for gr in groups:
            for _ in gr.texts:
                total, parts = scores[k]
                gr.rewards.append(total)
                for name, value in parts.items():
                    gr.reward_parts.setdefault(name, []).append(value)
                k += 1

    async def _reference(self, groups: list[Group]) -> None:
        """Score the groups under the frozen reference (for the KL term and its metric)."""
        if not self.services.has_reference or not groups:
            return
        batch = collate_groups(groups, self.services.pad_id)
        async with self.turns.turn(self.services.reference_unit):
            start = time.perf_counter()
            rows = iter(await self.services.reference_logprobs(batch.tokens, batch.response_mask))
            self.notes.add("time/reference_s", time.perf_counter() - start)
        for gr in groups:
            for i in range(len(gr.responses)):
                row = next(rows)  # the reference's log-prob of each masked token
                gr.ref_logprobs.append(
                    spread(row, gr.response_masks[i]) if gr.response_masks else row
                )

    def _keeps(self, group: Group) -> bool:
        """Dynamic sampling (DAPO): a group whose completions all scored alike teaches nothing
        and is dropped, until this step has drawn dynamic_sampling_max_draws x prompts_per_step
        groups (past that every group is kept, so a task nobody solves yet still trains)."""
        g = self.grpo
        if not g.uses_dynamic_sampling or len(set(group.rewards)) > 1:
            return True
        cap = (g.dynamic_sampling_max_draws - 1) * g.prompts_per_step
        if self._dropped_since_take >= cap:
            return True
        self._dropped_since_take += 1
        return False

    # --- the freshness rule ---------------------------------------------------------------------

    def consumer_version(self, groups: int = 1) -> int:
        """The trainer version that will consume the last of `groups` groups generated now."""
        queued = len(self.buffer) + self._groups_in_flight + groups - 1
        p = self.progress
        return p.version + (1 if p.training else 0) + queued // self.grpo.prompts_per_step

    async def _wait_until_fresh_enough(self, replica: int, groups: int) -> int:
        """Hold a call until its groups would be at most `max_policy_age` versions old when
        trained on; admit it: the `seq` of its first group."""
        age = self.grpo.max_policy_age

        def room() -> bool:
            # The buffer holds (age + 1) steps, at least one step plus a call. In lock-step
            # (age 0) calls never overlap; the buffer may then be over-asked and a put wait.
            if age == 0:
                return True
            return len(self.buffer) + self._groups_in_flight + groups <= self.buffer.capacity

        def ready() -> bool:
            return not self._open or (
                not self._held
                and self.progress.loaded[replica] >= self.consumer_version(groups) - age
                and room()
            )

        admitted: list[int] = []

        def claim() -> None:
            self._groups_in_flight += groups
            admitted.append(self._admitted)
            self._pending.update(range(self._admitted, self._admitted + groups))
            self._admitted += groups

        await self.progress.wait_for(ready, claim)
        return admitted[0]

    # --- the trainer's side ---------------------------------------------------------------------

    async def take(self, n: int) -> list[Group]:
        """The next step's groups. The trainer counts as training from the moment they leave
        the buffer (no await in between): a loop woken in that moment would otherwise see an
        empty buffer and an idle trainer and start a call that goes stale."""
        groups = await self.buffer.take(n, self.progress.version, self._first_pending)
        self.progress.training = True
        # what this step's gathering dropped (the record's count; never above the cap)
        self._dropped, self._dropped_since_take = self._dropped_since_take, 0
        return groups

    def _first_pending(self) -> int | None:
        return min(self._pending) if self._pending else None

    def take_stats(self) -> dict[str, float]:
        """Since the last record: the lanes' share of the wall time spent in calls (one lane a
        replica: 1 - the generators' idle share; a call counts in every record whose span it
        overlaps, so a long call shows in each step it runs through), calls ended and calls
        overlapped."""
        now = time.perf_counter()
        in_flight = sum(now - max(s, self._mark) for s in self._call_started.values())
        busy = self._generating_s + in_flight
        window = now - self._mark
        self._mark = now
        stats: dict[str, float] = {}
        if window > 0:
            stats["generator/busy_share"] = busy / (window * self.lanes)
        stats["generator/calls"] = self._calls_ended
        stats["generator/overlapped_calls"] = self._overlapped_calls
        if self.grpo.uses_dynamic_sampling:
            stats["rollout/dropped_uninformative"] = self._dropped
        if self.episodes is not None:
            stats.update(self.episodes.take_stats())
            # groups left out for an episode their environment lost
            stats["episode/dropped_groups"] = self._dropped_episodes
            self._dropped_episodes = 0
        self._generating_s = 0.0
        self._calls_ended = 0
        self._overlapped_calls = 0
        self._dropped = 0
        return stats

    # --- checkpoints and stop -------------------------------------------------------------------

    def restore(self, groups: list[Group], generate_calls: int) -> None:
        """Groups and the call count a checkpoint saved (admitted before any new call)."""
        for gr in groups:
            gr.seq = -1
        self.buffer.restore(groups)
        self.generate_calls = generate_calls

    def _blocked_on_full_buffer(self, lane: int) -> bool:
        """Whether the lane's groups wait for room in the buffer (nothing else pending)."""
        return self.buffer.full_waiters(self._finishing.get(lane))

    async def settle(self) -> list[Group]:
        """Hold new calls until the ones in flight have landed; every group not yet trained on,
        oldest first. Call `release()` after.

        No new call starts until then, so the data position and generate-call count cover
        exactly the groups returned: a resume neither skips their prompts nor redraws their
        seeds. In lock-step (max_policy_age=0) nothing is in flight after a step.
        """
        self._held = True
        # in flight: between taking prompts and queueing the groups, unless waiting on a full
        # buffer (those groups are in _unqueued)
        while self._calls_in_flight or any(
            self._unqueued.get(lane) and not self._blocked_on_full_buffer(lane)
            for lane, task in enumerate(self._tasks)
            if not task.done()
        ):
            await asyncio.sleep(0.01)
        unqueued = [gr for groups in self._unqueued.values() for gr in groups]
        return [*self.buffer.groups(), *unqueued]

    async def release(self) -> None:
        self._held = False
        await self.progress.notify()

    async def stop(self, timeout_s: float = 60.0) -> None:
        """No new generation; let the calls in flight return; stop the loops."""
        self._open = False
        await self.progress.notify()
        # Loops end by themselves once their call in flight returns and its groups are queued;
        # one blocked on a full buffer never does: cancel it after the calls drained (its groups
        # go into the checkpoint, see _finish).
        deadline = time.monotonic() + timeout_s

        def running() -> list[int]:
            return [r for r, t in enumerate(self._tasks) if not t.done()]

        while running() and time.monotonic() < deadline:
            if not self._calls_in_flight and all(map(self._blocked_on_full_buffer, running())):
                break
            await asyncio.sleep(0.02)
        pending = [self._tasks[r] for r in running()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def groups_of(prompts: list[Any], out: list[dict[str, Any]], group_size: int) -> list[Group]:
    """One call's completions (prompt-major) as groups, one per prompt."""
    groups = []
    for i, p in enumerate(prompts):
        done = out[i * group_size : (i + 1) * group_size]
        versions = {c["policy_version"] for c in done}
        if len(versions) != 1:
            raise RuntimeError(f"one group spans policy versions {sorted(versions)}")
        groups.append(
            Group(
                prompt_id=p.id,
                prompt=p.text,
                answer=p.answer,
                prompt_tokens=done[0]["prompt_ids"],
                responses=[c["response_ids"] for c in done],
                response_logprobs=[c["response_logprobs"] for c in done],
                texts=[c["text"] for c in done],
                policy_version=versions.pop(),
                truncated=[c.get("finish_reason") == "length" for c in done],
            )
        )
    return groups


def shape_rewards(group: Group, grpo: Any) -> None:
    """The recipe's reward shaping, once a group is scored (and reference-scored): DAPO's soft
    overlong punishment and, with kl_placement "reward", the KL penalty of each completion.
    The raw scores stay in `reward_parts`; the shaping terms join them there."""
    import torch

    from runtime.grpo import kl_per_token

    buffer = grpo.overlong_buffer
    if buffer:
        start = grpo.max_response_tokens - buffer
        penalties = [
            0.0 if len(r) <= start else max(-1.0, (start - len(r)) / buffer)
            for r in group.responses
        ]
        group.reward_parts["overlong_penalty"] = penalties
        group.rewards = [r + p for r, p in zip(group.rewards, penalties, strict=True)]
    if grpo.kl_placement == "reward" and grpo.kl_beta and group.ref_logprobs:
        penalties = []
        for old, ref in zip(group.response_logprobs, group.ref_logprobs, strict=True):
            if not old:
                penalties.append(0.0)
                continue
            lp, rf = torch.tensor([old]), torch.tensor([ref])
            kl = kl_per_token(lp, rf, torch.ones_like(lp, dtype=torch.bool), grpo.kl_estimator)
            penalties.append(-grpo.kl_beta * float(kl.sum()))
        group.reward_parts["kl_penalty"] = penalties
        group.rewards = [r + p for r, p in zip(group.rewards, penalties, strict=True)]
