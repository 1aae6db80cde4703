"""What the benches' runs share: a run started in a session of its own (so that its stop reaches
every process it starts) still ends with the bench that started it.

A device call cut at its time limit kills the bench, not the run's session: without this the run
goes on, holding the GPUs, and the call after it finds them taken (its vLLM engine then sees no
room for a KV cache). Linux's parent-death signal gives the run a SIGTERM when the bench is gone,
which the runtime takes as a Ctrl-C: it stops and shuts its procs down.

`run_child` is how bench/gpu_tools.py and bench/gpu_sft.py start their runs: a SIGTERM to the
bench (its time limit) stops the run the same way, and the bench then summarizes the steps the
run recorded, so that a cut run still leaves its figures.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ends_with_parent(sig: int = signal.SIGTERM) -> None:
    """`preexec_fn` of a `subprocess.Popen`: the child gets `sig` when the process that started
    it ends (a no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def run_child(cmd: list[str], log: Path | None, cwd: Path, grace_s: float) -> int:
    """`cmd` in a session of its own (its output into `log`); its exit code. SIGTERM or SIGINT
    here (the call's time limit) stops the run as a user's Ctrl-C does (at its next trainer
    call, shutting its procs down) and returns its code once it has ended, for the bench to
    summarize what it recorded; past `grace_s` its whole session is killed."""
    out = log.open("w") if log else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                            start_new_session=True, preexec_fn=ends_with_parent)  # fmt: skip
    deadline: list[float] = []

    def stop(signum: int, _frame: Any) -> None:
        if not deadline:
            deadline.append(time.monotonic() + grace_s)
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if out:
            out.close()
