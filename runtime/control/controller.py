"""The controller: one process that drives every service through Monarch endpoints.

Rollouts run continuously, one loop per generator replica: sample a group per prompt, score it
(reward procs), score it again under the frozen reference, and queue it. The training loop takes
`prompts_per_step` groups no older than `max_policy_age` versions, steps the trainer, publishes
the new version to TorchStore and tells every generator to switch. Rollouts and training overlap;
only the staleness bound ties them together, except on a GPU that several services share: there
their calls take turns (`runtime.control.turns`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from runtime.control import checkpoint
from runtime.control.buffer import Group, RolloutBuffer
from runtime.control.config import RunConfig
from runtime.control.turns import GpuTurns


class Controller:
    def __init__(self, config: RunConfig, services: Any, stopping: asyncio.Event) -> None:
        self.config = config
        self.recipe = config.recipe
        self.services = services  # runtime.launch.Services: the actor meshes and the store
        self.stopping = stopping
        g = self.recipe.grpo
        self.buffer = RolloutBuffer(
            g.max_policy_age, capacity=g.prompts_per_step * (g.max_policy_age + 1)
        )
        self.step = 0  # optimizer steps done
        self.version = 0  # policy version the trainer holds (== step)
        self.generate_calls = 0
        self.source: Any = None
        self.metrics: Any = None
        self.resumed_from: int | None = None
        self._rollouts_open = True
        self._rollout_tasks: list[asyncio.Task] = []
        self._update_tasks: set[asyncio.Task] = set()
        self._recent: dict[str, list[float]] = {}
        # Generation seconds and generate calls (all replicas) finished since the last record.
        self._generating_s = 0.0
        self._calls_ended = 0
        # Generate calls started while the same generator's last groups were still being scored.
        self._overlapped_calls = 0
        self._last_load_s = 0.0
        self.weight_paths: list[str] = []  # per generator: store | push | ipc
        # Versions loaded on each generator, whether the trainer is mid-step, and groups being
        # generated: what decides if a new rollout would still be fresh when it is trained on.
        self._gen_versions: list[int] = []
        self._training = False
        self._groups_in_flight = 0
        # Per replica, groups generated but not yet queued (their call waits on a full buffer):
        # a checkpoint saves them with the queued ones.
        self._unqueued: dict[int, list[Group]] = {}
        # Per replica, the task scoring its last call's groups and queueing them.
        self._finishing: dict[int, asyncio.Task] = {}
        self._held = False  # no new rollout starts while a checkpoint is being taken
        self._progress = asyncio.Condition()
        self._calls_in_flight = 0
        self.wandb_run_id: str | None = None
        self.turns = GpuTurns(config.plan.placements)

    # --- start ------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Data source, resume state and version 0 (or the resumed version) on every generator."""
        from runtime.tasks.data import build_prompt_source

        self.source = build_prompt_source(self.recipe.dataset, seed=self.recipe.grpo.seed)
        ckpt = checkpoint.latest(self.config.checkpoint_dir)
        if ckpt is not None:
            await self._restore(ckpt)
        if self.turns:
            print(f"services sharing a GPU take turns: {self.turns.describe()}", flush=True)
        await self._connect_weights()
        await self._publish_and_load(self.version)

    async def _restore(self, ckpt: checkpoint.Checkpoint) -> None:
        s = self.services
        restored = await s.train_call("load", str(ckpt.path))
        state = torch.load(ckpt.path / "controller.pt", weights_only=False)
        if state["step"] != restored or state["step"] != ckpt.step:
            raise RuntimeError(
                f"{ckpt.path}: trainer step {restored}, controller step {state['step']}, "
                f"directory step {ckpt.step} disagree"
            )
        self.step, self.version = state["step"], state["version"]
        self.generate_calls = state["generate_calls"]
        self.source.load_state_dict(state["data"])
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.buffer.restore([Group(**group) for group in state["buffer"]])
        self.wandb_run_id = state.get("wandb_run_id")
        self.resumed_from = self.step
        print(f"resumed from step {self.step} ({ckpt.path})", flush=True)

    # --- weights ------------------------------------------------------------------------------

    async def _connect_weights(self) -> None:
        """Pick each generator's weight path (`runtime.weights.transport.choose`) and open it."""
        from runtime.weights import transport

        s = self.services
        mode = self.config.plan.settings.weight_sync.transport
        self.weight_paths = ["store"] * len(s.generators)
        if mode != "store":
            trainer = await s.train_call("weight_endpoint")
            gens = await asyncio.gather(
                *(s.call("generator", g.weight_endpoint.call_one()) for g in s.generators)
            )
            self.weight_paths = transport.choose(trainer, list(gens), mode)
        opened = await s.train_call("connect_weights", self.weight_paths)
        links = transport.connections(self.weight_paths, opened)
        await asyncio.gather(
            *(
                s.call("generator", gen.connect_weights.call_one(path, link))
                for gen, path, link in zip(s.generators, self.weight_paths, links, strict=True)
            )
        )
        if any(p != "store" for p in self.weight_paths):
            print(f"weights reach the generators by: {', '.join(self.weight_paths)}", flush=True)

    async def _publish_and_load(self, version: int) -> float:
        """Publish `version` and load it on every generator now (start of run)."""
        s = self.services
        pub = await s.train_call("publish", version)
        loads = await asyncio.gather(
            *(s.call("generator", gen.update_weights.call_one(version)) for gen in s.generators)
        )
        self._last_load_s = max(r["seconds"] for r in loads)
        self._gen_versions = [r["version"] for r in loads]
        return pub["seconds"] + self._last_load_s

    def _switch_generators(self, version: int) -> None:
        """Ask every generator to load `version` after its generation in flight; then drop v-1."""
        s = self.services

        async def load(replica: int, gen: Any) -> float:
            async with self.turns.turn(f"generator{replica}"):
                result = await s.call("generator", gen.update_weights.call_one(version))
            # A generator that received a newer version already loads that one.
            self._gen_versions[replica] = max(self._gen_versions[replica], result["version"])
            await self._notify()
            return result["seconds"]

        async def switch() -> None:
            loads = await asyncio.gather(*(load(i, gen) for i, gen in enumerate(s.generators)))
            self._last_load_s = max(loads)
            if version - 1 >= 0:
                await s.train_call("drop", version - 1)

        task = asyncio.create_task(switch())
        self._update_tasks.add(task)
        task.add_done_callback(self._update_done)

    def _update_done(self, task: asyncio.Task) -> None:
        self._update_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.services.fail(task.exception())

    # --- rollouts -----------------------------------------------------------------------------

    def start_rollouts(self) -> None:
        for replica, gen in enumerate(self.services.generators):
            task = asyncio.create_task(self._rollout_loop(replica, gen))
            task.add_done_callback(self._rollout_done)
            self._rollout_tasks.append(task)

    def _rollout_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.services.fail(task.exception())

    async def _rollout_loop(self, replica: int, gen: Any) -> None:
        """Generate, then score and reference-score the groups in a task of their own, so the
        generator can start its next call (once it would be fresh enough) while the reference
        scores the last one. Groups enter the buffer in call order."""
        s = self.services
        g = self.recipe.grpo
        per_call = max(1, -(-g.prompts_per_step * g.steps_per_call // len(s.generators)))
        finishing: asyncio.Task | None = None
        held: list[Group] | None = None  # generated, not yet handed to a _finish task
        try:
            while self._rollouts_open:
                await self._wait_until_fresh_enough(replica, per_call)
                if not self._rollouts_open:
                    break
                prompts = self.source.take(per_call)
                self.generate_calls += 1
                if finishing is not None and not finishing.done():
                    self._overlapped_calls += 1
                seed = hash((g.seed, self.generate_calls)) & 0x7FFFFFFF
                self._calls_in_flight += 1
                try:
                    async with self.turns.turn(f"generator{replica}"):
                        start = time.perf_counter()
                        out = await s.call(
                            "generator",
                            gen.generate.call_one([p.messages() for p in prompts], seed),
                        )
                        elapsed = time.perf_counter() - start
                    self._note("time/generate_s", elapsed)
                    self._generating_s += elapsed
                    self._calls_ended += 1
                    held = self._groups(prompts, out)
                except BaseException:
                    self._calls_in_flight -= 1
                    raise
                if finishing is not None:
                    await finishing  # the previous call's groups go in first
                finishing = self._finishing[replica] = asyncio.create_task(
                    self._finish(replica, held, per_call)
                )
                held = None
                # A failed scoring stops the run now, not when the next call returns.
                finishing.add_done_callback(self._rollout_done)
            if finishing is not None:
                await finishing
        except asyncio.CancelledError:
            if held is not None:  # cancelled behind a put that waited: these are dropped
                self._calls_in_flight -= 1
            if finishing is not None and not finishing.done():
                finishing.cancel()
                await asyncio.gather(finishing, return_exceptions=True)
            raise

    async def _finish(self, replica: int, groups: list[Group], per_call: int) -> None:
        """Rewards and reference log-probs for one call's groups, then into the buffer."""
        try:
            await self._score(groups)
            await self._reference(groups)
        finally:
            self._calls_in_flight -= 1
        # A stop cancels a put waiting on a full buffer: what is left stays in _unqueued.
        pending = self._unqueued[replica] = groups
        while pending:
            await self.buffer.put(pending[0])
            pending.pop(0)
        self._groups_in_flight -= per_call
        await self._notify()

    def _blocked_on_full_buffer(self, replica: int) -> bool:
        """Whether the replica's groups wait for room in the buffer (nothing else pending)."""
        return self.buffer.full_waiters(self._finishing.get(replica))

    def _consumer_version(self, groups: int = 1) -> int:
        """The trainer version that will consume the last of `groups` groups generated now."""
        queued = len(self.buffer) + self._groups_in_flight + groups - 1
        per_step = self.recipe.grpo.prompts_per_step
        return self.version + (1 if self._training else 0) + queued // per_step

    async def _wait_until_fresh_enough(self, replica: int, groups: int) -> None:
        """Hold a rollout until it would be at most `max_policy_age` versions old when trained
        on: generation that would be dropped as stale is never started."""
        age = self.recipe.grpo.max_policy_age

        def room() -> bool:
            # With age >= 1 a call may start while the last one's groups are still being
            # scored: every group in flight keeps a place in the buffer, so no put ever waits
            # on a full buffer with a generation behind it (a checkpoint waits for both). The
            # buffer holds (age + 1) steps, at least one step plus a call. In lock-step
            # (age 0) calls never overlap; the buffer may then be over-asked and a put wait.
            if age == 0:
                return True
            return len(self.buffer) + self._groups_in_flight + groups <= self.buffer.capacity

        async with self._progress:
            await self._progress.wait_for(
                lambda: (
                    not self._rollouts_open
                    or (
                        not self._held
                        and self._gen_versions[replica] >= self._consumer_version(groups) - age
                        and room()
                    )
                )
            )
            self._groups_in_flight += groups

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    def _groups(self, prompts: list[Any], out: list[dict[str, Any]]) -> list[Group]:
        n = self.recipe.grpo.group_size
        groups = []
        for i, p in enumerate(prompts):
            done = out[i * n : (i + 1) * n]
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
                )
            )
        return groups

    async def _score(self, groups: list[Group]) -> None:
        s = self.services
        items = [(gr.prompt, text, gr.answer) for gr in groups for text in gr.texts]
        start = time.perf_counter()
        scores = await s.score(items)
        self._note("time/reward_s", time.perf_counter() - start)
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
        s = self.services
        if s.reference is None:
            return
        batch = self._batch(groups)
        async with self.turns.turn("reference"):
            start = time.perf_counter()
            ref = await s.call(
                "reference", s.reference.logprobs.call_one(batch.tokens, batch.response_mask)
            )
            self._note("time/reference_s", time.perf_counter() - start)
        rows = iter(ref["logprobs"])
        for gr in groups:
            for resp in gr.responses:
                row = next(rows)
                start_col = len(gr.prompt_tokens)
                gr.ref_logprobs.append(row[start_col : start_col + len(resp)].tolist())

    def _note(self, key: str, value: float) -> None:
        self._recent.setdefault(key, []).append(value)

    # --- training -----------------------------------------------------------------------------

    def _batch(self, groups: list[Group], ref: bool = False) -> Any:
        """Groups in the [B, T] layout; with `ref`, the reference log-probs in place of the
        generator's (same collation, so the two line up exactly)."""
        from runtime.backends import Completion, collate

        completions = [
            Completion(gr.prompt_tokens, resp, lps, gr.policy_version, "stop")
            for gr in groups
            for resp, lps in zip(
                gr.responses, gr.ref_logprobs if ref else gr.response_logprobs, strict=True
            )
        ]
        return collate(completions, pad_id=self.services.pad_id)

    def _collate(self, groups: list[Group]) -> tuple[dict[str, Any], dict[str, float]]:
        from runtime.grpo import group_advantages

        g = self.recipe.grpo
        batch = self._batch(groups)
        rewards = torch.tensor([r for gr in groups for r in gr.rewards], dtype=torch.float32)
        advantages = group_advantages(
            rewards.view(len(groups), g.group_size), scale_by_std=g.loss != "dr_grpo"
        ).flatten()
        info = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "response/len_mean": float(batch.response_lengths.float().mean()),
            "policy/staleness_mean": float(
                sum(self.version - gr.policy_version for gr in groups) / len(groups)
            ),
        }
        for name in groups[0].reward_parts:
            vals = [v for gr in groups for v in gr.reward_parts[name]]
            info[f"reward/{name}"] = sum(vals) / len(vals)
        train = {
            "tokens": batch.tokens,
            "response_mask": batch.response_mask,
            "advantages": advantages,
            "old_logprobs": batch.logprobs,
            "ref_logprobs": self._batch(groups, ref=True).logprobs
            if groups[0].ref_logprobs
            else None,
        }
        return train, info

    async def train(self) -> None:
        """Train until the recipe's step count or until asked to stop."""
        s = self.services
        g = self.recipe.grpo
        total = g.steps
        while self.step < total and not self.stopping.is_set():
            t0 = time.perf_counter()
            groups = await self._wait(self._take(g.prompts_per_step))
            if groups is None:
                break
            await self._notify()
            t_wait = time.perf_counter() - t0
            batch, info = self._collate(groups)
            async with self.turns.turn("trainer"):
                stats = await s.train_call("train_step", batch)
                self.step += 1
                self.version += 1
                self._training = False
                pub = await s.train_call("publish", self.version)
            self._switch_generators(self.version)
            record = {
                "step": self.step,
                **info,
                "loss": stats.get("loss", 0.0),
                "kl": stats.get("kl", 0.0),
                "policy_version": self.version,
                "time/step_s": time.perf_counter() - t0,
                "time/wait_rollouts_s": t_wait,
                "time/weight_sync_s": pub["seconds"] + self._last_load_s,
                "time/publish_s": pub["seconds"],
                **{f"time/{k}": pub[k] for k in ("push_s", "push_wait_s") if k in pub},
                "time/train_s": stats.get("time/train_s", 0.0),
                "buffer/dropped_stale": self.buffer.dropped_stale,
                **{k: v for k, v in stats.items() if k not in ("loss", "kl", "time/train_s")},
            }
            for key, values in self._recent.items():
                if values:
                    record[key] = sum(values) / len(values)
            self._recent.clear()
            # Share of this step's wall time the generators spent generating (a call is counted
            # in the step it ends in): 1 - this is their idle share.
            step_s = record["time/step_s"]
            if step_s > 0:
                busy = self._generating_s / (step_s * len(s.generators))
                record["generator/busy_share"] = busy
            self._generating_s = 0.0
            record["generator/calls"] = self._calls_ended
            self._calls_ended = 0
            record["generator/overlapped_calls"] = self._overlapped_calls
            self._overlapped_calls = 0
            record.update(self.turns.take_stats())
            self.metrics.log(self.step, record)
            interval = g.checkpoint_interval
            if interval and self.step % interval == 0 and self.step < total:
                await self.save_checkpoint()

    async def _take(self, n: int) -> list[Group]:
        """The next step's groups. The trainer counts as training from the moment they leave
        the buffer (no await in between): a rollout loop woken in that moment would otherwise
        see an empty buffer and an idle trainer and start a call that goes stale."""
        groups = await self.buffer.take(n, self.version)
        self._training = True
        return groups

    async def _wait(self, coro: Any) -> Any:
        """Await `coro` unless a stop is requested first (then cancel it and return None)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stopping.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            stop.cancel()
            return task.result()
        task.cancel()
        return None

    # --- checkpoints and shutdown ---------------------------------------------------------------

    async def save_checkpoint(self) -> Path:
        root = self.config.checkpoint_dir
        saved = checkpoint.committed(root)
        if saved and saved[-1].step == self.step:
            # Periodic then a stop, or a resume stopped at once: rewriting the same step would
            # only open a moment in which it is gone.
            print(
                f"checkpoint step {self.step} -> {saved[-1].path} (already committed)", flush=True
            )
            return saved[-1].path
        partial = checkpoint.begin(root, self.step)
        s = self.services
        save = asyncio.ensure_future(s.train_call("save", str(partial)))
        try:
            state = await self._settled_state()
        except BaseException:
            save.cancel()
            raise
        await save
        torch.save(state, partial / "controller.pt")
        (partial / "meta.json").write_text(
            json.dumps({"recipe": self.recipe.name, "step": self.step, "version": self.version})
        )
        ckpt = checkpoint.commit(root, partial, self.step)
        print(f"checkpoint step {self.step} -> {ckpt.path}", flush=True)
        return ckpt.path

    async def _settled_state(self) -> dict[str, Any]:
        """The controller's part of a checkpoint, taken once the rollouts in flight have landed.

        No new rollout starts until then, so the data position and generate-call count cover
        exactly the groups saved with them: a resume neither skips their prompts nor redraws
        their seeds. In lock-step (max_policy_age=0) nothing is in flight after a step.
        """
        self._held = True
        try:
            # in flight: between taking prompts and queueing the groups, unless waiting on a
            # full buffer (those groups are in _unqueued)
            while self._calls_in_flight or any(
                self._unqueued.get(replica) and not self._blocked_on_full_buffer(replica)
                for replica, task in enumerate(self._rollout_tasks)
                if not task.done()
            ):
                await asyncio.sleep(0.01)
            unqueued = [gr for groups in self._unqueued.values() for gr in groups]
            return {
                "step": self.step,
                "version": self.version,
                "generate_calls": self.generate_calls,
                "data": self.source.state_dict(),
                "python_rng": random.getstate(),
                "torch_rng": torch.get_rng_state(),
                "buffer": [asdict(gr) for gr in [*self.buffer.groups(), *unqueued]],
                "wandb_run_id": self.metrics.wandb_run_id if self.metrics else None,
            }
        finally:
            self._held = False
            await self._notify()

    async def stop_rollouts(self, timeout_s: float = 60.0) -> None:
        """No new generation; let the calls in flight return; stop the loops."""
        self._rollouts_open = False
        await self._notify()
        # Loops end by themselves once their call in flight returns and its groups are queued;
        # one blocked on a full buffer never does: cancel it after the calls drained (its groups
        # go into the checkpoint, see _finish).
        deadline = time.monotonic() + timeout_s

        def running() -> list[int]:
            return [r for r, t in enumerate(self._rollout_tasks) if not t.done()]

        while running() and time.monotonic() < deadline:
            if not self._calls_in_flight and all(map(self._blocked_on_full_buffer, running())):
                break
            await asyncio.sleep(0.02)
        pending = [self._rollout_tasks[r] for r in running()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._update_tasks:
            await asyncio.gather(*self._update_tasks, return_exceptions=True)
        if any(p != "store" for p in self.weight_paths):
            # The receivers' threads end; nothing is published any more.
            await self.services.train_call("close_weights")
