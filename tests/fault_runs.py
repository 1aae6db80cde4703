"""Kill the real runtime at chosen points, restart it, and check what it resumes from.

Shared by tests/test_faults.py (a few points in `make test`) and bench/fault_sweep.py (the long
sweep). A kill here is what a preempted node does to a run: every process of the run's session
(the runtime and its Monarch procs, each of which leads its own process group, so `killpg` on the
runtime alone would miss them) is frozen with SIGSTOP and then killed with SIGKILL, so none of
them gets to react to another's death. Freezing first also lets a point check what is on disk at
the instant of the kill, e.g. that a `step_*.partial` checkpoint directory really was there.

No hooks in the runtime: points are found from its output (`step N/M` lines, `services ready`)
and from the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from runtime_helpers import ROOT

from runtime.backends import trainer_state
from runtime.control import checkpoint
from runtime.control.metrics import read_metrics
from runtime.procs.host import STACKS_SIGNAL, STACKS_THREAD

STARTUP_TIMEOUT_S = 600.0
# The runs tests/test_faults.py interrupts and compares: this many steps, a checkpoint every
# EVERY, in lock-step (`grpo.max_policy_age=0`: deterministic, see test_faults.py).
STEPS, EVERY = 8, 2
KINDS = ("checkpoint_write", "weight_sync", "step", "startup", "restore")
_STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")
_RESUMED = re.compile(r"^resumed from step (\d+)")


def lock_step_args(run_dir: Path, *extra: str, recipe: str = "tiny") -> list[str]:
    """`python -m runtime` arguments of a lock-step run of `recipe` (STEPS, EVERY) in `run_dir`."""
    return [
        "--recipe", recipe, "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
        "--set", "grpo.max_policy_age=0", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


class RunEnded(AssertionError):
    """The runtime exited before the line (or the kill point) came."""


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies excluded: they hold nothing)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command name: state ppid pgrp session ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def answers_stacks_signal(pid: int) -> bool:
    """Whether process `pid` runs the thread that prints its stacks on STACKS_SIGNAL."""
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == STACKS_THREAD:
                return True
    return False


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class RuntimeRun:
    """`python -m runtime ARGS` in its own session, its output read line by line by a thread."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        source: Path = ROOT,
        log: Path | None = None,
    ) -> None:
        """`source`: the tree whose runtime and recipes run (a snapshot keeps a long sweep on
        one version of them while the repository changes). `log`: a file that gets each line
        as it comes, after the seconds since the start (what a run killed from outside leaves)."""
        self.started = time.monotonic()
        self._log = log.open("w", buffering=1) if log is not None else None
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(source), str(source / "tests"), full_env.get("PYTHONPATH", "")) if p
        )
        self.proc: subprocess.Popen = subprocess.Popen(
            [sys.executable, "-m", "runtime", *args],
            cwd=source,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.last_line_at = self.started
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self._log is not None:
                self._log.write(f"[{time.monotonic() - self.started:7.1f}] {line}")
            with self._cond:
                self.lines.append(line)
                self.last_line_at = time.monotonic()
                self._cond.notify_all()
        if self._log is not None:
            self._log.close()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def wait_line(self, pattern: str | re.Pattern[str], timeout: float, since: int = 0) -> str:
        """The first line from index `since` on that matches; RunEnded if the run ends first,
        AssertionError if the time runs out."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        i = since
        with self._cond:
            while True:
                while i < len(self.lines):
                    if regex.search(self.lines[i]):
                        return self.lines[i]
                    i += 1
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    error = RunEnded if self._eof else AssertionError
                    why = "the run ended" if self._eof else f"{timeout:g} s passed"
                    raise error(
                        f"no line matching {regex.pattern!r} ({why}); output:\n{''.join(self.lines)}"
                    )
                self._cond.wait(min(left, 1.0))

    def freeze(self) -> list[int]:
        """SIGSTOP every process of the run; returns them."""
        sid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGSTOP)  # the controller first: it spawns the others
        frozen: set[int] = set()
        while True:  # a proc being spawned shows up on a second look
            new = [p for p in session_pids(sid) if p not in frozen]
            if not new:
                return sorted(frozen)
            _signal_all(new, signal.SIGSTOP)
            frozen.update(new)

    def dump_stacks(self, settle_s: float = 0.3) -> list[int]:
        """Every process of the run that answers SIGUSR1 (the runtime's own, with a thread
        named runtime.procs.host.STACKS_THREAD) prints its threads' stacks into the run's
        output, one process at a time (each under a line naming it, `settle_s` apart, so their
        stacks do not interleave); the others are left alone (SIGUSR1 could end them).
        Returns the pids signalled."""
        caught: list[tuple[int, str]] = []
        for pid in session_pids(self.proc.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if answers_stacks_signal(pid):
                caught.append((pid, command.decode(errors="replace")[:160]))
        for pid, command in caught:
            self.note(f"--- stacks of pid {pid}: {command}")
            _signal_all([pid], STACKS_SIGNAL)
            time.sleep(settle_s)
        time.sleep(settle_s)
        return [pid for pid, _ in caught]

    def note(self, text: str) -> None:
        """A line of the bench's own in the run's log (not in `lines`: no pattern sees it)."""
        if self._log is not None and not self._log.closed:
            self._log.write(f"[{time.monotonic() - self.started:7.1f}] {text}\n")

    def thaw(self, pids: list[int]) -> None:
        _signal_all(pids, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every process of the run at once (frozen first) and reap the runtime."""
        pids = self.freeze()
        _signal_all(pids, signal.SIGKILL)
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while session_pids(self.proc.pid) and time.monotonic() < deadline:
            _signal_all(session_pids(self.proc.pid), signal.SIGKILL)
            time.sleep(0.05)
        with self._cond:
            self._cond.wait_for(lambda: self._eof, timeout=10)

    def finish(self, timeout: float) -> int:
        """Wait for the runtime to exit by itself; its exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the runtime did not exit within {timeout:g} s") from None
        with self._cond:
            self._cond.wait_for(lambda: self._eof, timeout=30)
        return code

    def resumed_from(self) -> int | None:
        for line in self.lines:
            if m := _RESUMED.match(line):
                return int(m.group(1))
        return None


@dataclass
class Point:
    """Where to kill: `kind` (one of KINDS), `delay_s` after its moment. For "weight_sync" and
    "step", `step` counts steps after the one the run resumed from (0 on a fresh run), and
    `after_commit` moves the moment to when the run dir holds a committed checkpoint, if later
    (a background write commits at a step boundary after it ends: on a loaded machine, not
    always by the next step's line)."""

    kind: str
    step: int | None = None
    delay_s: float = 0.0
    after_commit: bool = False


@dataclass
class PointResult:
    kind: str
    step: int | None
    delay_s: float
    expected_resume: int | None  # newest committed checkpoint before this start
    resumed_from: int | None  # what the run said it resumed from
    killed: bool  # False: the run ended by itself before the point came
    exit_code: int | None  # when it ended by itself
    partial_at_kill: list[str] = field(default_factory=list)  # .partial dirs when frozen
    committed_at_kill: list[int] = field(default_factory=list)
    last_step_logged: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def committed_steps(run_dir: Path) -> list[int]:
    return [c.step for c in checkpoint.committed(run_dir / "checkpoints")]


def partial_dirs(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    try:
        return sorted(e.name for e in os.scandir(root) if e.name.endswith(".partial"))
    except FileNotFoundError:
        return []


def random_points(rng: random.Random, n: int, kinds: tuple[str, ...] = KINDS) -> list[Point]:
    """`n` points cycling through `kinds` in a shuffled order, steps and delays from `rng`."""
    order = list(kinds)
    rng.shuffle(order)
    points = []
    for i in range(n):
        kind = order[i % len(order)]
        if kind == "weight_sync":
            # an odd number of steps after a resume: no checkpoint write right after that step
            # (with --checkpoint-every 2) comes before the weight sync
            points.append(Point(kind, rng.choice((1, 3))))
        elif kind == "step":
            # a step's whole cycle (train, publish, load, generate, score) is ~0.2 s on 2 cores
            points.append(Point(kind, rng.randint(1, 3), round(rng.uniform(0.0, 0.25), 3)))
        elif kind == "startup":
            points.append(Point(kind, None, round(rng.uniform(0.0, 6.0), 3)))
        elif kind == "restore":
            points.append(Point(kind, None, round(rng.uniform(0.0, 0.2), 3)))
        else:
            points.append(Point(kind))
    return points


def run_to_point(args: list[str], run_dir: Path, point: Point, source: Path = ROOT):
    """Start the runtime, kill it at `point` (unless it ends first); the result and the run."""
    expected = (committed_steps(run_dir) or [None])[-1]
    run = RuntimeRun(args, source=source)
    result = PointResult(point.kind, point.step, point.delay_s, expected, None, False, None)
    try:
        total = int(args[args.index("--steps") + 1])
        result.step = _reach(run, run_dir, point, expected, total)
    except RunEnded:
        result.exit_code = run.finish(timeout=120)
    else:
        result.killed = True
        pids = run.freeze()
        result.partial_at_kill = partial_dirs(run_dir)
        result.committed_at_kill = committed_steps(run_dir)
        _signal_all(pids, signal.SIGKILL)
        run.kill()
    result.resumed_from = run.resumed_from()
    result.last_step_logged = max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")),
                                  default=None)  # fmt: skip
    result.seconds = round(time.monotonic() - run.started, 1)
    return result, run


def _wait(run: RuntimeRun, pattern: str) -> None:
    run.wait_line(pattern, STARTUP_TIMEOUT_S)


def _reach(
    run: RuntimeRun, run_dir: Path, point: Point, resume: int | None, total: int
) -> int | None:
    """Return at the instant `point` is reached (with the step line used, if any); RunEnded if
    the run ends before."""
    step = None
    if point.kind == "startup":
        _wait(run, r"^starting services")
        time.sleep(point.delay_s)
    elif point.kind == "restore":
        # while the restored version is published and loaded (services are up by then)
        _wait(run, r"^resumed from step" if resume is not None else r"^services ready")
        time.sleep(point.delay_s)
    elif point.kind in ("weight_sync", "step"):
        # A `step N/M` line is printed right after version N is published, as the generators
        # start loading it: a kill at once lands in that load (the weight sync). Not the last
        # step: the run may end before a kill after it.
        step = min((resume or 0) + (point.step or 1), total - 1)
        _wait(run, rf"^step {step}/")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while point.after_commit and not committed_steps(run_dir) and run.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no committed checkpoint by step {step} and after")
            time.sleep(0.05)
        time.sleep(point.delay_s)
    elif point.kind == "checkpoint_write":
        _wait(run, r"^services ready")
        _catch_partial(run, run_dir)
    else:
        raise ValueError(f"unknown kill point kind {point.kind!r}")
    if run.proc.poll() is not None:
        raise RunEnded(f"the run ended before the {point.kind} point")
    return step


def _partial_ids(run_dir: Path) -> set[tuple[str, int, int]]:
    """(name, inode, change time) of each `.partial` directory: a directory of the same name
    made again (a step written anew after a resume) counts as another."""
    root = run_dir / "checkpoints"
    out = set()
    for name in partial_dirs(run_dir):
        try:
            st = os.stat(root / name)
        except FileNotFoundError:
            continue
        out.add((name, st.st_ino, st.st_ctime_ns))
    return out


def _catch_partial(run: RuntimeRun, run_dir: Path) -> None:
    """Return with the run frozen while a checkpoint of this start is being written.

    Polls the checkpoint directory; on seeing a `.partial` directory this start made (one left
    by an earlier kill does not count: checkpoints are written in the background, so a kill
    elsewhere often leaves one), freezes the run and looks again (the write may have been
    committed in between): still there, the point is reached; gone, the run goes on and the
    next checkpoint gets its chance.
    """
    stale = _partial_ids(run_dir)
    while run.proc.poll() is None:
        if _partial_ids(run_dir) - stale:
            pids = run.freeze()
            if _partial_ids(run_dir) - stale:
                return
            run.thaw(pids)
        time.sleep(0.0005)
    raise RunEnded("the run ended before a checkpoint write could be caught")


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The trainer state (model, optimizer, scheduler, step) in the newest checkpoint."""
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    assert ckpt is not None, f"no committed checkpoint in {run_dir}"
    return trainer_state.read_all(ckpt.path)


def tensors_differ(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths at which two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in tensors_differ(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in tensors_differ(x, y, f"{path}[{i}]")]  # fmt: skip
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def raw_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every parseable line of metrics.jsonl, duplicates included, in file order."""
    import json

    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
