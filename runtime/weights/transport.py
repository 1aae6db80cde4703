"""How a policy version travels from the trainer to each generator: one `Transport` per path,
chosen per generator when the run starts; TorchStore is the index of versions whatever the path.

- `store` (runtime/weights/store.py): TorchStore's buckets; any placement, the fallback.
- `ipc` (runtime/weights/ipc.py): the generator's first GPU is the trainer's; it reads the
  trainer's memory through a CUDA IPC handle.
- `push` (runtime/weights/push.py): the generator has GPUs of its own; a sender thread
  broadcasts each version into its buffer while it keeps sampling.

Every version gets a manifest in TorchStore, written after its bytes are in place (by any path):
it says where the store holds them (`buckets`, `tensors`), and for the direct paths where each
tensor lies in the flat buffer and how to reach it (`direct`). `drop` removes it.

Adding a path is one module with a sender (`open`, `stage`, `stats`, `release`, `close`) and a
receiver (`load`, `close`), its entry in `TRANSPORTS`, and its rule in `choose`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.weights.flat import flat_layout
from runtime.weights.layout import TensorEntry

MODES = ("auto", "store", "push")


@dataclass(frozen=True)
class Endpoint:
    """Where one service's weights live: its host, its GPU (uuid) or None, its TP width, and
    how many of its processes open a version handed over by CUDA IPC."""

    host: str
    gpu: str | None
    tp: int = 1
    ipc_opens: int = 1


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def endpoint(tp: int = 1, ipc_opens: int = 1) -> Endpoint:
    """This proc's `Endpoint` (its first visible GPU, if any)."""
    gpu = None
    if torch.cuda.is_available():
        gpu = str(torch.cuda.get_device_properties(0).uuid)
    return Endpoint(_host_id(), gpu, tp, ipc_opens)


def choose(trainer: Endpoint, generators: list[Endpoint], mode: str) -> list[str]:
    """The path ("ipc", "push" or "store") for each generator, in order.

    `mode` is the recipe's weight_sync.transport: "auto" (the direct paths between GPUs, the
    store on CPU), "store" (always), or "push" (also on CPU, over gloo).
    """
    if mode not in MODES:
        raise ValueError(f"unknown weight transport mode {mode!r}; expected one of {MODES}")
    paths = []
    for gen in generators:
        if mode == "store":
            paths.append("store")
        elif gen.gpu is not None and gen.gpu == trainer.gpu and gen.host == trainer.host:
            paths.append("ipc")
        elif mode == "push" or (trainer.gpu is not None and gen.gpu is not None):
            paths.append("push")
        else:
            paths.append("store")
    return paths


class Sender(Protocol):
    """Trainer rank 0's end of one path."""

    name: str

    def open(self) -> Any:
        """Start serving; what the receivers need to connect (None if nothing)."""

    async def stage(
        self, version: int, state: Mapping[str, torch.Tensor], entries: dict[str, TensorEntry]
    ) -> dict[str, Any]:
        """Put `version`'s bytes where this path's receivers read them; the manifest entries
        that say how (merged into the version's manifest)."""

    def stats(self) -> dict[str, float]:
        """Seconds the last stage spent on this path's own work, by name."""

    def release(self, version: int) -> None:
        """No generator needs `version` any more."""

    def close(self) -> None: ...


