"""The node watch with real sockets: joining, the end of a run, and a node or controller lost.

Nodes are loopback addresses (127.0.0.x all reach this machine) on a free port.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from runtime_helpers import free_port

from runtime.procs.cluster import Cluster
from runtime.procs.nodewatch import NodeWatch, Outcome, follow_controller, release_workers

IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
FAST = {"interval": 0.1, "silence": 1.0}


@pytest.fixture
def cluster() -> Cluster:
    return Cluster(rank=0, ips=IPS, port=free_port())


class Losses:
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []
        self.event = threading.Event()

    def __call__(self, rank: int, reason: str) -> None:
        self.seen.append((rank, reason))
        self.event.set()


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def follow(cluster: Cluster, rank: int, **options) -> tuple[threading.Thread, list[Outcome]]:
    outcomes: list[Outcome] = []
    node = Cluster(rank=rank, ips=cluster.ips, port=cluster.port)
    options = {"join_timeout": 10.0, **FAST, **options}
    thread = threading.Thread(target=lambda: outcomes.append(follow_controller(node, **options)))
    thread.start()
    return thread, outcomes


def raw_join(cluster: Cluster, line: bytes) -> socket.socket:
    sock = socket.create_connection(cluster.address(0), timeout=5)
    sock.sendall(line)
    return sock


def test_workers_join_and_leave_with_the_runs_exit_code(cluster):
    losses = Losses()
    watch = NodeWatch(cluster, losses, run_id="1234-abcd", **FAST)
    watch.start()
    assert watch.missing() == [1, 2]
    joined: list[str] = []
    workers = [follow(cluster, rank, on_joined=joined.append) for rank in (1, 2)]
    until(lambda: watch.missing() == [])
    time.sleep(0.5)  # several heartbeats: nobody is taken for lost
    watch.finish(3)
    for thread, outcomes in workers:
        thread.join(10)
        assert outcomes == [Outcome(3, "the controller finished (exit code 3)", "1234-abcd")]
    assert joined == [f"127.0.0.1:{cluster.port}"] * 2
    assert losses.seen == [] and watch.lost == {}


def test_workers_of_a_run_with_nothing_to_do_are_released_with_its_exit_code(cluster):
    # (node 0 found its run finished already: the workers must not wait for it, then fail)
    workers = [follow(cluster, rank) for rank in (1, 2)]
    began = time.monotonic()
    release_workers(cluster, 0, join_timeout=10.0)
    assert time.monotonic() - began < 5
    for thread, outcomes in workers:
        thread.join(10)
        assert outcomes == [Outcome(0, "the controller finished (exit code 0)", None)]


def test_a_worker_whose_connection_closes_is_lost_at_once(cluster):
    losses = Losses()
    watch = NodeWatch(cluster, losses, interval=0.1, silence=60.0)
    watch.start()
    sock = raw_join(cluster, b"join 2\n")
    until(lambda: watch.missing() == [1])
    sock.close()
    assert losses.event.wait(5)
    assert losses.seen == [(2, "connection to its worker closed")]
    assert watch.lost == {2: "connection to its worker closed"}
    watch.finish(1)


def test_a_silent_worker_is_lost_after_the_silence(cluster):
    losses = Losses()
    watch = NodeWatch(cluster, losses, **FAST)
    watch.start()
    sock = raw_join(cluster, b"join 1\n")  # joins, then never beats: a machine gone dark
    assert losses.event.wait(10)
    assert losses.seen == [(1, "no heartbeat for 1 s")]
    sock.close()
    watch.finish(1)


def test_after_quiesce_workers_may_leave_unreported(cluster):
    losses = Losses()
    watch = NodeWatch(cluster, losses, **FAST)
    watch.start()
    sock = raw_join(cluster, b"join 1\n")
    until(lambda: 1 in watch.joined)
    watch.quiesce()
    sock.close()
    time.sleep(0.5)
    watch.finish(0)
    assert losses.seen == []


@pytest.mark.parametrize(
    ("line", "refusal"),
    [
        (b"join 7\n", "not a worker rank of this run (it has nodes 0-2)"),
        (b"join 0\n", "not a worker rank of this run (it has nodes 0-2)"),
        (b"hello\n", "not a worker rank of this run (it has nodes 0-2)"),
    ],
)
def test_a_stranger_is_refused(cluster, line, refusal):
    watch = NodeWatch(cluster, Losses(), **FAST)
    watch.start()
    with raw_join(cluster, line) as sock:
        assert sock.makefile().readline().strip() == f"refuse {refusal}"
    assert watch.missing() == [1, 2]
    watch.finish(1)


def test_a_rank_joins_once(cluster):
    watch = NodeWatch(cluster, Losses(), **FAST)
    watch.start()
    first = raw_join(cluster, b"join 1\n")
    until(lambda: 1 in watch.joined)
    thread, outcomes = follow(cluster, 1)
    thread.join(10)
    assert outcomes[0].code == 2
    assert outcomes[0].reason.endswith("refused this node: node 1 (127.0.0.2) already joined")
    first.close()
    watch.finish(1)


def test_a_worker_without_controller_gives_up(cluster):
    thread, outcomes = follow(cluster, 1, join_timeout=0.5)
    thread.join(10)
    assert outcomes == [
        Outcome(1, f"no controller answered at 127.0.0.1:{cluster.port} within 0.5 s")
    ]


def test_a_worker_leaves_when_the_controller_goes_away_or_goes_silent(cluster):
    with socket.create_server(cluster.address(0)) as server:
        thread, outcomes = follow(cluster, 1)
        conn, _ = server.accept()
        conn.sendall(b"welcome r1\n")
        conn.close()  # the controller's process died
        thread.join(10)
        assert outcomes == [
            Outcome(1, f"the controller at 127.0.0.1:{cluster.port} went away", "r1")
        ]

        thread, outcomes = follow(cluster, 1)
        conn, _ = server.accept()
        conn.sendall(b"welcome r2\n")  # ... and then nothing: its machine went dark
        thread.join(10)
        conn.close()
        assert outcomes == [
            Outcome(
                1, f"no heartbeat from the controller at 127.0.0.1:{cluster.port} for 1 s", "r2"
            )
        ]
