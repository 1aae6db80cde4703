"""The `ipc` path: a generator whose (first) GPU is the trainer's reads each version from the
trainer's memory.

The trainer copies each version into a fresh flat buffer (a group of tensors at a time as the
trainer gathers them) and puts the buffer's CUDA IPC handle into the version's manifest; the
generator opens it and copies the weights out of views of the trainer's memory (a TP>1
generator's workers open the same handle). The trainer lets go of the buffer once every
generator has loaded the version (`release`), so between publishes it holds none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.weights.flat import entries_of, fill, indexed, load_flat
from runtime.weights.layout import TensorEntry


def open_ipc(handle: Any) -> torch.Tensor:
    """The trainer's flat buffer of one version, from the `ipc` entry of its manifest."""
    rebuild, args = handle
    return rebuild(*args)


class IpcSender:
    """Trainer rank 0's end: one flat buffer per version still in use, shared by handle."""

    name = "ipc"

    def __init__(self, device: torch.device) -> None:
        self.device = indexed(torch.device(device))
        self._buffers: dict[int, torch.Tensor] = {}
        self._filling: torch.Tensor | None = None
        self._entries: dict[str, TensorEntry] = {}

    def open(self) -> None:
        return None

    async def stage(
        self, version: int, state: Mapping[str, torch.Tensor], entries: dict[str, TensorEntry]
    ) -> dict[str, Any]:
        self.begin(version, entries)
        self.fill(state)
        return self.finish(version)

    def begin(self, version: int, entries: dict[str, TensorEntry]) -> None:
        """A fresh flat buffer for `version`, filled by `fill` a group at a time."""
        total = max(e.offset + e.nbytes for e in entries.values())
        self._entries = entries
        self._filling = torch.empty(total, dtype=torch.uint8, device=self.device)

    def fill(self, group: Mapping[str, torch.Tensor]) -> None:
        fill(self._filling, {n: self._entries[n] for n in group}, group)

    def finish(self, version: int) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        flat, self._filling = self._filling, None
        if flat.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._buffers[version] = flat
        return {"direct": {"ipc": reduce_tensor(flat)}}

    def stats(self) -> dict[str, float]:
        return {}

    def release(self, version: int) -> None:
        buffer = self._buffers.pop(version, None)
        if buffer is not None and buffer.device.type == "cuda":
            del buffer
            # A freed block that another process still had open waits in torch's limbo until
            # the next shared block is freed or an allocation fails; by now every generator
            # has let go of it, so give it back to the allocator at once, before the next step.
            torch.cuda.ipc_collect()

    def close(self) -> None:
        self._buffers.clear()


class IpcReceiver:
    """A generator's end: open the version's handle, load, let go of the mapping."""

    name = "ipc"

    def __init__(self, store: Any) -> None:
        self.store = store

    async def load(self, version: int, backend: Any) -> tuple[int, int]:
        direct = await self.store.direct(version, wait_s=60.0)
        if direct is None or "ipc" not in direct:
            raise RuntimeError(f"policy version {version} has no CUDA IPC handle in its manifest")
        entries = entries_of(direct)
        flat = open_ipc(direct["ipc"])
        load_flat(backend, flat, entries, handle=direct["ipc"])
        del flat  # the mapping closes with the last reference
        return version, sum(e.nbytes for e in entries.values())

    def close(self) -> None:
        return None
