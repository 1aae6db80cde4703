"""The `push` path: a generator with GPUs of its own (any host) gets each version broadcast into
a flat buffer of its own, in the background, while it keeps sampling.

Trainer rank 0 and the push generators form one process group outside `torch.distributed`'s
default one (NCCL between GPUs, gloo on CPU) that rendezvous through a `TCPStore` on the
trainer. On each publish the trainer copies the weights into one flat staging buffer and a
sender thread broadcasts it; each generator's receiver thread takes it into its buffer. Where
that staging buffer would not fit beside the trainer (`weight_sync.push_buffer groups`), the
sender broadcasts each group's tensors as the trainer gathers them instead, one group in flight
while the next is gathered, and each receiver takes them into their places in its buffer (the
version's layout is announced first); the trainer holds no copy of a version. The
generator's load is then on-GPU copies (a TP>1 generator's workers open the buffer by CUDA
IPC). A generator that is behind loads the newest version it has received, never an older one
than asked for. Every collective carries the recipe's `weight_sync.timeout_s`: a peer that
died fails the push instead of hanging the run.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from runtime.weights.flat import entries_of, fill, indexed, load_flat
from runtime.weights.layout import TensorEntry

_ANNOUNCE = "forgesky/push/"
_STOP = -1
DEFAULT_TIMEOUT_S = 300.0
NODE_ADDR_ENV = "FORGESKY_NODE_ADDR"  # process plumbing: this node's address, if not found


def _group(store: dist.Store, rank: int, world: int, device: torch.device, timeout: Any) -> Any:
    """A process group of its own (not torch.distributed's default group, which FSDP or vLLM
    may own in the same proc): NCCL for GPU buffers, gloo for CPU ones."""
    prefixed = dist.PrefixStore("forgesky-weights", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def _broadcast(group: Any, buffer: torch.Tensor, stream: Any) -> None:
    """Broadcast `buffer` from rank 0 and wait until this proc's part is done."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    if stream is None:
        group.broadcast([buffer], options).wait()
        return
    with torch.cuda.stream(stream):
        group.broadcast([buffer], options).wait()
    stream.synchronize()


def _shutdown(group: Any) -> None:
    """End a group before its thread returns: an NCCL group left to the interpreter's exit is
    torn down while the CUDA driver shuts down, which aborts the process."""
    # A backend without shutdown, or one already ended, has nothing left to end.
    with contextlib.suppress(Exception):
        group.shutdown()


