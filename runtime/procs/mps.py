"""NVIDIA MPS for the services that share a GPU (`layout.sharing: mps`).

Processes that share a GPU are time-sliced by the driver: their kernels do not run side by
side, which is why such services take turns by default (runtime/control/turns.py). Under the
Multi-Process Service the kernels of several processes can share the GPU's SMs. A run with
`layout.sharing: mps` starts a control daemon of its own on the controller's node (where the
plan puts every shared GPU), with its pipe and log folders in a fresh temporary folder, before
any service proc starts; the procs of the services that share a GPU get that folder in their
environment (`CUDA_MPS_PIPE_DIRECTORY`), so they, and only they, become MPS clients. At
shutdown, after the procs, the daemon is told to quit; the run waits for its process to end
(the daemon writes its pid to `nvidia-cuda-mps-control.pid` in the pipe folder and removes that
file as it exits; its control socket stays behind, so the socket says nothing), then removes the
folder. A controller killed with SIGKILL leaves its daemon running, and the daemon's server
holds a context on the GPUs: the next run on that node (a resume, say) stops it before it looks
at the GPUs (`reap_left_daemons`: the folder names the controller that started it, by pid and
start time, and that process is gone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import UserError

CONTROL = "nvidia-cuda-mps-control"
# Where the daemon keeps its pid, in its pipe folder, while it runs.
PID_FILE = "nvidia-cuda-mps-control.pid"
# What makes a CUDA process a client of a given daemon: the folder of its pipes.
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
# A client's share of the GPU's SMs (%), read by CUDA as the proc starts (layout.mps_sm_percent).
SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# The folders of the daemons runs start, in the temporary folder; each names its controller.
PREFIX = "forgesky-mps-"
OWNER_FILE = "controller"
# How long the daemon may take to start, and to quit with its server after the last client.
START_TIMEOUT_S = 30.0
QUIT_TIMEOUT_S = 30.0


def client_sm_percent() -> int | None:
    """This proc's share of its GPU's SMs as an MPS client; None where it has no limit."""
    value = os.environ.get(SM_PERCENT_ENV)
    return int(value) if value else None


def uses_mps(plan: Any) -> bool:
    """Whether a run of `plan` starts an MPS daemon: layout.sharing mps where services share
    a GPU."""
    from recipes.placements import shared_services

    return plan.sharing == "mps" and bool(shared_services(plan.placements))


def control_binary() -> str:
    """The control program's path; a UserError where this node has none."""
    found = shutil.which(CONTROL)
    if found is None:
        raise UserError(
            f"layout.sharing mps: {CONTROL} is not on this node's PATH (it comes with NVIDIA's "
            "driver utilities); install them, or set layout.sharing=turns"
        )
    return found


@dataclass
class MpsDaemon:
    """A control daemon this run started: its folder, and the environment of its clients."""

    binary: str
    folder: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            PIPE_ENV: str(self.folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log"),
        }

    def _control(self, *args: str, stdin: str | None = None, timeout: float) -> str:
        done = subprocess.run(
            [self.binary, *args],
            input=stdin,
            # The daemon sees the GPUs this run was given (the controller's CUDA_VISIBLE_DEVICES)
            # in PCI bus order, as nvidia-smi and the plan number them; its clients see the
            # same GPUs renumbered from 0 (runtime.procs.mesh.proc_env).
            env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            what = " ".join(args) or "quit"
            raise RuntimeError(
                f"{CONTROL} ({what}) exited {done.returncode}" + (f": {said[-1]}" if said else "")
            )
        return done.stdout

    def pid(self) -> int | None:
        """The daemon's pid while its pid file is there and names a live process."""
        try:
            pid = int((self.folder / "pipe" / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        stat = _stat(pid)
        # an exited daemon nobody has reaped yet (state Z) is not running
        return None if stat is None or stat[0] == "Z" else pid

    def stop(self) -> None:
        """Tell the daemon to quit (its server goes once its clients have), wait for its
        process to end, then remove the folder. Safe to call twice. A daemon still running
        after QUIT_TIMEOUT_S is an error that names its pid."""
        if not self.folder.exists():
            return
        try:
            self._control(stdin="quit\n", timeout=QUIT_TIMEOUT_S)
            deadline = time.monotonic() + QUIT_TIMEOUT_S
            while (pid := self.pid()) is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid is not None:
                raise RuntimeError(
                    f"the MPS control daemon (pid {pid}) is still running {QUIT_TIMEOUT_S:g} s "
                    f"after quit; `kill {pid}` ends it"
                )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command (state first); None where there is no
    such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), which tells it from a later process
    given the same pid; None where there is no such process."""
    stat = _stat(pid)
    return stat[19] if stat is not None and len(stat) > 19 else None


def reap_left_daemons() -> list[str]:
    """Stop the daemons earlier runs on this node started and left running (their controller
    killed); a line for each. Daemons of runs still going are left alone."""
    said = []
    binary = shutil.which(CONTROL)
    for folder in sorted(Path(tempfile.gettempdir()).glob(f"{PREFIX}*")):
        try:
            pid, started = (folder / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue  # not (yet) a run's folder
        if _started(int(pid)) == started:
            continue  # its run is still going
        daemon = MpsDaemon(binary or CONTROL, folder)
        left = daemon.pid()
        if left is not None and binary is not None:
            try:
                daemon.stop()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                said.append(f"an NVIDIA MPS daemon an earlier run left running did not stop: {e}")
                continue
            said.append(
                f"stopped an NVIDIA MPS daemon an earlier run left running (pid {left}, its "
                f"controller {pid} gone; {folder})"
            )
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return said


def start_daemon() -> MpsDaemon:
    """Start a control daemon in a folder of its own; its clients' environment is `.env`."""
    binary = control_binary()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    daemon = MpsDaemon(binary, folder)
    for sub in ("pipe", "log"):
        (folder / sub).mkdir()
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {_started(os.getpid())}\n")
    try:
        daemon._control("-d", timeout=START_TIMEOUT_S)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return daemon
