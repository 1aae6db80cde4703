"""runtime.procs.lifecycle end to end: tests/lifecycle_app.py runs as a real process with real Monarch
procs, and every way it can end (normal end, SIGTERM, SIGINT, double SIGINT, an endpoint raising,
a proc killed) must end it with the right exit code, one readable line, and nothing left behind.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from runtime_helpers import LIFECYCLE_NOISE, alive, assert_nothing_left

APP = Path(__file__).with_name("lifecycle_app.py")
# Bounds that catch a hang; they do not measure speed.
EXIT_BOUND_S = 30.0
START_BOUND_S = 60.0

pytestmark = pytest.mark.slow


class App:
    """tests/lifecycle_app.py as a child process whose output is read line by line."""

    def __init__(self, *args: str) -> None:
        self.run_id = f"test-{uuid.uuid4().hex[:10]}"
        # Imported, not run as __main__: its actor classes then travel to the procs by name
        # (cloudpickle >= 3.1.3 sends __main__'s code with its file name blanked out, and the
        # root-cause line names the file).
        path = os.pathsep.join(filter(None, [str(APP.parent), os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "FORGESKY_RUN_ID": self.run_id,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, lifecycle_app; sys.exit(lifecycle_app.main())",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.state: dict = {}
        self.socket_dirs: set[Path] = set()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str) -> str:
        deadline = time.monotonic() + START_BOUND_S
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                if prefix == "ready":
                    self.state = json.loads(line.split(" ", 1)[1])
                    self.socket_dirs = _socket_dirs(self.state["pids"])
                return line
        self.proc.kill()
        raise AssertionError(f"no line {prefix!r}; output:\n{self.output}")

    def signal(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def finish(self) -> tuple[int, float]:
        """Wait for the exit; returns (exit code, seconds since the call)."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {EXIT_BOUND_S} s:\n{self.output}") from None
        elapsed = time.monotonic() - start
        while (line := self._queue.get(timeout=5)) is not None:
            self.lines.append(line)
        return code, elapsed

    @property
    def output(self) -> str:
        return "".join(self.lines)


def assert_clean(app: App) -> None:
    """Nothing of the run survives it: no process, no shared memory, no noise in its output."""
    leftovers = [p for p in app.state.get("pids", []) if alive(p)]
    leftovers += _processes_of_run(app.run_id)
    assert not leftovers, f"processes left: {leftovers}"
    segments = list(Path("/dev/shm").glob(f"forgesky_{app.run_id}_*"))
    assert not segments, f"shared memory left: {segments}"
    assert app.socket_dirs or not app.state, "the procs' socket directory was not found"
    assert not [d for d in app.socket_dirs if d.exists()], "Monarch's socket directory left"
    assert_nothing_left(app.output, noise=LIFECYCLE_NOISE)


def _socket_dirs(pids: list[int]) -> set[Path]:
    """Where the procs' Monarch sockets live (a temporary directory per run)."""
    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="unix")
        except psutil.NoSuchProcess:  # a proc the test killed
            continue
        found |= {Path(c.laddr).parent for c in connections if str(c.laddr).startswith("/")}
    return found