def _advertised_address() -> str:
    """An address of this host that the generators' hosts can reach."""
    explicit = os.environ.get(NODE_ADDR_ENV)
    if explicit:
        return explicit
    from recipes import UserError
    from runtime.procs.cluster import cluster_from_env

    try:
        cluster = cluster_from_env()
    except UserError:
        cluster = None
    return cluster.ip if cluster is not None and cluster.multi_node else "127.0.0.1"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class PushSender:
    """Trainer rank 0's end: stages each version in one buffer that a thread broadcasts.

    `open()` starts the rendezvous store and the thread and returns (address, port); `close()`
    tells the receivers to stop. Beside the ipc path (`lend_from`), a version is broadcast
    from the ipc path's buffer of it: no buffer of its own, no second copy.
    """

    name = "push"

    def __init__(
        self, device: torch.device, receivers: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if receivers < 1:
            raise ValueError("a push needs at least one receiver")
        self.device = indexed(torch.device(device))
        self.receivers = receivers
        self.timeout = _timedelta(timeout_s)
        self.total = 0
        self._buffer: torch.Tensor | None = None
        self._lender: Any = None  # a sender whose buffer of each version this one sends
        self._entries: dict[str, TensorEntry] = {}
        self._store: dist.TCPStore | None = None
        self._queue: queue.Queue[tuple[int, Any, Any] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._waited_s = 0.0
        self.last_push_s = 0.0
        self.pushes = 0
        self._announced = 0
        # weight_sync.push_buffer groups: each group's tensors broadcast as they come, in the
        # layout's order (`_order`, from `_next`), one group in flight (`_group_sent`)
        self.groups = False
        self._order: list[str] = []
        self._next = 0
        self._group_sent = threading.Event()
        self._group_sent.set()
        self._started = 0.0

    def open(self) -> tuple[str, int]:
        self._store = dist.TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=self.timeout,
            use_libuv=True,
        )
        self._thread = threading.Thread(target=self._send_loop, name="weight-push", daemon=True)
        self._thread.start()
        return _advertised_address(), self._store.port

    async def stage(
        self, version: int, state: Mapping[str, torch.Tensor], entries: dict[str, TensorEntry]
    ) -> dict[str, Any]:
        self.begin(version, entries)
        self.fill(state)
        return self.finish(version)

    def stream_groups(self) -> None:
        """Broadcast each group as it is filled instead of staging the whole version."""
        if self._lender is not None:
            raise ValueError("a push that sends the ipc path's buffer has a whole version")
        self.groups = True
        self._buffer = None

    def lend_from(self, lender: Any) -> None:
        """Send `lender.buffer(version)` (filled and finished first) instead of a buffer of
        this sender's own."""
        self._lender = lender
        self._buffer = None

    def begin(self, version: int, entries: dict[str, TensorEntry]) -> None:
        """Wait for the previous push (the buffer is reused), then take `fill`s."""
        total = max(e.offset + e.nbytes for e in entries.values())
        self._raise_if_failed()
        t = time.perf_counter()
        if not self._idle.wait(self.timeout.total_seconds()):
            raise TimeoutError(f"pushing the previous policy version took over {self.timeout}")
        self._raise_if_failed()
        self._waited_s = time.perf_counter() - t
        self.total = total
        self._entries = entries
        if self.groups:
            # the layout first: each receiver then takes the tensors into their places
            self._order = sorted(entries, key=lambda n: entries[n].offset)
            self._next = 0
            places = ";".join(f"{entries[n].offset},{entries[n].nbytes}" for n in self._order)
            self._idle.clear()
            self._queue.put(("announce", f"{version}:{total}:{places}"))
            return
        if self._lender is None and (self._buffer is None or self.total != self._size()):
            self._buffer = torch.empty(total, dtype=torch.uint8, device=self.device)

    def _size(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def fill(self, group: Mapping[str, torch.Tensor]) -> None:
        if self.groups:
            self._send_group(group)
            return
        if self._lender is not None:
            return  # the lender's buffer holds the version
        assert self._buffer is not None
        fill(self._buffer, {n: self._entries[n] for n in group}, group)

    def _send_group(self, group: Mapping[str, torch.Tensor]) -> None:
        """Hand a group's tensors to the sending thread, in the announced order, once the
        group before has gone (its tensors are kept until then, none copied)."""
        names = self._order[self._next : self._next + len(group)]
        if set(names) != set(group):
            raise ValueError(
                "a push a group at a time takes the groups in the layout's order; got "
                f"{sorted(group)[:3]} where {names[:3]} come next"
            )
        self._next += len(names)
        if not self._group_sent.wait(self.timeout.total_seconds()):
            raise TimeoutError(f"pushing a group of the policy version took over {self.timeout}")
        self._raise_if_failed()
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        tensors = [group[n].detach().contiguous().view(-1).view(torch.uint8) for n in names]
        self._group_sent.clear()
        self._queue.put(("group", ready, tensors))

    def finish(self, version: int) -> dict[str, Any]:
        """Hand the filled buffer (or the lender's) to the sending thread, which holds it
        until the broadcast is done; a push a group at a time has sent every group."""
        if self.groups:
            if self._next != len(self._order):
                raise ValueError(
                    f"a push a group at a time got {self._next} of the version's "
                    f"{len(self._order)} tensors"
                )
            self._queue.put(("done", version))
            return {"direct": {"push": True}}
        buffer = self._buffer if self._lender is None else self._lender.buffer(version)
        if buffer.numel() != self.total or buffer.device != self.device:
            raise ValueError(
                f"a push of {buffer.numel()} bytes on {buffer.device}, expected {self.total} "
                f"on {self.device}"
            )
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._idle.clear()
        self._queue.put(("announce", f"{version}:{buffer.numel()}"))
        self._queue.put(("whole", ready, buffer))
        self._queue.put(("done", version))
        return {"direct": {"push": True}}

    @property
    def own_bytes(self) -> int:
        """Bytes of the buffer this sender keeps of its own (0 while it sends a lender's, or
        a group at a time)."""
        return self._size()

    def stats(self) -> dict[str, float]:
        """The last stage's wait for the push before it, and that push's seconds."""
        return {"push_wait_s": self._waited_s, "push_s": self.last_push_s}

    def wait_pushed(self, timeout: float | None = None) -> bool:
        """Block until the last staged version has reached every receiver."""
        done = self._idle.wait(timeout)
        self._raise_if_failed()
        return done

    def release(self, version: int) -> None:
        return None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"weight push failed: {self._error}") from self._error

    def _send_loop(self) -> None:
        assert self._store is not None
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            group = _group(self._store, 0, 1 + self.receivers, self.device, self.timeout)
            while True:
                item = self._queue.get()
                if item is None:
                    self._announce(f"{_STOP}:0")
                    _shutdown(group)
                    return
                kind = item[0]
                if kind == "announce":
                    # receivers post their half of the broadcasts when they see it
                    self._started = time.perf_counter()
                    self._announce(item[1])
                elif kind in ("whole", "group"):
                    _, ready, payload = item
                    if ready is not None:
                        stream.wait_event(ready)
                    for tensor in [payload] if kind == "whole" else payload:
                        _broadcast(group, tensor, stream)  # synchronised: it may go after
                    del item, payload
                    if kind == "group":
                        self._group_sent.set()
                else:  # done: the version has reached every receiver
                    self.pushes += 1
                    self.last_push_s = time.perf_counter() - self._started
                    self._idle.set()
        except BaseException as e:  # noqa: BLE001 - surfaced by the next stage()
            self._error = e
            self._group_sent.set()
            self._idle.set()

    def _announce(self, what: str) -> None:
        assert self._store is not None
        self._announced += 1
        self._store.set(f"{_ANNOUNCE}{self._announced}", what)

    def close(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


class PushReceiver:
    """A generator's end: a receiver thread takes each pushed version into one flat buffer.

    `lock` guards the buffer: held while a version is received and while it is loaded.
    """

    name = "push"

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world: int,
        device: torch.device,
        *,
        store: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.device = indexed(torch.device(device))
        self.rank, self.world = rank, world
        self.store = store  # the weight store: manifests say where each tensor lies
        self.timeout = _timedelta(timeout_s)
        self.version = -1
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None
        self.last_receive_s = 0.0
        # (start, end) on time.monotonic() of the latest receives, for receiving_between
        self.receives: collections.deque[tuple[float, float]] = collections.deque(maxlen=16)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._store = dist.TCPStore(
            address, port, is_master=False, timeout=self.timeout, use_libuv=True
        )
        self._thread = threading.Thread(target=self._receive_loop, name="weight-recv", daemon=True)
        self._thread.start()

    def _next_announcement(self, seq: int) -> tuple[int, int, list[tuple[int, int]]] | None:
        """The next version announced: (version, total bytes, the (offset, bytes) places its
        broadcasts fill: the whole buffer, or each tensor where it comes a group at a time)."""
        key = f"{_ANNOUNCE}{seq}"
        # Polled (a blocking wait with a timeout logs a warning per timeout); the first checks
        # come quickly, later ones every 20 ms: a push takes at least that long to move.
        delay = 0.001
        while not self._stop.is_set():
            if self._store.check([key]):
                version, total, *places = self._store.get(key).decode().split(":")
                size = int(total)
                if not places:
                    return int(version), size, [(0, size)]
                pairs = [p.split(",") for p in places[0].split(";") if p]
                return int(version), size, [(int(o), int(n)) for o, n in pairs]
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return None

    def _receive_loop(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            group = _group(self._store, self.rank, self.world, self.device, self.timeout)
            seq = 0
            while True:
                seq += 1
                announced = self._next_announcement(seq)
                if announced is None or announced[0] == _STOP:
                    _shutdown(group)
                    return
                version, total, places = announced
                with self.lock:
                    start = time.monotonic()
                    if self.buffer is None or self.buffer.numel() != total:
                        self.buffer = None
                        self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
                    for offset, nbytes in places:
                        _broadcast(group, self.buffer[offset : offset + nbytes], stream)
                    end = time.monotonic()
                    self.last_receive_s = end - start
                    self.receives.append((start, end))
                    self.version = version
                with self._changed:
                    self._changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait_for()
            self._error = e
            with self._changed:
                self._changed.notify_all()

    def receiving_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] (time.monotonic) this receiver spent receiving versions
        (its broadcasts on the GPU beside whatever the generator ran then)."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in list(self.receives))

    def wait_for(self, version: int, timeout: float) -> int:
        """Block until a version >= `version` has arrived; returns the one that has."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.version < version and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    break
                self._changed.wait(min(left, 1.0))
        if self._error is not None:
            raise RuntimeError(f"weight receiver failed: {self._error}") from self._error
        if self.version < version:
            raise TimeoutError(
                f"policy version {version} was not pushed within {timeout:g} s "
                f"(last received: {self.version})"
            )
        return self.version

    async def load(
        self, version: int, backend: Any, direct: dict[str, Any] | None = None
    ) -> tuple[int, int]:
        """Load `version` (or a newer one already here) into `backend`: (version, bytes).
        `direct`: the version's manifest entry where the call brings it (else the store's)."""
        import asyncio

        if backend.policy_version >= version:
            return backend.policy_version, 0  # a newer version came with an earlier call
        if direct is None:
            direct = await self.store.direct(version, wait_s=60.0)
        if direct is None:
            raise RuntimeError(f"policy version {version} has no direct entry in its manifest")
        entries = entries_of(direct)
        await asyncio.to_thread(self.wait_for, version, self.timeout.total_seconds())
        with self.lock:
            loaded = self.version
            load_flat(backend, self.buffer, entries)
        return loaded, sum(e.nbytes for e in entries.values())

    def close(self, timeout: float = 5.0) -> None:
        """Stop receiving (after the trainer's stop announcement, or now) and end the group."""
        self._stop.set()
        self._thread.join(timeout)
