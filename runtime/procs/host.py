"""What a run leaves on its host, and how it is found and removed: Monarch's client (started
quietly, with our defaults), descendant processes and their socket directories, and shared
memory named after the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import psutil

RUN_ID_ENV = "FORGESKY_RUN_ID"
# Monarch polls proc state every 10 s by default: a killed proc would go unnoticed that long.
MONARCH_ENV_DEFAULTS = {"HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s"}
_MONARCH_BANNER = "Monarch internal logs are being written to"
_SHM_DIR = Path("/dev/shm")
_DEFAULT_RUN_ID = re.compile(r"(\d+)-[0-9a-f]{8}_")  # `<controller pid>-<random>`, as made below
_PR_SET_CHILD_SUBREAPER = 36

_monarch_started = False


STACKS_SIGNAL = signal.SIGUSR1
# The name of the thread that prints the stacks (in /proc/PID/task/*/comm, at most 15 bytes):
# how a process that answers STACKS_SIGNAL is told from one that it would end.
STACKS_THREAD = "forgesky-stacks"
_PR_SET_NAME = 15


def stacks_on_signal() -> bool:
    """`kill -USR1 PID` prints every thread's Python stack of this process to its stderr (the
    run's output), and the process goes on: what a run that seems stuck is doing.

    Call it first thing in the process's main thread, before any other thread starts. The signal
    is blocked here and so in every thread started later (they inherit the mask): it interrupts
    no system call and runs no handler. A thread of its own takes it (`sigwait`) and prints the
    stacks holding the GIL, so no frame changes while it reads them (faulthandler's handler
    reads them from signal context while other threads run, which can crash the process). A
    thread that keeps the GIL in native code delays the print until it lets go.

    Returns False, and changes nothing, where a thread that does not block the signal already
    runs (the signal could land there and end the process) or on a platform without it."""
    if not hasattr(signal, "pthread_sigmask") or not sys.platform.startswith("linux"):
        return False
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
    if not _blocked_in_every_thread(STACKS_SIGNAL):
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return False
    threading.Thread(target=_print_stacks_on_signal, name=STACKS_THREAD, daemon=True).start()
    return True


def _blocked_in_every_thread(sig: int) -> bool:
    for status in Path("/proc/self/task").glob("*/status"):
        with contextlib.suppress(OSError):  # a thread that has just ended
            blocked = next(
                ln.split()[1] for ln in status.read_text().splitlines() if ln.startswith("SigBlk")
            )
            if not int(blocked, 16) >> (sig - 1) & 1:
                return False
    return True


def _print_stacks_on_signal() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, STACKS_THREAD.encode(), 0, 0, 0)
    while True:
        signal.sigwait({STACKS_SIGNAL})
        with contextlib.suppress(Exception):  # a closed stderr: nothing to print to
            sys.stderr.write(format_stacks())
            sys.stderr.flush()


def format_stacks() -> str:
    """Every thread's Python stack in this process, most recent call last, the thread that
    prints them left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    frames = {k: v for k, v in sys._current_frames().items() if k != me}
    out = [f"stacks of pid {os.getpid()}, {len(frames)} Python threads:\n"]
    for ident, frame in frames.items():
        name = names.get(ident, "started outside Python")
        out.append(f"Thread {ident:#x} ({name}), most recent call last:\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


def become_subreaper() -> None:
    """Adopt the orphans of dead procs (their resource trackers, workers) instead of init, so
    `kill_descendants` still finds them (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def start_monarch() -> None:
    """Start Monarch's client in this process with our defaults, its banner kept off stderr.

    Idempotent; `ServiceMesh.spawn` calls it. Call it before anything else touches Monarch.
    """
    global _monarch_started
    if _monarch_started:
        return
    _monarch_started = True
    # Procs inherit the run id: it names the run's shared memory and marks its processes.
    os.environ.setdefault(RUN_ID_ENV, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    sweep_stale_shared_memory()
    for key, value in MONARCH_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import monarch.actor
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    reload_config_from_env()
    # The host agent prints where Monarch's own log file is, unconditionally, to fd 2; anything
    # else printed meanwhile is passed on.
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            monarch.actor.context()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(x for x in lines if not x.startswith(_MONARCH_BANNER)))


def proc_ended(pid: int) -> str | None:
    """How process `pid` ended, in the words of Monarch's reports (`killed by SIGKILL`,
    `exited with code 1`), or `ended` where it is not this process's child to ask; None while it
    runs. A child is asked without being reaped: whoever waits for it still can."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        try:
            running = psutil.Process(pid).status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            )
        except psutil.Error:
            running = False
        return None if running else "ended"
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"killed by {signal.Signals(info.si_status).name}"
    return f"exited with code {info.si_status}"


def kill_descendants(grace: float) -> int:
    """End every process below this one (SIGTERM, then SIGKILL after `grace` s) and reap them.

    Also removes the socket directories the killed procs served from: Monarch deletes them only
    when it shuts down itself. Returns how many processes would not die.
    """
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    socket_dirs = {d for child in children for d in _socket_dirs(child)}
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace > 0 else (signal.SIGKILL,):
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        _, children = psutil.wait_procs(children, timeout=grace or 1.0)
        if not children:
            break
    for directory in socket_dirs:
        shutil.rmtree(directory, ignore_errors=True)
    return len(children)


def _socket_dirs(proc: psutil.Process) -> set[str]:
    """Monarch's per-run socket directories (`/tmp/.tmpXXXXXX`) that `proc` listens in."""
    try:
        paths = [c.laddr for c in proc.net_connections(kind="unix")]
    except psutil.Error:
        return set()
    temp = Path(tempfile.gettempdir())
    return {
        os.path.dirname(p)
        for p in paths
        if isinstance(p, str)
        and Path(p).parent.parent == temp
        and Path(p).parent.name.startswith(".tmp")
    }


