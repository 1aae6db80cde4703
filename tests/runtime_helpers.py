"""Helpers for tests that run the real runtime in a subprocess (real Monarch procs, TorchStore)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "SupervisionError", "resource_tracker", "leaked shared_memory")


def shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m runtime ARGS` in its own session, output captured (merged)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tests"), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    """Read output until a line containing `needle`; returns the lines read so far."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no line with {needle!r} within {timeout} s; got:\n{''.join(lines)}")


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for the process; its exit code and the rest of its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"runtime did not exit within {timeout} s:\n{out}") from None
    return proc.returncode, out


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def leftover_processes(pgid: int) -> list[str]:
    """Processes still in the run's session (the runtime and everything it started)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.info["pid"]) == pgid:
                left.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return left


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_ranks(fn: Any, ranks: int, tmp_path: Path) -> Any:
    """Spawn `fn(rank, ranks, port, out)` on `ranks` procs meeting on a free loopback port;
    return what rank 0 saved to `out` with torch.save."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(fn, args=(ranks, port, out), nprocs=ranks, start_method="spawn")
    return torch.load(out, weights_only=False)
