"""A small controller on RunLifecycle, run as a real process by tests/test_lifecycle.py.

Two services: "work" (2 procs that count in a loop and share a shared-memory segment) and
"reward" (1 proc whose endpoint divides by zero in --mode bad, killed in --mode kill-reward). Prints "started" once signals
are handled, "ready <json>" once the procs run, and "finished <steps>" when the loop ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from monarch.actor import Actor, endpoint

from runtime.procs.host import attach_shared_memory, create_shared_memory
from runtime.procs.lifecycle import RunLifecycle, run
from runtime.procs.spawn import spawn_service


class Worker(Actor):
    def __init__(self) -> None:
        self.count = 0
        self.segments: list = []

    @endpoint
    async def step(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        self.count += 1
        return self.count

    @endpoint
    async def share(self, tag: str) -> str:
        segment = create_shared_memory(tag, 4096)
        segment.buf[0] = 7
        self.segments.append(segment)
        return segment.name

    @endpoint
    async def peek(self, name: str) -> int:
        segment = attach_shared_memory(name)
        value = segment.buf[0]
        segment.close()
        return value


class Scorer(Actor):
    @endpoint
    async def score(self, x: float) -> float:
        return x / 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    # bad: an endpoint raises, awaited through life.call; bad-raw: awaited directly;
    # kill-reward: the reward proc dies (SIGKILL) while its actor is being spawned.
    # abandoned: a call whose waiter is cancelled (as the controller cancels work in flight)
    # fails afterwards, while the run goes on. slow-start: the start-up (`life.start`) ends
    # with a set-up that takes a minute.
    modes = ["normal", "bad", "bad-raw", "kill-reward", "abandoned", "slow-start"]
    p.add_argument("--mode", choices=modes, default="normal")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--slow-stop", type=float, default=0.0, help="a resource's stop takes this")
    p.add_argument("--slow-shutdown-s", type=float, default=5.0)
    return p.parse_args()


async def controller(life: RunLifecycle, args: argparse.Namespace) -> None:
    print("started", flush=True)
    if args.mode == "slow-start":
        await life.start(_slow_start(life))
    if args.slow_stop:
        life.register("slow resource", lambda: asyncio.sleep(args.slow_stop))
    work = await spawn_service(life, "work", 2, threads=1)
    reward = await spawn_service(life, "reward", 1, threads=1)
    worker = work.spawn_actor(Worker)
    if args.mode == "kill-reward":
        os.kill(reward.pids[0], signal.SIGKILL)
    scorer = reward.spawn_actor(Scorer, name="reward")
    name = await life.call("work", worker.slice(procs=0).share.call_one("weights"))
    assert await life.call("work", worker.slice(procs=1).peek.call_one(name)) == 7
    state = {"pids": work.pids + reward.pids, "reward_pids": reward.pids, "shm": name}
    print("ready", json.dumps(state), flush=True)
    step = 0
    while not life.stopping.is_set() and step < args.steps:
        await life.call("work", worker.step.call(args.step_seconds))
        if args.mode == "bad" and step == 2:
            await life.call("reward", scorer.score.call_one(1.0))
        if args.mode == "bad-raw" and step == 2:
            await scorer.score.call_one(1.0)
        if args.mode == "abandoned" and step == 2:
            waiter = asyncio.ensure_future(life.call("reward", _late(scorer)))
            await asyncio.sleep(0)
            waiter.cancel()
        step += 1
    print("finished", step, flush=True)


async def _slow_start(life: RunLifecycle) -> None:
    """Procs up and holding a shared-memory segment, then a set-up of a minute."""
    work = await spawn_service(life, "work", 2, threads=1)
    worker = work.spawn_actor(Worker)
    name = await life.call("work", worker.slice(procs=0).share.call_one("weights"))
    print("ready", json.dumps({"pids": work.pids, "shm": name}), flush=True)
    await life.call("work", worker.step.call(60.0))


async def _late(scorer) -> float:
    await asyncio.sleep(0.2)
    return await scorer.score.call_one(1.0)


def main() -> int:
    args = parse_args()
    return run(
        lambda life: controller(life, args),
        drain_timeout=5.0,
        slow_shutdown_s=args.slow_shutdown_s,
    )


if __name__ == "__main__":
    sys.exit(main())