# --- shared memory ------------------------------------------------------------------------------
# Python 3.11 registers every SharedMemory a process creates *or attaches to* with that process's
# resource tracker, which unlinks whatever is still registered when the process exits. So a proc
# that only read a segment deletes it on exit, under its owner; the owner's unlink then fails with
# "No such file or directory", and the trackers warn about "leaked shared_memory objects".
# Segments made here are untracked, named after the run, and swept by the controller at shutdown.


def shm_prefix() -> str:
    """Name prefix of this run's shared-memory segments."""
    return f"forgesky_{os.environ.get(RUN_ID_ENV, os.getpid())}_"


def create_shared_memory(tag: str, size: int) -> shared_memory.SharedMemory:
    """A new segment named after the run, unknown to the resource tracker."""
    return _untracked(shared_memory.SharedMemory(shm_prefix() + tag, create=True, size=size))


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open a segment another proc created, without registering it for cleanup here."""
    return _untracked(shared_memory.SharedMemory(name))


def unlink_shared_memory(segment: shared_memory.SharedMemory) -> None:
    """Remove a segment made by these helpers (`segment.unlink()` would confuse the tracker)."""
    import _posixshmem  # the module SharedMemory.unlink calls, minus the tracker

    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]


def sweep_shared_memory(prefix: str | None = None) -> int:
    """Unlink every segment left by this run, and the CUDA driver's of ended processes; returns
    how many there were."""
    prefix = shm_prefix() if prefix is None else prefix
    removed = sweep_ended_segments()  # the run's procs have ended by now
    for path in _SHM_DIR.glob(prefix + "*") if _SHM_DIR.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


# Segments named after the process that made them and left behind when it is killed:
# - the CUDA driver's, one per process that uses CUDA IPC, /dev/shm/cuda.shm.<uid>.<pid in
#   hex>.<n>, left when a process ends without the driver's teardown (a proc stopped at
#   shutdown);
# - torch's reference counts of the CUDA tensors a process shares (a version published by CUDA
#   IPC), /dev/shm/torch_<pid>_<random>_<n>, unlinked by the last process to let go of the
#   tensor, so never when the sharing trainer is killed.
# On a node that runs many jobs they pile up in /dev/shm.
_CUDA_SEGMENT = re.compile(r"cuda\.shm\.(\d+)\.([0-9a-f]+)\.\d+")
_TORCH_SEGMENT = re.compile(r"torch_(\d+)_\d+_\d+")


def sweep_ended_segments() -> int:
    """Unlink the CUDA driver's and torch's segments of this user's processes that have
    ended."""
    removed = 0
    for path in _SHM_DIR.glob("*") if _SHM_DIR.is_dir() else ():
        cuda = _CUDA_SEGMENT.fullmatch(path.name)
        owner = _TORCH_SEGMENT.fullmatch(path.name)
        if cuda:
            if int(cuda.group(1)) != os.getuid():
                continue
            pid = int(cuda.group(2), 16)
        elif owner:
            pid = int(owner.group(1))
        else:
            continue
        with contextlib.suppress(OSError):
            if path.stat().st_uid != os.getuid() or psutil.pid_exists(pid):
                continue
            path.unlink()
            removed += 1
    return removed


def sweep_stale_shared_memory() -> int:
    """Unlink segments of earlier runs on this host whose controller is gone (say, SIGKILLed),
    and the CUDA driver's of ended processes."""
    removed = sweep_ended_segments()
    for path in _SHM_DIR.glob("forgesky_*") if _SHM_DIR.is_dir() else ():
        owner = _DEFAULT_RUN_ID.match(path.name.removeprefix("forgesky_"))
        if owner and not psutil.pid_exists(int(owner.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def _untracked(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def visible_gpus(visible: str | None = None) -> list[str]:
    """The host's GPU names (indices or UUIDs) in `visible` (default: this process's
    CUDA_VISIBLE_DEVICES); [] where it is unset or empty."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    return [v.strip() for v in (visible or "").split(",") if v.strip()]


def host_gpu_ids(gpus: tuple[int, ...], visible: str | None = None) -> list[str]:
    """The host's names for the plan's GPU indices.

    Plans number a node's GPUs 0..n-1. Where this process was started with
    `CUDA_VISIBLE_DEVICES` set (a shared host, two runs side by side), index i is the i-th GPU
    it lists, so a run given `CUDA_VISIBLE_DEVICES=2,3` uses GPUs 2 and 3, not 0 and 1.
    """
    names = visible_gpus(visible)
    if not names:
        return [str(g) for g in gpus]
    missing = [g for g in gpus if g >= len(names)]
    if missing:
        raise ValueError(
            f"the plan uses GPU {missing[0]} but CUDA_VISIBLE_DEVICES={','.join(names)} lists "
            f"{len(names)} GPU(s)"
        )
    return [names[g] for g in gpus]


def gpu_type(names: list[str] | None = None) -> str | None:
    """This host's GPU type as recipes name it (recipes/gpus.py), read from nvidia-smi without
    touching CUDA (the controller must not hold a context on a GPU a service uses); None when
    there is no GPU, no nvidia-smi, or a type no recipe names."""
    if names is None:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        names = [line.strip() for line in out.splitlines() if line.strip()]
    from recipes.gpus import GPUS

    for known, spec in GPUS.items():
        if names and all(spec.smi_name in name for name in names):
            return known
    return None
