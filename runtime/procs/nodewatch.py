"""Heartbeats between the controller and the worker nodes: who joined, who is gone.

Every worker node dials the controller's port on the head node and says `join <rank>`; the
controller answers `welcome <run id>`, and from then on both ends send `beat` every `interval`
seconds. A node is lost when its connection closes (its processes died: the kernel closes the
socket) or stays silent for `silence` seconds (the machine or its network went away, and nothing
closes anything). Workers learn the same about the controller, which at the end sends
`done <exit code>`.

Why not Monarch's supervision alone: when a whole host vanishes, its procs' failures surface
only after a minute or more (`no status received from process`), naming a mesh but not the
node. Plain sockets on their own threads also keep beating while the controller's event loop
is busy.
"""

from __future__ import annotations

import contextlib
import select
import selectors
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from runtime.procs.cluster import Cluster

HEARTBEAT_S = 2.0
SILENCE_S = 20.0
_MAX_LINE = 256


@dataclass
class _Peer:
    sock: socket.socket
    last_seen: float
    rank: int | None = None
    buffer: bytes = b""


@dataclass
class Outcome:
    """How a worker's time with the controller ended: the exit code and why."""

    code: int
    reason: str
    run_id: str | None = None


def _lines(peer: _Peer, data: bytes) -> list[str]:
    peer.buffer += data
    *complete, peer.buffer = peer.buffer.split(b"\n")
    if len(peer.buffer) > _MAX_LINE:
        raise ValueError("line too long")
    return [line.decode("ascii", "replace").strip() for line in complete]


def _send(sock: socket.socket, line: str) -> None:
    # Lines are a few bytes: a full send buffer means the peer stopped reading, which its
    # silence shows soon enough.
    with contextlib.suppress(BlockingIOError):
        sock.send(line.encode() + b"\n")


