"""Multi-node runs of the `tiny` recipe, three nodes on one machine, as SkyPilot starts them:
the same `python -m runtime` on every node with SKYPILOT_NODE_RANK and SKYPILOT_NODE_IPS.

Two kinds of nodes:
- netns: each node a separate host with its own network namespace and address (10.200.0.x on a
  private bridge); a lost node has its cable pulled before its processes die, so nothing closes
  a connection and only the heartbeats' silence tells. Needs root; skipped (with the reason)
  where namespaces cannot be made.
- loopback: each node its own loopback address (127.0.0.x) on a free port; a lost node's
  processes are killed, which closes its connections. Runs everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from netns import Fabric, unavailable
from runtime_helpers import (
    ROOT,
    finish,
    free_port,
    leftover_processes,
    tiny_run_dir,
    wait_for_line,
)

from runtime.control.metrics import read_metrics

pytestmark = pytest.mark.slow
LOOPBACK = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


class Nodes:
    """Three nodes, each started as its own `python -m runtime` process."""

    def __init__(self, ips: list[str], port: int | None, fabric: Fabric | None = None) -> None:
        self.ips, self.port, self.fabric = ips, port, fabric
        self.procs: list[subprocess.Popen] = []

    def env(self, rank: int) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.update(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="\n".join(self.ips) + "\n")
        if self.port is not None:
            env["FORGESKY_WORKER_PORT"] = str(self.port)
        return env

    def start(self, rank: int, args: list[str], log: Path | None) -> subprocess.Popen:
        """Node `rank`: the controller's output piped (rank 0), a worker's into `log`."""
        argv = [sys.executable, "-m", "runtime", *args]
        out = subprocess.PIPE if log is None else log.open("w")
        options = {"cwd": ROOT, "env": self.env(rank), "stdout": out, "stderr": subprocess.STDOUT}
        if self.fabric is not None:
            proc = self.fabric.run(rank, argv, text=True, **options)
        else:
            proc = subprocess.Popen(argv, start_new_session=True, text=True, **options)
        self.procs.append(proc)
        return proc

    def start_all(self, args: list[str], logs: Path) -> list[subprocess.Popen]:
        logs.mkdir(parents=True, exist_ok=True)
        workers = [self.start(rank, args, logs / f"node{rank}.log") for rank in (1, 2)]
        return [self.start(0, args, None), *workers]

    def lose(self, rank: int, proc: subprocess.Popen) -> None:
        """Node `rank` dies with everything on it."""
        if self.fabric is not None:
            self.fabric.cut(rank)
        else:
            for pid in _session(proc.pid):
                _kill(pid)
        proc.wait(10)  # no zombie left behind

    def busy(self, rank: int, proc: subprocess.Popen) -> int:
        """How many processes run on node `rank` (its worker and the procs it serves)."""
        if self.fabric is not None:
            return len(self.fabric.pids(rank))
        return len(leftover_processes(proc.pid))

    def leftovers(self) -> list[str]:
        left = [p for proc in self.procs for p in leftover_processes(proc.pid)]
        if self.fabric is not None:
            left += [f"pid {pid}" for n in range(3) for pid in self.fabric.pids(n)]
        return left

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _kill(proc.pid)
            if proc.stdout is not None:
                proc.stdout.close()


def _session(sid: int) -> list[int]:
    ps = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True)
    rows = [tuple(map(int, line.split())) for line in ps.stdout.splitlines()]
    return [pid for pid, session in rows if session == sid]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=["netns", "loopback"])
def nodes(request) -> Iterator[Nodes]:
    if request.param == "loopback":
        made = Nodes(LOOPBACK, free_port(*LOOPBACK))
        try:
            yield made
        finally:
            made.stop()
        return
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here ({reason}); the loopback run covers")
    with Fabric(3) as fabric:
        made = Nodes(fabric.ips, None, fabric)  # the default port, 26600
        try:
            yield made
        finally:
            made.stop()


def wait_for_file_line(path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"no {needle!r} in {path} within {timeout} s"
        time.sleep(0.2)


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"node process {proc.pid} did not exit within {timeout} s") from None


def test_losing_a_node_stops_the_run_and_the_rerun_resumes(nodes: Nodes, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = [
        "--recipe",
        "tiny",
        "--steps",
        "6",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run_dir),
    ]
    controller, node1, node2 = nodes.start_all(args, tmp_path / "first")
    seen = "".join(wait_for_line(controller, "services ready", timeout=600))
    assert "tiny on CPU, 3 nodes" in seen
    assert "2 worker node(s) attached" in seen
    # The generator runs on node 1 and the reference on node 2, each in a proc of its worker.
    assert nodes.busy(1, node1) >= 2 and nodes.busy(2, node2) >= 2
    seen += "".join(wait_for_line(controller, "checkpoint step 2", timeout=600))

    lost_at = time.monotonic()
    nodes.lose(2, node2)
    code, out = finish(controller, timeout=120)
    stopped_in = time.monotonic() - lost_at
    out = seen + out
    assert code == 1, out
    assert stopped_in < 60, out
    why = "no heartbeat for 20 s" if nodes.fabric else "connection to its worker closed"
    assert f"forgesky: node 2 ({nodes.ips[2]}) lost: {why}" in out
    assert "Traceback" not in out and "SupervisionError" not in out
    assert wait_exit(node1, 30) == 1
    assert "the controller finished (exit code 1)" in (tmp_path / "first/node1.log").read_text()
    time.sleep(1.0)
    assert nodes.leftovers() == []
    committed = max(int(s) for s in re.findall(r"checkpoint step (\d+) ->", out))
    print(f"node 2 lost; run stopped in {stopped_in:.1f} s after step {committed} was committed")

    if nodes.fabric is not None:  # the node is back: a new machine with the old address
        subprocess.run(["ip", "-n", nodes.fabric.names[2], "link", "set", "eth0", "up"], check=True)
    controller, node1, node2 = nodes.start_all(args, tmp_path / "second")
    code, out = finish(controller, timeout=900)
    assert code == 0, out
    assert f"resumed from step {committed}" in out
    assert "finished at step 6" in out
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 7))
    assert wait_exit(node1, 60) == 0 and wait_exit(node2, 60) == 0
    time.sleep(1.0)
    assert nodes.leftovers() == []


@pytest.fixture
def loopback() -> Iterator[Nodes]:
    made = Nodes(LOOPBACK, free_port(*LOOPBACK))
    try:
        yield made
    finally:
        made.stop()


def test_a_node_that_never_joins_or_cannot_serve_is_named(loopback: Nodes, tmp_path: Path):
    args = ["--recipe", "tiny", "--run-dir", str(tmp_path / "run"), "--join-timeout"]
    node1 = loopback.start(1, [*args, "300"], tmp_path / "node1.log")
    wait_for_file_line(tmp_path / "node1.log", "serving on", timeout=300)
    controller = loopback.start(0, [*args, "10"], None)
    code, out = finish(controller, timeout=300)
    assert code == 1, out
    assert (
        "forgesky: node 2 (127.0.0.3) did not join within 10 s: no worker there reached the "
        f"controller at 127.0.0.1:{loopback.port} (is `python -m runtime` running there with "
        "SKYPILOT_NODE_RANK=2?)"
    ) in out
    assert "Traceback" not in out
    assert wait_exit(node1, 30) == 1
    assert "the controller finished (exit code 1)" in (tmp_path / "node1.log").read_text()

    alone = loopback.start(2, [*args, "3"], tmp_path / "node2.log")
    assert wait_exit(alone, 120) == 1
    assert (
        f"no controller answered at 127.0.0.1:{loopback.port} within 3 s"
        in (tmp_path / "node2.log").read_text()
    )

    with socket.create_server((LOOPBACK[1], loopback.port)):  # something else has the port
        taken = loopback.start(1, [*args, "3"], tmp_path / "taken.log")
        assert wait_exit(taken, 120) == 2
    text = (tmp_path / "taken.log").read_text()
    assert f"error: cannot serve on tcp://127.0.0.2:{loopback.port}: " in text
    assert "Address already in use" in text and "--worker-port" in text
    time.sleep(0.5)
    assert loopback.leftovers() == []


@pytest.mark.parametrize("failure", ["user error", "actor failure"])
def test_a_failed_run_ends_every_node_with_the_controllers_exit_code(
    loopback: Nodes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
):
    """SkyPilot marks a job by the exit codes of all its nodes: a worker of a run that failed
    must not exit 0. Both failures come after every node joined."""
    run_dir = tmp_path / "run"
    if failure == "user error":
        # A committed checkpoint whose trainer file never arrived: a resume refuses it (exit 2).
        step = run_dir / "checkpoints" / "step_000002"
        step.mkdir(parents=True)
        (step / "COMMITTED").write_text(json.dumps({"step": 2, "files": {"trainer.pt": 1000}}))
        recipe, expected = "tiny", 2
        says = "trainer.pt: checkpoint file is cut short or damaged (missing)"
    else:
        faulty = yaml.safe_load((ROOT / "recipes/catalog/tiny.yaml").read_text())
        faulty["name"] = "tiny-faulty"
        faulty["dataset"]["rewards"] = [{"name": "faulty_rewards:explode"}]
        (tmp_path / "faulty.yaml").write_text(yaml.safe_dump(faulty))
        monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))  # the reward procs import it
        recipe, expected = str(tmp_path / "faulty.yaml"), 1
        says = "reward actor failed: ZeroDivisionError: division by zero"
    procs = loopback.start_all(["--recipe", recipe, "--run-dir", str(run_dir)], tmp_path / "logs")
    code, out = finish(procs[0], timeout=600)
    assert code == expected, out
    assert "2 worker node(s) attached" in out and says in out
    assert "Traceback" not in out and "SupervisionError" not in out
    assert [wait_exit(p, 60) for p in procs[1:]] == [expected, expected]
    for rank in (1, 2):
        log = (tmp_path / f"logs/node{rank}.log").read_text()
        assert f"the controller finished (exit code {expected})" in log
    time.sleep(1.0)
    assert loopback.leftovers() == []


def test_a_finished_run_started_again_ends_every_node_at_once(loopback: Nodes, tmp_path: Path):
    """A managed job recovered after its end: node 0 finds the run at its last step, starts
    nothing, and tells the workers, which exit 0 rather than wait for it and fail."""
    (tmp_path / "run").mkdir()
    run_dir = tiny_run_dir(tmp_path / "run", steps=(7,))
    args = ["--recipe", "tiny", "--steps", "7", "--run-dir", str(run_dir)]
    procs = loopback.start_all(args, tmp_path / "logs")
    code, out = finish(procs[0], timeout=300)
    assert code == 0, out
    assert f"run dir {run_dir} is at step 7 of 7 already: nothing to train" in out, out
    assert "starting services" not in out and "worker node(s)" not in out
    assert [wait_exit(p, 60) for p in procs[1:]] == [0, 0]
    for rank in (1, 2):
        log = (tmp_path / f"logs/node{rank}.log").read_text()
        assert "the controller finished (exit code 0)" in log, log
    time.sleep(1.0)
    assert loopback.leftovers() == []


def test_sigterm_on_every_node_checkpoints_and_every_node_exits_0(loopback: Nodes, tmp_path: Path):
    """What a cancel or a preemption does: every node gets SIGTERM at once. The workers keep
    serving while the controller drains and checkpoints through their procs."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--steps", "50", "--run-dir", str(run_dir)]
    procs = loopback.start_all(args, tmp_path)
    wait_for_line(procs[0], "step 2/50", timeout=600)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    code, out = finish(procs[0], timeout=120)
    assert code == 0, out
    assert re.search(r"checkpoint step \d+ ->", out), out
    assert [wait_exit(p, 60) for p in procs[1:]] == [0, 0]
    assert "stop requested" in (tmp_path / "node1.log").read_text()
    time.sleep(1.0)
    assert loopback.leftovers() == []


