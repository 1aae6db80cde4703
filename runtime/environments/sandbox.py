"""Running model-written Python under limits: CPU seconds, memory, no network, writes only to a
temporary folder, killed when it runs past its wall time.

The isolation is Linux's own: `unshare` (util-linux) puts the child in new user, network, mount
and PID namespaces (no network device but loopback; every mount remounted read-only, a size-capped
tmpfs as the only writable folder), and `resource` rlimits cap CPU seconds, address space, file
size and core dumps. Where user namespaces are not permitted (some containers), `isolation:
rlimits` in the recipe runs with the rlimits alone and says so; the default refuses to start.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ISOLATIONS = ("namespaces", "rlimits")
# What the child runs before the model's code (python -c JAIL code_file tmp tmpfs_mb): inside the
# new namespaces it remounts every mount read-only, then mounts a size-capped tmpfs on the
# temporary folder, the one place it may write, and runs the code there.
_JAIL = r"""
import ctypes, os, runpy, sys
code, tmp, size_mb = sys.argv[1], sys.argv[2], sys.argv[3]
if size_mb != "-":
    libc = ctypes.CDLL(None, use_errno=True)
    FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
             "relatime": 1 << 21, "strictatime": 1 << 24}
    MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")
        keep = sum(FLAGS.get(o, 0) for o in fields[5].split(","))
        # a mount that cannot be remounted (covered by another) is left as it is; the caller's
        # folder is checked below
        libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)
    opts = f"size={size_mb}m,mode=0700".encode()
    if libc.mount(b"tmpfs", tmp.encode(), b"tmpfs", 2 | 4, opts) != 0:
        raise SystemExit(f"sandbox: cannot mount a tmpfs on {tmp}: {os.strerror(ctypes.get_errno())}")
    if os.access(os.path.dirname(tmp), os.W_OK):
        raise SystemExit("sandbox: the filesystem is still writable outside the tmpfs")
os.chdir(tmp)
os.environ["HOME"] = os.environ["TMPDIR"] = tmp
if os.getpid() == 1:
    # the first process of a PID namespace ignores signals it has no handler for (SIGXCPU at
    # the CPU limit): the code runs in a child, this one waits and exits as it did
    pid = os.fork()
    if pid:
        status = os.waitpid(pid, 0)[1]
        os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
sys.argv = ["-"]
sys.path.insert(0, tmp)
try:
    runpy.run_path(code, run_name="__main__")
except (SystemExit, KeyboardInterrupt):
    raise
except BaseException as e:
    import traceback
    # the model's own frames only, its file called code.py
    tb = traceback.TracebackException.from_exception(e)
    tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename == code])
    sys.stderr.write("".join(tb.format()).replace(code, "code.py"))
    sys.exit(1)
"""


@dataclass(frozen=True)
class Limits:
    """What one run of code may use (the recipe's env.sandbox)."""

    cpu_seconds: float = 5.0
    memory_mb: int = 512
    wall_seconds: float = 10.0
    disk_mb: int = 16
    output_chars: int = 4000
    isolation: str = "namespaces"


@dataclass(frozen=True)
class Outcome:
    """One run: its output (stdout then stderr, cut to the limit), exit code (negative: the
    signal that ended it) and why it was stopped, if it was ("cpu", "memory", "wall")."""

    output: str
    returncode: int
    stopped: str | None = None
    seconds: float = 0.0


class SandboxUnavailable(RuntimeError):
    """The isolation the recipe asks for cannot be had on this machine; one line."""


@cache
def namespaces_error() -> str | None:
    """Why the sandbox's namespaces cannot be made here (or made but not used: some kernels let
    an unprivileged user make a user namespace but not mount in it), or None when they can."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare command (util-linux) on this machine"
    try:
        out = subprocess.run(
            [unshare, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "true"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return f"unshare --user failed: {lines[-1] if lines else f'exit code {out.returncode}'}"
    probe = _execute("print('ok')", Limits(wall_seconds=30), jailed=True)
    if probe.output != "ok\n":
        lines = probe.output.strip().splitlines()
        return f"the namespaces cannot be set up: {lines[-1] if lines else probe.returncode}"
    return None


def check(limits: Limits) -> str:
    """The isolation `limits` get here, as one line; SandboxUnavailable where the recipe asks
    for namespaces and they cannot be made."""
    if limits.isolation not in ISOLATIONS:
        raise SandboxUnavailable(f"sandbox isolation {limits.isolation!r}: one of {ISOLATIONS}")
    if limits.isolation == "rlimits":
        return (
            "sandbox: rlimits only (env.sandbox.isolation=rlimits): CPU, memory and file size "
            "capped; the network and the filesystem are NOT isolated"
        )
    why = namespaces_error()
    if why is not None:
        raise SandboxUnavailable(
            f"sandbox: user namespaces are not permitted here ({why}); set "
            "env.sandbox.isolation=rlimits to run the Python tool with CPU, memory and file-size "
            "limits only, without cutting the network or the filesystem"
        )
    return "sandbox: user, network and mount namespaces, read-only filesystem, tmpfs, rlimits"


def _rlimits(limits: Limits) -> None:
    """In the child before exec: its CPU seconds, address space, file size, no core files."""
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    # SIGXCPU at the soft limit, SIGKILL one second later if it is caught
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    disk = limits.disk_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (disk, disk))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def run_python(code: str, limits: Limits) -> Outcome:
    """Run `code` with the Python running this, under `limits`; never raises for what the code
    does (SandboxUnavailable where the isolation cannot be had, see check())."""
    check(limits)
    return _execute(code, limits, jailed=limits.isolation == "namespaces")


def _execute(code: str, limits: Limits, *, jailed: bool) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="forgesky-sandbox-") as folder:
        home = Path(folder)
        source = home / "code.py"
        source.write_text(code)
        work = home / "work"
        work.mkdir()
        argv = [
            sys.executable, "-I", "-u", "-c", _JAIL, str(source), str(work),
            str(limits.disk_mb) if jailed else "-",
        ]  # fmt: skip
        if jailed:
            # --pid: the code is the first process of its own PID namespace, so every process
            # it starts dies with it; --kill-child: it dies with unshare, which the wall time kills
            argv = [
                "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
                "--kill-child", *argv,
            ]  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=work, env=env, preexec_fn=lambda: _rlimits(limits),
        )  # fmt: skip
        stopped = None
        try:
            out, _ = proc.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            stopped = "wall"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it left running in its process group
        seconds = time.monotonic() - start
    text = out.decode("utf-8", errors="replace")
    code_ = proc.returncode
    # killed by SIGXCPU at the soft CPU limit, SIGKILL at the hard one: as a signal (rlimits) or
    # as 128 + the signal (namespaces: the code's parent in its PID namespace exits so)
    if stopped is None and code_ in (
        -signal.SIGXCPU,
        -signal.SIGKILL,
        128 + signal.SIGXCPU,
        128 + signal.SIGKILL,
    ):
        stopped = "cpu"
    elif stopped is None and "MemoryError" in text:
        stopped = "memory"
    if len(text) > limits.output_chars:
        text = (
            text[: limits.output_chars]
            + f"\n... ({len(text) - limits.output_chars} more characters)"
        )
    return Outcome(text, code_, stopped, seconds)