class NodeWatch:
    """The controller's end: accepts worker nodes, beats, and reports a lost node once.

    `on_lost(rank, reason)` runs on the watch thread.
    """

    def __init__(
        self,
        cluster: Cluster,
        on_lost: Callable[[int, str], None],
        *,
        run_id: str = "",
        interval: float = HEARTBEAT_S,
        silence: float = SILENCE_S,
    ) -> None:
        self.cluster = cluster
        self.on_lost = on_lost
        self.run_id = run_id
        self.interval = interval
        self.silence = silence
        self.joined: dict[int, float] = {}  # rank -> when it joined
        self.lost: dict[int, str] = {}  # rank -> why
        self._peers: list[_Peer] = []
        self._quiet = False
        self._done_code: int | None = None
        self._thread: threading.Thread | None = None
        self._server: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()

    def start(self) -> None:
        """Listen on the head node's port; raises OSError if it cannot."""
        family = socket.AF_INET6 if ":" in self.cluster.head else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(self.cluster.address(0))
            server.listen(max(8, self.cluster.nodes))
        except OSError:
            server.close()
            raise
        server.setblocking(False)
        self._server = server
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()

    def missing(self) -> list[int]:
        """Worker ranks that have not joined (lost ones count as joined)."""
        return [n for n in range(1, self.cluster.nodes) if n not in self.joined]

    def quiesce(self) -> None:
        """Stop reporting losses: the run is ending and the workers may go first."""
        self._quiet = True

    def finish(self, code: int, timeout: float = 5.0) -> None:
        """Tell every connected worker the run ended with `code`, then close everything."""
        self._quiet = True
        self._done_code = code
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
        for sock in (self._wake_r, self._wake_w):
            sock.close()

    # --- the watch thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # a bug here must show, not just silence the heartbeats
            traceback.print_exc()
            raise

    def _serve(self) -> None:
        assert self._server is not None
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        last_beat = 0.0
        try:
            while self._done_code is None:
                for key, _ in sel.select(timeout=self.interval / 4):
                    if key.fileobj is self._server:
                        self._accept(sel)
                    elif key.fileobj is not self._wake_r:
                        self._read(sel, key.data)
                now = time.monotonic()
                if now - last_beat >= self.interval:
                    last_beat = now
                    for peer in list(self._peers):
                        if peer.rank is not None:
                            self._try_send(sel, peer, "beat")
                for peer in list(self._peers):
                    if now - peer.last_seen > self.silence:
                        self._drop(sel, peer, f"no heartbeat for {self.silence:g} s")
            for peer in list(self._peers):
                if peer.rank is not None:
                    with contextlib.suppress(OSError):
                        peer.sock.setblocking(True)
                        peer.sock.settimeout(1.0)
                        peer.sock.sendall(f"done {self._done_code}\n".encode())
                self._close(sel, peer)
        finally:
            sel.close()
            self._server.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._server is not None
        try:
            sock, _ = self._server.accept()
        except OSError:
            return
        sock.setblocking(False)
        peer = _Peer(sock, time.monotonic())
        self._peers.append(peer)
        sel.register(sock, selectors.EVENT_READ, peer)

    def _read(self, sel: selectors.BaseSelector, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(4096)
        except BlockingIOError:
            return
        except ConnectionResetError:  # it died with our heartbeats unread
            data = b""
        except OSError as e:
            self._drop(sel, peer, f"connection to its worker failed ({e.strerror or e})")
            return
        if not data:
            self._drop(sel, peer, "connection to its worker closed")
            return
        peer.last_seen = time.monotonic()
        try:
            lines = _lines(peer, data)
        except ValueError:
            self._drop(sel, peer, "sent garbage")
            return
        for line in lines:
            if peer.rank is None:
                self._join(sel, peer, line)
                if peer.rank is None:
                    return

    def _join(self, sel: selectors.BaseSelector, peer: _Peer, line: str) -> None:
        word, _, value = line.partition(" ")
        rank = int(value) if word == "join" and value.strip().isdigit() else None
        if rank is None or not 0 < rank < self.cluster.nodes:
            refusal = f"not a worker rank of this run (it has nodes 0-{self.cluster.nodes - 1})"
        elif rank in self.joined:
            refusal = f"{self.cluster.name(rank)} already joined"
        else:
            refusal = None
        if refusal is not None:
            self._try_send(sel, peer, f"refuse {refusal}")
            self._close(sel, peer)
            return
        assert rank is not None
        peer.rank = rank
        self._try_send(sel, peer, f"welcome {self.run_id}")
        self.joined[rank] = time.monotonic()

    def _try_send(self, sel: selectors.BaseSelector, peer: _Peer, line: str) -> None:
        try:
            _send(peer.sock, line)
        except OSError as e:
            self._drop(sel, peer, f"connection to its worker failed ({e.strerror or e})")

    def _drop(self, sel: selectors.BaseSelector, peer: _Peer, reason: str) -> None:
        if peer not in self._peers:
            return
        self._close(sel, peer)
        if peer.rank is None or self._quiet:
            return
        self.lost[peer.rank] = reason
        self.on_lost(peer.rank, reason)

    def _close(self, sel: selectors.BaseSelector, peer: _Peer) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(peer.sock)
        with contextlib.suppress(ValueError):
            self._peers.remove(peer)
        peer.sock.close()


def release_workers(cluster: Cluster, code: int, *, join_timeout: float) -> None:
    """Node 0 found nothing to run: let the worker nodes join (within `join_timeout` s) and
    tell them the run ended with `code`, rather than leave them waiting for a controller that
    will not come, then failing. Where the port cannot be taken, they are left to that."""
    watch = NodeWatch(cluster, lambda rank, reason: None)
    try:
        watch.start()
    except OSError:
        return
    deadline = time.monotonic() + join_timeout
    while watch.missing() and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.finish(code)


def follow_controller(
    cluster: Cluster,
    *,
    join_timeout: float,
    interval: float = HEARTBEAT_S,
    silence: float = SILENCE_S,
    on_joined: Callable[[str], None] | None = None,
) -> Outcome:
    """The worker's end: join the controller, beat, and return when the run is over for us.

    Retries the connection until `join_timeout` s have passed. The outcome's code is the
    controller's (`done`), 1 if it went away or never answered, 2 if it refused this node.
    """
    head = f"{cluster.head}:{cluster.port}"
    deadline = time.monotonic() + join_timeout
    sock = None
    while sock is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return Outcome(1, f"no controller answered at {head} within {join_timeout:g} s")
        try:
            sock = socket.create_connection(cluster.address(0), timeout=min(2.0, left))
        except OSError:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    with sock:
        sock.setblocking(False)
        _send(sock, f"join {cluster.rank}")
        peer = _Peer(sock, time.monotonic())
        run_id: str | None = None
        last_beat = time.monotonic()
        while True:
            readable, _, _ = _select_read(sock, interval / 4)
            now = time.monotonic()
            if readable:
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    data = None
                except ConnectionResetError:
                    data = b""
                except OSError as e:
                    return Outcome(1, f"connection to the controller at {head} failed: {e}", run_id)
                if data == b"":
                    return Outcome(1, f"the controller at {head} went away", run_id)
                if data:
                    peer.last_seen = now
                    for line in _lines(peer, data):
                        word, _, value = line.partition(" ")
                        if word == "welcome":
                            run_id = value or None
                            if on_joined is not None:
                                on_joined(head)
                        elif word == "done":
                            code = int(value) if value.strip().lstrip("-").isdigit() else 1
                            return Outcome(
                                code, f"the controller finished (exit code {code})", run_id
                            )
                        elif word == "refuse":
                            return Outcome(
                                2, f"the controller at {head} refused this node: {value}"
                            )
            if now - peer.last_seen > silence:
                return Outcome(
                    1, f"no heartbeat from the controller at {head} for {silence:g} s", run_id
                )
            if run_id is not None and now - last_beat >= interval:
                last_beat = now
                try:
                    _send(sock, "beat")
                except OSError as e:
                    return Outcome(1, f"connection to the controller at {head} failed: {e}", run_id)


def _select_read(sock: socket.socket, timeout: float) -> tuple[list, list, list]:
    try:
        return select.select([sock], [], [], timeout)
    except InterruptedError:  # a signal: the caller's loop checks its clocks and comes back
        return [], [], []
