"""Direct weight paths from the trainer to the generators; TorchStore stays the index of versions.

Three ways a policy version reaches a generator, chosen per generator when the run starts
(:func:`choose`):

- ``ipc``: the generator's (first) GPU is the trainer's (the one-GPU layout). The trainer copies
  each version into a fresh flat buffer and puts its CUDA IPC handle into the version's
  manifest; the generator opens it and loads from views of the trainer's memory. The buffer
  lives until the controller drops the version (after every generator has moved past it).
- ``push``: the generator has GPUs of its own (any host), its receiver on the first. Trainer
  rank 0 and these generators form one process group outside ``torch.distributed``'s default one
  (NCCL between GPUs, gloo on CPU) that rendezvous through a ``TCPStore`` on the trainer. On each
  publish the trainer copies the weights into one flat staging buffer and a sender thread
  broadcasts it; each generator's receiver thread gets it into its own flat buffer, in the
  background, while the generator keeps sampling. ``update_weights`` then loads from that buffer
  (on-GPU copies). A generator that is behind loads the newest version it has received, never an
  older one than asked for.
  A TP>1 generator's weights live in vLLM's worker procs: they load from the same flat buffer,
  opened by its CUDA IPC handle (``load_flat``), on either path.
- ``store``: the TorchStore buckets of :mod:`runtime.weights.store` (any placement, the fallback).

Every version still gets a manifest in TorchStore, written after its bytes are in place: it says
how to read the version (``direct``) and where each tensor lies in the flat buffer. ``drop``
removes it as before.

Environment: ``FORGESKY_WEIGHT_TRANSPORT`` = ``auto`` (default: ipc/push between GPUs, the store
on CPU) | ``store`` | ``push`` (also on CPU, over gloo; what the CPU tests use).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.weights.layout import TensorEntry, dtype_name, parse_dtype

TRANSPORT_ENV = "FORGESKY_WEIGHT_TRANSPORT"
TRANSPORT_MODES = ("auto", "store", "push")
_ALIGN = 256  # bytes; every tensor of a flat buffer starts on such a boundary
_ANNOUNCE = "forgesky/push/"
_STOP = -1
# A collective whose peer died fails after this instead of hanging the run.
GROUP_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("FORGESKY_PUSH_TIMEOUT_S", 300)))


def transport_mode() -> str:
    from recipes import UserError

    mode = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if mode not in TRANSPORT_MODES:
        raise UserError(f"{TRANSPORT_ENV}={mode!r}: expected one of {', '.join(TRANSPORT_MODES)}")
    return mode


# --- where each side lives, and which path joins them --------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where one service's weights live: its host, its GPU (uuid) or None, its TP width."""

    host: str
    gpu: str | None
    tp: int = 1


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def endpoint(tp: int = 1) -> Endpoint:
    """This proc's :class:`Endpoint` (its first visible GPU, if any)."""
    gpu = None
    if torch.cuda.is_available():
        gpu = str(torch.cuda.get_device_properties(0).uuid)
    return Endpoint(_host_id(), gpu, tp)


def choose(trainer: Endpoint, generators: list[Endpoint], mode: str) -> list[str]:
    """The path ("ipc", "push" or "store") for each generator, in order."""
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


# --- flat buffers -------------------------------------------------------------------------------


def flat_layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, TensorEntry], int]:
    """Byte offsets of every tensor in one flat buffer (``_ALIGN``-aligned); its total size."""
    entries, offset = {}, 0
    for name, tensor in state_dict.items():
        entries[name] = TensorEntry(
            0, offset, tensor.numel(), tuple(tensor.shape), dtype_name(tensor.dtype)
        )
        nbytes = tensor.numel() * tensor.element_size()
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, offset