class Receiver(Protocol):
    """A generator's end of one path."""

    name: str

    async def load(
        self, version: int, backend: Any, direct: dict[str, Any] | None = None
    ) -> tuple[int, int]:
        """Load `version` (or a newer one already received) into the generator backend;
        returns the version loaded and the bytes it took. `direct`: the `direct` entry of the
        version's manifest where the caller has it (the publish hands it to the controller),
        which a direct path then does not fetch from the store."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """One path: how its sender and each receiver are made.

    `sender(store, device, opens, timeout_s)` (`opens`: for each receiver of this path, how
    many of its processes open a version: `Endpoint.ipc_opens`); `connection(info, index,
    count)` is what receiver `index` (0-based among this path's `count`) needs from the
    sender's `open()`; `receiver(store, device, connection, timeout_s)`.
    """

    name: str
    sender: Callable[..., Sender]
    connection: Callable[[Any, int, int], Any]
    receiver: Callable[..., Receiver]


def _store_sender(store: Any, device: Any, opens: list[int], timeout_s: float) -> Sender:
    from runtime.weights.store import StoreSender

    return StoreSender(store)


def _store_receiver(store: Any, device: Any, connection: Any, timeout_s: float) -> Receiver:
    from runtime.weights.store import StoreReceiver

    return StoreReceiver(store)


def _ipc_sender(store: Any, device: Any, opens: list[int], timeout_s: float) -> Sender:
    from runtime.weights.ipc import IpcSender

    return IpcSender(device, opens)


def _ipc_connection(info: Any, index: int, count: int) -> Any:
    from runtime.weights.ipc import slices

    return slices(info)[index]  # this receiver's handles among each version's


def _ipc_receiver(store: Any, device: Any, connection: Any, timeout_s: float) -> Receiver:
    from runtime.weights.ipc import IpcReceiver

    return IpcReceiver(store, connection)


def _push_sender(store: Any, device: Any, opens: list[int], timeout_s: float) -> Sender:
    from runtime.weights.push import PushSender

    return PushSender(device, len(opens), timeout_s)


def _push_connection(info: Any, index: int, count: int) -> Any:
    address, port = info
    return address, port, index + 1, count + 1  # rank 0 is the trainer


def _push_receiver(store: Any, device: Any, connection: Any, timeout_s: float) -> Receiver:
    from runtime.weights.push import PushReceiver

    address, port, rank, world = connection
    return PushReceiver(address, port, rank, world, device, store=store, timeout_s=timeout_s)


def _nothing(info: Any, index: int, count: int) -> None:
    return None


TRANSPORTS: dict[str, Transport] = {
    "store": Transport("store", _store_sender, _nothing, _store_receiver),
    "ipc": Transport("ipc", _ipc_sender, _ipc_connection, _ipc_receiver),
    "push": Transport("push", _push_sender, _push_connection, _push_receiver),
}


def connections(paths: list[str], opened: Mapping[str, Any]) -> list[Any]:
    """What each generator's receiver needs, from what each path's sender `open()`ed."""
    seen: dict[str, int] = {}
    out = []
    for path in paths:
        index = seen.get(path, 0)
        seen[path] = index + 1
        out.append(TRANSPORTS[path].connection(opened.get(path), index, paths.count(path)))
    return out


def receiver(
    path: str, store: Any, device: Any, connection: Any = None, timeout_s: float = 300.0
) -> Receiver:
    """A generator's end of `path`."""
    return TRANSPORTS[path].receiver(store, device, connection, timeout_s)


class Publisher:
    """Trainer rank 0's side of every path in use: each version goes out by each once, then
    its manifest is written to the store (the index of versions)."""

    def __init__(
        self,
        store: Any,
        paths: list[str],
        device: Any,
        timeout_s: float = 300.0,
        ipc_opens: list[int] | None = None,
        push_groups: bool = False,
    ) -> None:
        """`paths`: each generator's path; `ipc_opens`: each generator's `Endpoint.ipc_opens`
        (1 each if not given); `push_groups`: a push alone sends each group as it is handed
        over (`weight_sync.push_buffer groups`) instead of staging the whole version."""
        self.store = store
        self.paths = list(paths)
        opens = list(ipc_opens) if ipc_opens is not None else [1] * len(self.paths)
        if len(opens) != len(self.paths):
            raise ValueError(f"{len(opens)} counts of openers for {len(self.paths)} generators")
        self.senders = [
            TRANSPORTS[name].sender(
                store,
                device,
                [n for p, n in zip(self.paths, opens, strict=True) if p == name],
                timeout_s,
            )
            for name in dict.fromkeys(self.paths)
        ]
        self.entries: dict[str, TensorEntry] | None = None
        self.names: set[str] | None = None  # what `publish_groups` sent first
        # Beside the ipc path the push path sends the ipc path's buffer of each version (one
        # flat copy of a version on trainer rank 0, not two): ipc finishes first.
        self.senders.sort(key=lambda s: s.name != "ipc")
        by_name = {s.name: s for s in self.senders}
        if "ipc" in by_name and "push" in by_name:
            by_name["push"].lend_from(by_name["ipc"])
        elif push_groups and "push" in by_name:
            by_name["push"].stream_groups()

    def set_layout(self, state: Mapping[str, torch.Tensor]) -> None:
        """Fix the flat layout of every version from tensors of the right names, shapes and
        dtypes (meta tensors do): the direct paths then stream even the first version a
        group at a time, never holding it whole (a resumed run's first publish has the
        optimizer state beside it)."""
        self.entries, _ = flat_layout(state)

    def open(self) -> dict[str, Any]:
        """Start every path's sender; what their receivers need, by path."""
        return {s.name: s.open() for s in self.senders}

    async def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Send `version` by every path and index it; bytes and seconds, per path too, and the
        manifest's `direct` entry where a direct path is in use."""
        start = time.perf_counter()
        entries, _ = flat_layout(state)
        if self.entries is None:
            self.entries = entries
        elif set(entries) != set(self.entries):
            raise ValueError("the published state dict changed its tensors between versions")
        manifest: dict[str, Any] = {"buckets": [], "tensors": {}}
        direct = any(s.name != "store" for s in self.senders)
        if direct:
            manifest["direct"] = {"tensors": {n: tuple(e) for n, e in entries.items()}}
        stats: dict[str, float] = {}
        for sender in self.senders:
            t = time.perf_counter()
            part = await sender.stage(version, state, entries)
            stats[f"stage_{sender.name}_s"] = time.perf_counter() - t
            stats.update(sender.stats())
            for key, value in part.items():
                if key == "direct":
                    manifest["direct"].update(value)
                else:
                    manifest[key] = value
        has_store = any(s.name == "store" for s in self.senders)
        await self.store.put_manifest(version, manifest, check=not has_store)
        nbytes = sum(e.nbytes for e in entries.values())
        handed = {"direct": manifest["direct"]} if direct else {}
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, **stats, **handed}

    async def publish_groups(
        self, version: int, groups: Iterable[Mapping[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """`publish` from a version handed over a group at a time (`hf_groups` of a sharded
        trainer). With the store path alone each group is written and dropped before the next
        is gathered, so the trainer never holds the whole version; the direct paths send one
        flat buffer and take the groups joined."""
        if [s.name for s in self.senders] != ["store"]:
            if self.entries is not None and all(hasattr(s, "fill") for s in self.senders):
                return await self._stream_direct(version, groups)
            # Without a layout (`set_layout`) the first version fixes it from the joined
            # state; the store beside a direct path takes the whole version too.
            state: dict[str, torch.Tensor] = {}
            for group in groups:
                state.update(group)
            return await self.publish(version, state)
        start = time.perf_counter()
        manifest = await self.store.put_groups(version, groups)
        names = set(manifest["tensors"])
        if self.names is None:
            self.names = names
        elif names != self.names:
            await self.store.drop(version)  # its buckets, written before this was known
            raise ValueError("the published state dict changed its tensors between versions")
        staged = time.perf_counter() - start
        await self.store.put_manifest(version, manifest)
        nbytes = sum(TensorEntry(*e).nbytes for e in manifest["tensors"].values())
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "stage_store_s": staged}

    async def _stream_direct(
        self, version: int, groups: Iterable[Mapping[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """Direct paths only, layout known: each group goes into every sender's flat buffer as
        it is gathered and is dropped before the next, so the trainer holds the buffer and one
        group, never a second whole copy of the version."""
        assert self.entries is not None
        start = time.perf_counter()
        for sender in self.senders:
            sender.begin(version, self.entries)
        names: set[str] = set()
        changed = ValueError("the published state dict changed its tensors between versions")
        for group in groups:
            if not group.keys() <= self.entries.keys():
                raise changed
            names.update(group)
            for sender in self.senders:
                sender.fill(group)
        if names != set(self.entries):
            raise changed
        manifest: dict[str, Any] = {
            "buckets": [],
            "tensors": {},
            "direct": {"tensors": {n: tuple(e) for n, e in self.entries.items()}},
        }
        stats: dict[str, float] = {"stage_direct_s": time.perf_counter() - start}
        for sender in self.senders:  # ipc first: a push lent its buffer sends it
            manifest["direct"].update(sender.finish(version)["direct"])
            stats.update(sender.stats())
        await self.store.put_manifest(version, manifest, check=True)
        nbytes = sum(e.nbytes for e in self.entries.values())
        # the receivers' part of the manifest, for the controller to hand them with the load
        # (a fetch from the store less on the way to the new version)
        return {
            "bytes": nbytes,
            "seconds": time.perf_counter() - start,
            **stats,
            "direct": manifest["direct"],
        }

    def loaded(self, version: int) -> None:
        """Every generator has loaded `version`: the direct paths let go of its buffers (the
        generators hold their own copy; the store keeps the version until `drop`)."""
        for sender in self.senders:
            if sender.name != "store":
                sender.release(version)

    async def drop(self, version: int) -> None:
        """Forget `version`: its buffers on every path, its keys in the store."""
        for sender in self.senders:
            sender.release(version)
        await self.store.drop(version)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