def test_services_on_other_nodes_run_there_pinned_to_their_gpus(loopback: Nodes, tmp_path: Path):
    """What a GPU plan relies on: a proc spawned on node k runs in node k's worker, with the
    GPUs, threads and identity its placement gives it, and Monarch's settings of the run."""
    workers = [loopback.start(k, ["--recipe", "tiny"], tmp_path / f"node{k}.log") for k in (1, 2)]
    app = [sys.executable, str(ROOT / "tests" / "nodes_app.py")]
    controller = subprocess.Popen(
        app, cwd=ROOT, env=loopback.env(0), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    loopback.procs.append(controller)
    code, out = finish(controller, timeout=300)
    assert code == 0, out
    procs = json.loads(next(line for line in out.splitlines() if line.startswith("procs "))[6:])
    # Each proc inherited SKYPILOT_NODE_RANK from the worker that spawned it: node k's.
    assert [(p["node"], p["node_rank_env"], p["gpus"], p["rank"]) for p in procs] == [
        (0, "0", "0,1", "0"),
        (0, "0", "2", "1"),
        (1, "1", "0,1", "0"),
        (1, "1", "2", "1"),
        (2, "2", "0,1", "0"),
        (2, "2", "2", "1"),
    ]
    assert {(p["threads"], p["poll"]) for p in procs} == {("3", "1s")}
    assert [p["service"] for p in procs] == ["svc0", "svc0", "svc1", "svc1", "svc2", "svc2"]
    assert [wait_exit(worker, 60) for worker in workers] == [0, 0]
    time.sleep(0.5)
    assert loopback.leftovers() == []