def views(buffer: torch.Tensor, entries: Mapping[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Tensors of ``entries`` as views into a flat uint8 ``buffer``."""
    out = {}
    for name, e in entries.items():
        dtype = parse_dtype(e.dtype)
        raw = buffer[e.offset : e.offset + e.numel * dtype.itemsize]
        out[name] = raw.view(dtype).view(e.shape)
    return out


def _fill(buffer: torch.Tensor, entries: Mapping[str, TensorEntry], state_dict: Any) -> None:
    with torch.no_grad():
        for name, view in views(buffer, entries).items():
            view.copy_(state_dict[name], non_blocking=True)


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the current CUDA device (`cuda:N`): threads need the index to set it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _group(store: dist.Store, rank: int, world: int, device: torch.device) -> Any:
    """A process group of its own (not torch.distributed's default group, which FSDP or vLLM
    may own in the same proc): NCCL for GPU buffers, gloo for CPU ones."""
    prefixed = dist.PrefixStore("forgesky-weights", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, GROUP_TIMEOUT)


def _broadcast(group: Any, buffer: torch.Tensor, stream: Any) -> None:
    """Broadcast ``buffer`` from rank 0 and wait until this proc's part is done."""
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
    explicit = os.environ.get("FORGESKY_NODE_ADDR")
    if explicit:
        return explicit
    from recipes import UserError
    from runtime.procs.cluster import cluster_from_env

    try:
        cluster = cluster_from_env()
    except UserError:
        cluster = None
    return cluster.ip if cluster is not None and cluster.multi_node else "127.0.0.1"


# --- trainer side -------------------------------------------------------------------------------


@dataclass
class StageStats:
    """One publish on the direct paths: copy into the buffers; the previous push it waited for."""

    bytes: int
    seconds: float
    waited_s: float
    last_push_s: float


class WeightSource:
    """Trainer rank 0's side: stages each version for the ``ipc`` and ``push`` generators.

    ``stage`` returns the manifest's ``direct`` entry. Call ``open_push`` once before the first
    ``stage`` when any generator pushes; ``close`` at the end (it tells the receivers to stop).
    """

    def __init__(self, paths: list[str], device: torch.device) -> None:
        self.paths = list(paths)
        self.device = _indexed(torch.device(device))
        self.entries: dict[str, TensorEntry] | None = None
        self.total = 0
        self._ipc: dict[int, torch.Tensor] = {}
        self._push_buffer: torch.Tensor | None = None
        self._store: dist.TCPStore | None = None
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_push_s = 0.0
        self.pushes = 0

    @property
    def pushing(self) -> int:
        return self.paths.count("push")

    @property
    def needs_store(self) -> bool:
        return "store" in self.paths

    def open_push(self) -> tuple[str, int]:
        """Start the rendezvous store and the sender thread; returns (address, port)."""
        if not self.pushing:
            raise ValueError("no generator takes the push path")
        self._store = dist.TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=GROUP_TIMEOUT,
            use_libuv=True,
        )
        self._thread = threading.Thread(target=self._send_loop, name="weight-push", daemon=True)
        self._thread.start()
        return _advertised_address(), self._store.port

    def stage(
        self, version: int, state_dict: Mapping[str, torch.Tensor]
    ) -> tuple[dict, StageStats]:
        start = time.perf_counter()
        if self.entries is None:
            self.entries, self.total = flat_layout(state_dict)
        elif set(state_dict) != set(self.entries):
            raise ValueError("the published state dict changed its tensors between versions")
        direct: dict[str, Any] = {"tensors": {n: tuple(e) for n, e in self.entries.items()}}
        if "ipc" in self.paths:
            from torch.multiprocessing.reductions import reduce_tensor

            flat = torch.empty(self.total, dtype=torch.uint8, device=self.device)
            _fill(flat, self.entries, state_dict)
            torch.cuda.current_stream(self.device).synchronize()
            self._ipc[version] = flat
            direct["ipc"] = reduce_tensor(flat)
        waited = 0.0
        if self.pushing:
            self._raise_if_failed()
            t = time.perf_counter()
            # The staging buffer is reused: the previous push must be through first.
            if not self._idle.wait(GROUP_TIMEOUT.total_seconds()):
                raise TimeoutError(f"pushing the previous policy version took over {GROUP_TIMEOUT}")
            self._raise_if_failed()
            waited = time.perf_counter() - t
            if self._push_buffer is None:
                self._push_buffer = torch.empty(self.total, dtype=torch.uint8, device=self.device)
            _fill(self._push_buffer, self.entries, state_dict)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            self._idle.clear()
            self._queue.put((version, ready))
            direct["push"] = True
        stats = StageStats(self.total, time.perf_counter() - start, waited, self.last_push_s)
        return direct, stats

    def release(self, version: int) -> None:
        """Free the IPC buffer of a version no generator needs any more."""
        self._ipc.pop(version, None)

    def wait_pushed(self, timeout: float | None = None) -> bool:
        """Block until the last staged version has reached every push generator."""
        done = self._idle.wait(timeout)
        self._raise_if_failed()
        return done

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
            group = _group(self._store, 0, 1 + self.pushing, self.device)
            while True:
                item = self._queue.get()
                if item is None:
                    self._store.set(f"{_ANNOUNCE}{self.pushes + 1}", f"{_STOP}:0")
                    _shutdown(group)
                    return
                version, ready = item
                start = time.perf_counter()
                if ready is not None:
                    stream.wait_event(ready)
                self.pushes += 1
                # Announce first: receivers post their half of the broadcast when they see it.
                self._store.set(f"{_ANNOUNCE}{self.pushes}", f"{version}:{self.total}")
                assert self._push_buffer is not None
                _broadcast(group, self._push_buffer, stream)
                self.last_push_s = time.perf_counter() - start
                self._idle.set()
        except BaseException as e:  # noqa: BLE001 - surfaced by the next stage()
            self._error = e
            self._idle.set()

    def close(self, timeout: float = 30.0) -> None:
        self._ipc.clear()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


# --- generator side ------------------------------------------------------------------------------


class PushReceiver:
    """A generator's receiver thread: each pushed version lands in one flat buffer.

    ``lock`` guards the buffer: held while a version is received and while it is loaded.
    """

    def __init__(self, address: str, port: int, rank: int, world: int, device: torch.device):
        self.device = _indexed(torch.device(device))
        self.rank, self.world = rank, world
        self.version = -1
        self.lock = threading.Lock()
        self.buffer: torch.Tensor | None = None
        self.last_receive_s = 0.0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._store = dist.TCPStore(
            address, port, is_master=False, timeout=GROUP_TIMEOUT, use_libuv=True
        )
        self._thread = threading.Thread(target=self._receive_loop, name="weight-recv", daemon=True)
        self._thread.start()

    def _next_announcement(self, seq: int) -> tuple[int, int] | None:
        key = f"{_ANNOUNCE}{seq}"
        # Polled (a blocking wait with a timeout logs a warning per timeout); the first checks
        # come quickly, later ones every 20 ms: a push takes at least that long to move.
        delay = 0.001
        while not self._stop.is_set():
            if self._store.check([key]):
                version, total = self._store.get(key).decode().split(":")
                return int(version), int(total)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return None

    def _receive_loop(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            group = _group(self._store, self.rank, self.world, self.device)
            seq = 0
            while True:
                seq += 1
                announced = self._next_announcement(seq)
                if announced is None or announced[0] == _STOP:
                    _shutdown(group)
                    return
                version, total = announced
                with self.lock:
                    start = time.perf_counter()
                    if self.buffer is None or self.buffer.numel() != total:
                        self.buffer = None
                        self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
                    _broadcast(group, self.buffer, stream)
                    self.last_receive_s = time.perf_counter() - start
                    self.version = version
                with self._changed:
                    self._changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait_for()
            self._error = e
            with self._changed:
                self._changed.notify_all()

    def wait_for(self, version: int, timeout: float) -> int:
        """Block until a version >= ``version`` has arrived; returns the one that has."""
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

    def close(self, timeout: float = 30.0) -> None:
        """Stop receiving (after the trainer's stop announcement, or now) and end the group."""
        self._stop.set()
        self._thread.join(timeout)


def load_flat(
    backend: Any, flat: torch.Tensor, entries: Mapping[str, TensorEntry], handle: Any = None
) -> None:
    """Load a version lying in one flat buffer into a generator backend: through its own
    `load_flat` where it has one (vLLM: TP workers open the buffer by CUDA IPC), else from
    views of the buffer."""
    if hasattr(backend, "load_flat"):
        backend.load_flat(flat, entries, handle=handle)
    else:
        backend.load_weights(views(flat, entries))


def open_ipc(handle: Any) -> torch.Tensor:
    """The trainer's flat buffer of one version, from the ``ipc`` entry of its manifest."""
    rebuild, args = handle
    return rebuild(*args)
