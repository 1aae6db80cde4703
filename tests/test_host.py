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
