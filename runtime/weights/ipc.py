"""The `ipc` path: a generator whose (first) GPU is the trainer's reads each version from the
trainer's memory.

The trainer copies each version into a fresh flat buffer (a group of tensors at a time as the
trainer gathers them) and puts CUDA IPC handles of the buffer into the version's manifest; the
generator opens them and copies the weights out of views of the trainer's memory (a TP>1
generator's workers each open one). The trainer lets go of the buffer once every generator has
loaded the version (`release`), so between publishes it holds none.

One export per opening process: torch counts the processes that still map a shared CUDA block
with one counter per export (`reduce_tensor`), set to 1 by the export and decremented by each
process that opens it, when it lets go. The trainer's freed buffer stays allocated until its
counter is back at 0, and one export opened by two processes (or by none) never gets there: the
buffer of every version would stay on the trainer's GPU. So the trainer exports each buffer
once per process that will open it (`opens`: 1 per generator, its TP width for a vLLM engine
with TP>1), and each opener takes its own handle.

A handle is torch's rebuild function with its arguments (classes, a dtype, a `torch.Size`), which
only pickle carries. Where a handle must cross into a process through a channel that carries
plain values alone (vLLM's engine core in a process of its own, whose messages are msgpack and
refuse pickle unless told to allow it), `plain_handle` gives the same handle as names, numbers
and bytes, and `open_ipc` opens either form.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from runtime.weights.flat import entries_of, fill, indexed, views
from runtime.weights.layout import TensorEntry, dtype_name, parse_dtype


def open_ipc(handle: Any) -> torch.Tensor:
    """The trainer's flat buffer of one version, from one of the handles of its manifest or its
    `plain_handle` form."""
    if isinstance(handle, Mapping):
        return _open_plain(handle)
    rebuild, args = handle
    return rebuild(*args)


# torch's storage classes a CUDA export names (`reduce_tensor`: the tensor's typed storage)
_STORAGES = {cls.__name__: cls for cls in (torch.TypedStorage, torch.UntypedStorage)}
# The arguments of torch's `rebuild_cuda_tensor` after the tensor class, by name.
_ARGS = (
    "size",
    "stride",
    "offset",
    "storage",
    "dtype",
    "device",
    "handle",
    "storage_bytes",
    "storage_offset",
    "requires_grad",
    "ref_counter",
    "ref_counter_offset",
    "event",
    "event_sync",
)


def plain_handle(handle: Any) -> dict[str, Any]:
    """One handle of `export_ipc` as plain values (ints, lists, strings, bytes, bools): what a
    channel without pickle carries. Still one handle: whoever opens it counts as its opener."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, args = handle
    if rebuild is not rebuild_cuda_tensor or args[0] is not torch.Tensor:
        raise ValueError("only a CUDA IPC handle of a plain tensor has a plain form")
    if len(args) != len(_ARGS) + 1:
        raise ValueError(f"a CUDA IPC handle of {len(args)} arguments, not {len(_ARGS) + 1}")
    plain = dict(zip(_ARGS, args[1:], strict=True))
    if plain["storage"] not in _STORAGES.values():
        raise ValueError(f"a CUDA IPC handle of a {plain['storage'].__name__}")
    plain.update(
        size=list(plain["size"]),
        stride=list(plain["stride"]),
        storage=plain["storage"].__name__,
        dtype=dtype_name(plain["dtype"]),
    )
    return plain


def _open_plain(plain: Mapping[str, Any]) -> torch.Tensor:
    from torch.multiprocessing import reductions

    if set(plain) != set(_ARGS):
        raise ValueError(f"a plain CUDA IPC handle has the fields {_ARGS}, not {sorted(plain)}")
    storage = _STORAGES.get(plain["storage"])
    if storage is None:
        raise ValueError(f"a CUDA IPC handle of an unknown storage {plain['storage']!r}")
    args = {
        **plain,
        "size": tuple(plain["size"]),
        "stride": tuple(plain["stride"]),
        "storage": storage,
        "dtype": parse_dtype(plain["dtype"]),
    }
    return reductions.rebuild_cuda_tensor(torch.Tensor, *(args[name] for name in _ARGS))


