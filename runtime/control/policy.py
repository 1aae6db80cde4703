"""Policy sync: each version the trainer publishes reaches every generator, between two of its
generate calls, by the path chosen for it when the run starts (runtime/weights/transport.py).

After each step the trainer publishes version v; every generator loads v once the call in
flight returns (its endpoints run one at a time), so no sequence mixes versions; then the
trainer frees v's direct-path buffers (the generators hold their copies) and v-1 is dropped. The loads run in the background: the trainer goes on with its next step meanwhile.
Each load takes the publish's `direct` entry of v's manifest with it (where a direct path is in
use), so a generator's receiver does not fetch it from the store (TorchStore) before loading.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runtime.control.handles import ServiceHandles
from runtime.control.progress import Progress
from runtime.control.turns import GpuTurns
from runtime.weights import transport


class PolicySync:
    def __init__(
        self,
        services: ServiceHandles,
        progress: Progress,
        turns: GpuTurns,
        mode: str,
        *,
        groups: bool = False,
    ) -> None:
        self.services = services
        self.progress = progress
        self.groups = groups  # weight_sync.push_buffer groups
        self.turns = turns
        self.mode = mode  # the recipe's weight_sync.transport
        self.paths: list[str] = ["store"] * services.generators
        self.last_load_s = 0.0  # the slowest generator's last load
        self.last_load_parts: dict[str, float] = {}  # its adapter's build and activation (LoRA)
        # From the train step's end to the last generator holding its version (publish, any
        # generation still in flight, the load): how soon sampling can use a new policy.
        self.last_ready_s = 0.0
        self._tasks: set[asyncio.Task] = set()

    async def connect(self) -> None:
        """Pick each generator's path and open it on both ends."""
        s = self.services
        opens = None
        if self.mode != "store":
            trainer, generators = await s.weight_endpoints()
            self.paths = transport.choose(trainer, generators, self.mode)
            opens = [g.ipc_opens for g in generators]
        opened = await s.open_weights(self.paths, opens)
        links = transport.connections(self.paths, opened)
        await asyncio.gather(
            *(
                s.connect_generator(replica, path, link)
                for replica, (path, link) in enumerate(zip(self.paths, links, strict=True))
            )
        )
        if any(p != "store" for p in self.paths):
            how = ""
            if self.groups and "push" in self.paths and "ipc" not in self.paths:
                how = " (the push a group at a time, as the trainer gathers it)"
            print(f"weights reach the generators by: {', '.join(self.paths)}{how}", flush=True)

    async def publish_and_load(self, version: int) -> None:
        """Publish `version` and load it on every generator now (the start of a run)."""
        s = self.services
        direct = (await s.publish(version)).get("direct")
        loads = await asyncio.gather(
            *(s.load_version(r, version, direct) for r in range(s.generators))
        )
        self._took(loads)
        self.progress.loaded = [int(r["version"]) for r in loads]
        await s.version_loaded(version)

    def switch(
        self,
        version: int,
        trained_at: float | None = None,
        direct: dict[str, Any] | None = None,
    ) -> None:
        """Every generator loads `version` after its generation in flight; then v-1 is dropped.
        `trained_at`: when the step that made it ended (time.perf_counter), for `last_ready_s`;
        `direct`: the publish's `direct` entry of the version's manifest, handed to each
        generator with its load (a fetch from the store less before it samples anew)."""
        s = self.services
        since = time.perf_counter() if trained_at is None else trained_at

        async def load(replica: int) -> dict[str, float]:
            async with self.turns.turn(f"generator{replica}"):
                result = await s.load_version(replica, version, direct)
            # A generator that received a newer version already loads that one.
            loaded = self.progress.loaded
            loaded[replica] = max(loaded[replica], int(result["version"]))
            await self.progress.notify()
            return result

        async def switch() -> None:
            self._took(await asyncio.gather(*(load(r) for r in range(s.generators))))
            self.last_ready_s = time.perf_counter() - since
            await s.version_loaded(version)
            if version - 1 >= 0:
                await s.drop(version - 1)

        task = asyncio.create_task(switch())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _took(self, loads: list[dict[str, float]]) -> None:
        slowest = max(loads, key=lambda r: r["seconds"])
        self.last_load_s = slowest["seconds"]
        self.last_load_parts = {
            k: v for k, v in slowest.items() if k.startswith(("adapter_", "receive_"))
        }

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.services.fail(task.exception())

    async def drain(self) -> None:
        """Wait for the switches in flight."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the direct paths (the receivers' threads end); nothing is published any more."""
        if any(p != "store" for p in self.paths):
            await self.services.close_weights()
