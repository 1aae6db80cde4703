"""runtime.procs.host: shared memory between processes without resource-tracker trouble, and the
segments of runs whose controller died."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from runtime.procs.host import (
    create_shared_memory,
    sweep_ended_segments,
    sweep_stale_shared_memory,
    unlink_shared_memory,
)

_TEXT = {"capture_output": True, "text": True}


_OWNER = """
import sys
from multiprocessing import shared_memory
from runtime.procs.host import create_shared_memory, unlink_shared_memory
if sys.argv[1] == "raw":
    segment = shared_memory.SharedMemory(sys.argv[2], create=True, size=64)
else:
    segment = create_shared_memory(sys.argv[2], 64)
print(segment.name, flush=True)
sys.stdin.readline()  # the reader has attached and closed
segment.close()
segment.unlink() if sys.argv[1] == "raw" else unlink_shared_memory(segment)
"""

_READER = """
import sys
from multiprocessing import shared_memory
from runtime.procs.host import attach_shared_memory
attach = shared_memory.SharedMemory if sys.argv[1] == "raw" else attach_shared_memory
segment = attach(sys.argv[2])
segment.close()
"""


@pytest.mark.parametrize("how", ["raw", "helpers"])
def test_shared_memory_between_processes_is_freed_once_and_quietly(how):
    tag = f"t{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "FORGESKY_RUN_ID": "test"}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, how, tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    name = owner.stdout.readline().strip()
    reader = subprocess.run([sys.executable, "-c", _READER, how, name], **_TEXT, env=env)
    _, owner_err = owner.communicate("done\n", timeout=60)
    noise = owner_err + reader.stderr
    assert not Path("/dev/shm", name).exists()
    if how == "raw":
        # Python 3.11's own behaviour, which the helpers exist to avoid: the reader's resource
        # tracker unlinks the owner's segment when the reader exits, and both sides complain.
        assert "leaked shared_memory" in noise and "No such file or directory" in noise
    else:
        assert owner.returncode == 0 and reader.returncode == 0 and noise == "", noise


def test_segments_of_runs_whose_controller_died_are_swept(monkeypatch):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_TEXT)
    monkeypatch.setenv("FORGESKY_RUN_ID", f"{int(finished.stdout)}-0badc0de")
    stale = create_shared_memory("weights", 64)
    monkeypatch.setenv("FORGESKY_RUN_ID", f"{os.getpid()}-0123abcd")
    live = create_shared_memory("weights", 64)
    try:
        assert sweep_stale_shared_memory() >= 1
        assert not Path("/dev/shm", stale.name).exists()
        assert Path("/dev/shm", live.name).exists()
    finally:
        stale.close()
        live.close()
        unlink_shared_memory(live)


def test_the_cuda_drivers_and_torchs_segments_of_ended_processes_are_swept():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_TEXT)
    uid = os.getuid()
    stale = Path("/dev/shm", f"cuda.shm.{uid}.{int(ended.stdout):x}.1")
    live = Path("/dev/shm", f"cuda.shm.{uid}.{os.getpid():x}.1")
    other_user = Path("/dev/shm", f"cuda.shm.{uid + 1}.{int(ended.stdout):x}.1")
    # torch's reference counts of a killed process's CUDA IPC tensors (seen on an H100 after a
    # trainer publishing by CUDA IPC was killed), and a live process's
    torch_stale = Path("/dev/shm", f"torch_{int(ended.stdout)}_260704323_2")
    torch_live = Path("/dev/shm", f"torch_{os.getpid()}_837032542_1")
    made = (stale, live, other_user, torch_stale, torch_live)
    for path in made:
        path.write_bytes(b"x")
    try:
        assert sweep_ended_segments() >= 2
        assert not stale.exists() and live.exists() and other_user.exists()
        assert not torch_stale.exists() and torch_live.exists()
    finally:
        for path in made:
            path.unlink(missing_ok=True)


_STACKS = """
import gc, os, sys, threading, time
from runtime.procs.host import stacks_on_signal
if sys.argv[1] == "late":  # a thread that does not block the signal already runs
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print(stacks_on_signal(), flush=True)
stop = threading.Event()

def churn(depth=0):
    if depth < 30:
        return churn(depth + 1)
    gc.collect(0)
    return [object() for _ in range(50)]

def busy():
    while not stop.is_set():
        churn()

threads = [threading.Thread(target=busy, name=f"busy{i}") for i in range(3)]
for t in threads:
    t.start()
sys.stdin.readline()  # the test has sent its signals
stop.set()
for t in threads:
    t.join()
print("done", flush=True)
"""


def test_sigusr1_prints_every_threads_stack_while_threads_run_and_the_process_goes_on():
    """kill -USR1 on a process whose threads keep pushing and popping frames (and collecting
    garbage) prints their stacks, every time, and the process carries on: the stacks are read
    by a thread of their own holding the GIL, not from a signal handler."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", _STACKS, "early"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "True"
    for _ in range(100):
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.005)
    time.sleep(0.5)
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0 and out.strip() == "done", err[-2000:]
    assert err.count(f"stacks of pid {proc.pid}") >= 1
    assert "(busy0), most recent call last" in err and "in churn" in err


def test_no_stacks_thread_where_a_thread_that_could_take_the_signal_already_runs():
    """stacks_on_signal after another thread has started changes nothing and says so: SIGUSR1
    could land in that thread and would end the process."""
    proc = subprocess.run(
        [sys.executable, "-c", _STACKS + "\nimport signal\nprint(signal.SIGUSR1 in "
         "signal.pthread_sigmask(signal.SIG_BLOCK, []))", "late"],
        input="\n", timeout=60, **_TEXT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "done", "False"]