def export_ipc(flat: torch.Tensor, count: int) -> list[Any]:
    """`count` CUDA IPC handles of `flat`: one for each process that will open it (see the
    module's docstring)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return [reduce_tensor(flat) for _ in range(count)]


def slices(opens: Sequence[int]) -> list[tuple[int, int]]:
    """Each receiver's handles among one version's exports: (first, count), in order."""
    out, first = [], 0
    for n in opens:
        if n < 1:
            raise ValueError(f"an IPC receiver opens each version at least once, not {n}")
        out.append((first, n))
        first += n
    return out


class IpcSender:
    """Trainer rank 0's end: one flat buffer per version still in use, shared by handles.

    `opens`: how many processes open each version, for each receiver of this path (1 each by
    default)."""

    name = "ipc"

    def __init__(self, device: torch.device, opens: Sequence[int] = (1,)) -> None:
        self.device = indexed(torch.device(device))
        self.opens = list(opens)
        self.exports = sum(n for _, n in slices(self.opens))
        self._buffers: dict[int, torch.Tensor] = {}
        self._filling: torch.Tensor | None = None
        self._entries: dict[str, TensorEntry] = {}

    def open(self) -> list[int]:
        """What the receivers need: every receiver's count of opens (their handles' places)."""
        return self.opens

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
        flat, self._filling = self._filling, None
        if flat.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._buffers[version] = flat
        return {"direct": {"ipc": export_ipc(flat, self.exports)}}

    def buffer(self, version: int) -> torch.Tensor:
        """The flat buffer of a finished `version` (the push path sends it too)."""
        return self._buffers[version]

    def stats(self) -> dict[str, float]:
        return {}

    def release(self, version: int) -> None:
        buffer = self._buffers.pop(version, None)
        if buffer is not None and buffer.device.type == "cuda":
            del buffer
            # A freed block whose counter is not yet back at 0 waits in torch's limbo until the
            # next shared block is freed or an allocation fails; by now every opener has let
            # go of it, so give it back to the allocator at once, before the next step.
            torch.cuda.ipc_collect()

    def close(self) -> None:
        self._buffers.clear()


class IpcReceiver:
    """A generator's end: open the version's handles meant for it, load, let go of the mapping.

    `connection`: (first, count), this receiver's handles among each version's exports."""

    name = "ipc"

    def __init__(self, store: Any, connection: tuple[int, int] = (0, 1)) -> None:
        self.store = store
        self.first, self.count = connection
        # the last load in parts: the manifest's wait and fetch (0 where it came with the
        # call), the handle's opening (where the backend says), the load into the backend with
        # the mapping's closing
        self.timings: dict[str, float] = {}

    async def load(
        self, version: int, backend: Any, direct: dict[str, Any] | None = None
    ) -> tuple[int, int]:
        start = time.perf_counter()
        if direct is None:  # not handed over with the call: the version's manifest in the store
            direct = await self.store.direct(version, wait_s=60.0)
        fetched = time.perf_counter()
        if direct is None or "ipc" not in direct:
            raise RuntimeError(f"policy version {version} has no CUDA IPC handle in its manifest")
        entries = entries_of(direct)
        handles = direct["ipc"][self.first : self.first + self.count]
        if len(handles) != self.count:
            raise RuntimeError(
                f"policy version {version} has {len(direct['ipc'])} CUDA IPC handles; this "
                f"generator needs numbers {self.first} to {self.first + self.count - 1}"
            )
        opened = None
        if hasattr(backend, "load_ipc"):
            backend.load_ipc(handles, entries)  # one handle for each process that opens it
            opened = getattr(backend, "ipc_open_s", None)
        else:
            if self.count != 1:
                raise RuntimeError(
                    f"{type(backend).__name__} opens a version once, not {self.count} times"
                )
            flat = open_ipc(handles[0])
            opened = time.perf_counter() - fetched
            backend.load_weights(views(flat, entries))
            del flat  # the mapping closes with the last reference
        done = time.perf_counter()
        self.timings = {"manifest_s": fetched - start, "load_s": done - fetched}
        if opened is not None:
            self.timings["open_s"] = opened
        return version, sum(e.nbytes for e in entries.values())

    def close(self) -> None:
        return None