def _processes_of_run(run_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FORGESKY_RUN_ID") == run_id and alive(proc.pid):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_normal_end_exits_zero_and_leaves_nothing():
    app = App("--steps", "5")
    app.wait_for("ready")
    code, _ = app.finish()
    assert code == 0, app.output
    assert "finished 5" in app.output
    assert_clean(app)


def test_a_slow_shutdown_says_what_took_the_time():
    """A run's end after its last line can take long (engines and procs stopping): past
    `slow_shutdown_s` one line on stderr names the slowest parts."""
    app = App("--steps", "2", "--slow-stop", "1.5", "--slow-shutdown-s", "1.0")
    app.wait_for("ready")
    code, _ = app.finish()
    assert code == 0, app.output
    line = next(x for x in app.lines if "shutdown took" in x)
    assert line.startswith("forgesky: shutdown took ") and "slow resource 1.5 s" in line, line
    assert_clean(app)
    quick = App("--steps", "2", "--slow-shutdown-s", "30")  # a bound no clean stop here nears
    quick.wait_for("ready")
    assert quick.finish()[0] == 0 and "shutdown took" not in quick.output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("point", ["started", "ready"], ids=["while-spawning", "while-working"])
def test_stop_signal_finishes_in_flight_work_and_exits_zero(sig, point):
    app = App("--steps", "100000", "--step-seconds", "0.2")
    app.wait_for(point)
    app.signal(sig)
    code, _ = app.finish()
    assert code == 0, app.output
    assert "forgesky: stopping: finishing in-flight work (Ctrl-C again to force)" in app.output
    assert "finished" in app.output
    assert_clean(app)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_during_start_up_abandons_it_at_once(sig):
    # The set-up under way takes a minute: the stop ends the run without waiting for it.
    app = App("--mode", "slow-start")
    app.wait_for("ready")
    sent = app.signal(sig)
    code, _ = app.finish()
    assert code == 0, app.output
    assert time.monotonic() - sent < 10, app.output
    assert "forgesky: stopping: start-up abandoned, nothing was trained" in app.output
    assert "finished" not in app.output and "shutdown took" not in app.output
    assert_clean(app)


def test_second_sigint_forces_exit_130_and_kills_children():
    # Steps of 20 s: the first Ctrl-C alone would wait for the step to finish.
    app = App("--steps", "100000", "--step-seconds", "20")
    app.wait_for("ready")
    app.signal(signal.SIGINT)
    app.wait_for("forgesky: stopping")
    app.signal(signal.SIGINT)
    code, _ = app.finish()
    assert code == 130, app.output
    assert "forgesky: forced exit" in app.output
    assert "finished" not in app.output
    assert_clean(app)


@pytest.mark.parametrize("mode", ["bad", "bad-raw"], ids=["through-call", "awaited-directly"])
def test_endpoint_exception_ends_run_with_one_root_cause_line(mode):
    app = App("--mode", mode, "--steps", "100000")
    app.wait_for("ready")
    code, _ = app.finish()
    assert code == 1, app.output
    line = APP.read_text().splitlines().index("        return x / 0") + 1
    reports = [line for line in app.lines if line.startswith("forgesky:")]
    assert reports == [
        "forgesky: reward actor failed: ZeroDivisionError: float division by zero "
        f"(in lifecycle_app.py:{line} score)\n"
    ], app.output
    assert_clean(app)


def test_a_call_failing_after_its_waiter_was_cancelled_prints_nothing():
    # (asyncio printed "Task exception was never retrieved" with the call's traceback as the
    # process ended: a trainer rank's collective failing after the run had failed on its peer)
    app = App("--mode", "abandoned", "--steps", "40")
    app.wait_for("ready")
    code, _ = app.finish()
    assert code == 0, app.output
    assert "finished 40" in app.output
    assert "never retrieved" not in app.output and "Traceback" not in app.output, app.output
    assert_clean(app)


@pytest.mark.parametrize("when", ["working", "spawning-actor"])
def test_killed_proc_ends_run_naming_its_service(when):
    if when == "working":
        app = App("--steps", "100000")
        app.wait_for("ready")
        os.kill(app.state["reward_pids"][0], signal.SIGKILL)
    else:
        # The app kills its reward proc itself, right before spawning an actor on it.
        app = App("--steps", "100000", "--mode", "kill-reward")
        app.wait_for("ready")
    code, _ = app.finish()
    assert code == 1, app.output
    reports = [line for line in app.lines if line.startswith("forgesky:")]
    assert reports == ["forgesky: reward actor failed: process killed by SIGKILL (proc 0/1)\n"]
    assert_clean(app)


def test_two_runs_at_once_do_not_clash():
    apps = [App("--steps", "10"), App("--steps", "10")]
    for app in apps:
        app.wait_for("ready")
    assert apps[0].state["shm"] != apps[1].state["shm"]
    for app in apps:
        code, _ = app.finish()
        assert code == 0, app.output
        assert_clean(app)
