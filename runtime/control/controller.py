"""The controller: one process that drives every service, through `handles.ServiceHandles`.

Rollouts run continuously (runtime/control/rollouts.py); the training loop takes
`prompts_per_step` groups no older than `max_policy_age` versions, steps the trainer, publishes
the new version and lets every generator switch to it (runtime/control/policy.py). Rollouts and
training overlap; only the freshness rule ties them together, except on a GPU that several
services share: there their calls take turns (runtime/control/turns.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from recipes.memory import checkpoint_bytes
from recipes.planner import layout_hint
from runtime.backends.profiling import say_recompiles, write_profiles
from runtime.control import checkpoint
from runtime.control.batching import train_batch
from runtime.control.checkpoint import approx_size
from runtime.control.config import RunConfig
from runtime.control.evaluation import Evaluator
from runtime.control.handles import ServiceHandles
from runtime.control.policy import PolicySync
from runtime.control.progress import Notes, Progress
from runtime.control.rollouts import Rollouts
from runtime.control.state import ControllerState
from runtime.control.turns import GpuTurns
from runtime.procs.failures import ActorFailure
from runtime.procs.mps import uses_mps

# Steps whose mean lengths decide whether the run says another layout would be faster.
HINT_STEPS = 3


def publish_stage(pub: dict[str, float]) -> dict[str, float]:
    """`time/publish_stage_s`: the seconds a publish spent putting the version on its paths
    (runtime.weights.transport's `stage_*` stats, summed over the paths), where it says."""
    stages = [v for k, v in pub.items() if k.startswith("stage_")]
    return {"time/publish_stage_s": sum(stages)} if stages else {}


class Controller:
    def __init__(
        self, config: RunConfig, services: ServiceHandles, stopping: asyncio.Event
    ) -> None:
        self.config = config
        self.recipe = config.recipe
        self.services = services
        self.stopping = stopping
        self.step = 0  # optimizer steps done
        self.metrics: Any = None
        self.resumed_from: int | None = None
        # (the .partial directory, its step) while the trainer writes its files
        self.pending_checkpoint: tuple[Path, int] | None = None
        self.wandb_run_id: str | None = None
        self.progress = Progress(services.generators)
        turns = GpuTurns(config.plan.placements)
        # layout.sharing mps: services on one GPU call it at once; no turns, only their names
        self.mps_gpus = turns.describe() if uses_mps(config.plan) else ""
        self.turns = GpuTurns(()) if self.mps_gpus else turns
        self.notes = Notes()
        self.rollouts: Rollouts | None = None
        # a multi-turn run's episodes and their environment workers (runtime/episodes/rollout.py);
        # `environments`: the workers already started (run.py starts them before the services)
        self.episodes: Any = None
        self.environments: Any = None
        self.evaluator: Evaluator | None = None
        sync = config.plan.settings.weight_sync
        self.policy = PolicySync(
            services, self.progress, self.turns, sync.transport, groups=sync.push_buffer == "groups"
        )
        # (prompt, completion) mean lengths of this process's first steps, for layout_hint
        self.lengths: list[tuple[float, float]] | None = []

    @property
    def version(self) -> int:
        """The policy version the trainer holds (== step)."""
        return self.progress.version

    # --- start ------------------------------------------------------------------------------

    async def prepare(self, source: Any = None, eval_prompts: list[Any] | None = None) -> None:
        """Data source, resume state and version 0 (or the resumed version) on every generator.

        `source` and `eval_prompts` replace the recipe's prompt source and held-out prompts
        (tests)."""
        if source is None:
            from runtime.tasks.data import build_prompt_source

            source = build_prompt_source(self.recipe.dataset, seed=self.recipe.grpo.seed)
        if getattr(self.recipe, "env", None) is not None:
            from runtime.episodes.rollout import EpisodeRollout

            # the environment workers: node 0's started before the services (run.py), the CPU
            # nodes' (plan env.cpu_nodes) beside them; stopped with the run (stop_environments)
            environments = self.environments
            nodes = getattr(self.services, "environment_nodes", [])
            if nodes:
                from runtime.environments.nodes import onto_nodes

                environments = await onto_nodes(environments, self.recipe.env, nodes)
            self.episodes = await EpisodeRollout.start(self.recipe, environments=environments)
        self.rollouts = Rollouts(
            self.recipe.grpo,
            self.services,
            source,
            self.progress,
            self.turns,
            self.notes,
            self.episodes,
        )
        if self.recipe.eval.enabled:
            self.evaluator = Evaluator(
                self.recipe,
                self.services,
                self.progress,
                self.turns,
                prompts=eval_prompts,
                episodes=self.episodes,
            )
        ckpt = checkpoint.latest(self.config.checkpoint_dir)
        if ckpt is not None:
            await self._restore(ckpt)
        if self.turns:
            print(f"services sharing a GPU take turns: {self.turns.describe()}", flush=True)
        elif self.mps_gpus:
            print(
                "services sharing a GPU call it at once under NVIDIA MPS (layout.sharing mps): "
                f"{self.mps_gpus}",
                flush=True,
            )
        await self.policy.connect()
        await self.policy.publish_and_load(self.version)

    async def _restore(self, ckpt: checkpoint.Checkpoint) -> None:
        size = approx_size(checkpoint.marked_bytes(ckpt))  # `latest` checked the marker
        print(f"reading the checkpoint of step {ckpt.step} ({size}) ...", flush=True)
        restored = await self.services.restore(str(ckpt.path))
        state = ControllerState.load(ckpt.path)
        if state.step != restored or state.step != ckpt.step:
            raise RuntimeError(
                f"{ckpt.path}: trainer step {restored}, controller step {state.step}, "
                f"directory step {ckpt.step} disagree"
            )
        self.step, self.progress.version = state.step, state.version
        self.rollouts.source.load_state_dict(state.data)
        state.apply_rngs()
        self.rollouts.restore(state.buffer, state.generate_calls)
        self.wandb_run_id = state.wandb_run_id
        self.resumed_from = self.step
        print(f"resumed from step {self.step} ({ckpt.path})", flush=True)

    def start_rollouts(self) -> None:
        self.rollouts.start()
        evaluator = self.evaluator
        if evaluator is not None and evaluator.config.at_start and self.resumed_from is None:
            evaluator.start(self.version)  # the baseline, beside the first step's rollouts

    # --- training -------------------------------------------------------------------------------

    async def train(self) -> None:
        """Train until the recipe's step count or until asked to stop."""
        s, g, rollouts = self.services, self.recipe.grpo, self.rollouts
        total = g.steps
        while self.step < total and not self.stopping.is_set():
            t0 = time.perf_counter()
            groups = await self._unless_stopped(rollouts.take(g.prompts_per_step))
            if groups is None:
                break
            await self.progress.notify()
            t_wait = time.perf_counter() - t0
            batch, info = train_batch(
                groups,
                pad_id=s.pad_id,
                group_size=g.group_size,
                loss=g.loss,
                version=self.version,
                advantage_std=g.advantage_std,
                mask_truncated=g.mask_truncated,
            )
            async with self.turns.turn("trainer"):
                stats = await s.train_step(batch)
                trained_at = time.perf_counter()
                self.step += 1
                self.progress.version += 1
                self.progress.training = False
                pub = await s.publish(self.version)
            self.policy.switch(self.version, trained_at, pub.get("direct"))
            say_recompiles(
                stats, self.step, _printed, first=self.step == (self.resumed_from or 0) + 1
            )
            profiles = stats.pop("profile", None)  # the recipe's trainer.profile_step
            if profiles:
                write_profiles(self.metrics.run_dir, self.step, profiles, _printed)
                stats["trainer/profiled"] = 1.0  # its time includes the profiler's
            evaluations = await self._evaluate(total)
            step_s = time.perf_counter() - t0
            record = {
                "step": self.step,
                **info,
                "loss": stats.get("loss", 0.0),
                "kl": stats.get("kl", 0.0),
                "policy_version": self.version,
                "time/step_s": step_s,
                "time/wait_rollouts_s": t_wait,
                "time/weight_sync_s": pub["seconds"] + self.policy.last_load_s,
                "time/publish_s": pub["seconds"],
                # the last switch that ended (this step's may still be loading)
                "sync/ready_s": self.policy.last_ready_s,
                **{f"time/{k}": pub[k] for k in ("push_s", "push_wait_s") if k in pub},
                # the version gathered into the paths' buffers (or written to the store): the
                # rest of publish_s is its manifest's put into the store
                **publish_stage(pub),
                # a LoRA version's load into vLLM, in parts: adapter_build_s and
                # adapter_activate_s (added anew), or adapter_write_s (in place, with
                # adapter_plan_s when its plan was made); a CUDA IPC receipt's receive_manifest_s,
                # receive_open_s and receive_load_s
                **{f"time/{k}": v for k, v in self.policy.last_load_parts.items()},
                "time/train_s": stats.get("time/train_s", 0.0),
                "buffer/dropped_stale": rollouts.buffer.dropped_stale,
                **{k: v for k, v in stats.items() if k not in ("loss", "kl", "time/train_s")},
            }
            record.update(self.notes.take())
            record.update(rollouts.take_stats())
            record.update(self.turns.take_stats())
            record.update(evaluations)
            self.metrics.log(self.step, record)
            self._hint_layout(record)
            await self.commit_written()
            interval = g.checkpoint_interval
            if interval and self.step % interval == 0 and self.step < total:
                start = time.perf_counter()
                await self.save_checkpoint(wait=False)  # written while the next steps train
                # what the loop waited for: the generation in flight to settle (and an earlier
                # write, if one was still going); the trainer copies its state to host memory
                # in the background and its next optimizer step waits for the copy
                # (time/checkpoint_staging_wait_s in that step's record)
                self.notes.add("time/checkpoint_stall_s", time.perf_counter() - start)

    def _hint_layout(self, record: dict[str, Any]) -> None:
        """Once, after HINT_STEPS steps of this process (or the run's last step): a line where
        another layout is predicted faster at the run's own mean lengths than the plan's, which
        ranked them at the recipe's maxima (recipes.planner.layout_hint)."""
        if self.lengths is None:
            return
        self.lengths.append((record["prompt/len_mean"], record["response/len_mean"]))
        if len(self.lengths) < HINT_STEPS and self.step < self.recipe.grpo.steps:
            return
        prompt = sum(p for p, _ in self.lengths) / len(self.lengths)
        response = sum(r for _, r in self.lengths) / len(self.lengths)
        self.lengths = None
        line = layout_hint(self.recipe, self.config.plan, prompt, response)
        if line:
            print(f"forgesky: note: {line}", flush=True)

    async def _unless_stopped(self, coro: Any) -> Any:
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

    async def save_checkpoint(self, wait: bool = True) -> Path | None:
        """Checkpoint this step: the trainer stages its state and writes it in the background
        while training goes on; the directory is committed once every file is on disk (at
        once with `wait`, else at a later step boundary: `commit_written`). Where the disk
        cannot hold it even after deleting the older checkpoints (never the newest), the
        write is skipped with a warning (None): the run goes on, and its end still writes
        the model."""
        root = self.config.checkpoint_dir
        await self.commit_written(wait=True)  # one write in flight at a time
        saved = checkpoint.committed(root)
        if saved and saved[-1].step == self.step:
            # Periodic then a stop, or a resume stopped at once: rewriting the same step would
            # only open a moment in which it is gone.
            print(
                f"checkpoint step {self.step} -> {saved[-1].path} (already committed)", flush=True
            )
            return saved[-1].path
        total = checkpoint_bytes(self.recipe.arch, self.recipe.model.lora)
        if not self._room_for(root, total):
            return None
        partial = checkpoint.begin(root, self.step)
        if wait:
            # the run waits for this one (its end, a stop): say what it waits for
            print(
                f"writing the checkpoint of step {self.step} ({approx_size(total)}) ...", flush=True
            )
        save = asyncio.ensure_future(self.services.save(str(partial)))
        try:
            try:
                groups = await self.rollouts.settle()
                state = ControllerState.capture(
                    step=self.step,
                    version=self.version,
                    generate_calls=self.rollouts.generate_calls,
                    source=self.rollouts.source,
                    groups=groups,
                    wandb_run_id=self.metrics.wandb_run_id if self.metrics else None,
                )
            finally:
                await self.rollouts.release()
        except BaseException:
            save.cancel()
            raise
        await save
        state.save(partial)
        (partial / "meta.json").write_text(
            json.dumps({"recipe": self.recipe.name, "step": self.step, "version": self.version})
        )
        self.pending_checkpoint = (partial, self.step)
        if wait:
            reporter = asyncio.ensure_future(_report_writing(partial, total, self.step))
            try:
                await self.commit_written(wait=True)
            finally:
                reporter.cancel()
        return root / checkpoint.step_dir_name(self.step)

    def _room_for(self, root: Path, total: float) -> bool:
        """Whether the disk under `root` holds a checkpoint of `total` bytes, after deleting
        older checkpoints where that makes the room; if not, a warning says what is missing."""
        need = total * (1 + ROOM_MARGIN)
        free, deleted = checkpoint.make_room(root, need)
        for old in deleted:
            print(
                f"checkpoint {old.path.name} deleted early: the disk had no room for step "
                f"{self.step}'s",
                flush=True,
            )
        if free is None or free >= need:
            return True
        newest = checkpoint.committed(root)
        kept = f"; the newest kept is {newest[-1].path.name}" if newest else ""
        print(
            f"forgesky: warning: checkpoint of step {self.step} not written: {root} has "
            f"{approx_size(free).lstrip('~')} free and a checkpoint needs {approx_size(total)}"
            f"{kept} ({ROOM_ADVICE})",
            file=sys.stderr,
            flush=True,
        )
        return False

    async def stop_environments(self) -> None:
        """At shutdown, whatever ended the run: the episodes' environment workers stop."""
        if self.episodes is not None:
            await self.episodes.shutdown()

    async def finish_checkpoint(self) -> None:
        """At shutdown: the checkpoint still being written when the run ended early (a failure,
        or a stop whose grace ran out) is committed if the trainer's files reach disk within
        `grpo.checkpoint_finish_s` (a resume then loses no step it had saved)."""
        if self.pending_checkpoint is None:
            return
        wait_s = self.recipe.grpo.checkpoint_finish_s
        partial, step = self.pending_checkpoint
        self.pending_checkpoint = None
        if wait_s <= 0:
            return
        print(
            f"the checkpoint of step {step} was still in flight: waiting up to "
            f"{wait_s:g} s for its files to reach disk (grpo.checkpoint_finish_s)",
            flush=True,
        )
        if await self.services.written_after_failure(FINISH_PROBE_S, wait_s):
            self._commit(partial, step)
        else:
            print(f"forgesky: the checkpoint of step {step} was not finished", flush=True)

    async def commit_written(self, wait: bool = False) -> None:
        """Commit the checkpoint being written if the trainer's files are on disk (with
        `wait`, once they are)."""
        if self.pending_checkpoint is None:
            return
        try:
            done = await self.services.saved(wait)
        except ActorFailure as e:
            if e.service == "trainer":  # the write failed, or the trainer did: none of it counts
                self.pending_checkpoint = None
            raise
        if not done:
            return
        partial, step = self.pending_checkpoint
        self.pending_checkpoint = None
        self._commit(partial, step)

    def _commit(self, partial: Path, step: int) -> None:
        ckpt = checkpoint.commit(self.config.checkpoint_dir, partial, step)
        print(f"checkpoint step {step} -> {ckpt.path}", flush=True)

    async def _evaluate(self, total: int) -> dict[str, float]:
        """Start the evaluation due after this step, or at the end run the final one; the
        metrics of the evaluations finished since the last record (the final one supersedes an
        evaluation still running when the last step ends)."""
        evaluator = self.evaluator
        if evaluator is None:
            return {}
        if self.step < total:
            if evaluator.due(self.step):
                evaluator.start(self.version)
            return evaluator.take_results()
        await evaluator.wait()
        results = evaluator.take_results()
        if evaluator.config.at_end:
            results = await evaluator.run(self.version)
        return results

    async def stop_rollouts(self, timeout_s: float = 60.0) -> None:
        """No new generation; let the calls in flight return; stop the loops and the sync."""
        if self.evaluator is not None:
            await self.evaluator.stop()
        await self.rollouts.stop(timeout_s)
        await self.policy.drain()
        await self.policy.close()


# how long each trainer rank has to answer whether a checkpoint write is done, after a failure
FINISH_PROBE_S = 5.0

ROOM_ADVICE = "free that disk, or give the run a larger one: resources.disk_gb"


def room_warning(root: Path, total: float) -> str | None:
    """At start-up: a warning where the disk under `root` cannot hold the next checkpoint of
    `total` bytes, even after deleting the older ones (None where it can, or cannot say)."""
    room = checkpoint.room(root)
    if room is None or room >= total * (1 + ROOM_MARGIN):
        return None
    return (
        f"forgesky: warning: {root} has room for {approx_size(room).lstrip('~')} of "
        f"checkpoints and one needs {approx_size(total)}: checkpoints are skipped while it "
        f"has no room ({ROOM_ADVICE})"
    )


# What a checkpoint's write needs free beyond its estimated size (the controller's own state,
# the DCP metadata, the estimate's error).
ROOM_MARGIN = 0.02

# How often a checkpoint the run waits for says how much of it is on disk.
WRITE_PROGRESS_S = 20.0


async def _report_writing(folder: Path, total: float, step: int) -> None:
    """Every WRITE_PROGRESS_S, a line with how much of the checkpoint `folder` is on disk
    (on this node: a trainer on another node writes where this one does not see it)."""
    start = time.perf_counter()
    while True:
        await asyncio.sleep(WRITE_PROGRESS_S)
        done = checkpoint.bytes_under(folder)
        print(
            f"checkpoint of step {step}: {approx_size(done).lstrip('~')} of {approx_size(total)} "
            "on disk "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


def _printed(line: str) -> None:
    print(line, flush=True)
