"""Monarch's failures as one readable line: which service, what went wrong, where.

An endpoint that raised (ActorError), an actor or proc that died (SupervisionError, a mesh
failure report) or any exception becomes `ActorFailure(service, cause)`, whose `str()` is the
line a run ends with: `reward actor failed: ZeroDivisionError: ... (in f.py:12 g)`.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sysconfig
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from monarch.actor import ActorError


class ActorFailure(Exception):
    """A service's actor or proc failed; `str()` is one line naming the service and root cause."""

    def __init__(self, service: str, cause: str, original: BaseException | None = None) -> None:
        super().__init__(f"{service} actor failed: {cause}")
        self.service = service
        self.cause = cause
        self.original = original


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_KILLED = re.compile(r"Killed\(sig=(\d+)\)")
_RANK = re.compile(r"\{'?\w+'?: (\d+/\d+)\}")
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")})
_CALL = re.compile(r"call (\w[\w-]*)\.\w+")
# The note a service of several procs adds to an exception it raises (`ranked`): which proc.
_RANK_NOTE = re.compile(r"^forgesky proc (\d+/\d+)$")
PROC = re.compile(r"\(proc (\d+)/(\d+)\)")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Every proc of a service starts knowing which it is and how many there are
# (runtime.procs.mesh.proc_env): an actor called through a slice of its mesh, as the trainer's
# ranks are one by one, sees only that slice in Monarch's own rank and size.
RANK_ENV = "FORGESKY_PROC_RANK"
PROCS_ENV = "FORGESKY_PROCS"


def ranked(endpoint: F) -> F:
    """For the endpoints of a service with several procs (under `@endpoint`): an exception
    raised on one of them carries which proc it was, and the run's failure line says so, with
    that proc's GPU (an out-of-memory error names the GPU as its process sees it: cuda:0)."""

    @functools.wraps(endpoint)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except Exception as e:
            size = int(os.environ.get(PROCS_ENV, "1"))
            if size > 1:
                e.add_note(f"forgesky proc {os.environ.get(RANK_ENV, '?')}/{size}")
            raise

    return call  # type: ignore[return-value]


def root_cause(error: BaseException | str) -> str:
    """One line for a failure: the exception, or how the proc died, and where.

    Accepts Monarch's ActorError (an endpoint raised), SupervisionError (an actor or proc
    died), a MeshFailure report, or any exception.
    """
    proc = None
    if isinstance(error, ActorError):
        exc = error.exception
        head = _exception_line(exc)
        text = error.exception_formatted
        proc = _noted_proc(exc)
    elif isinstance(error, str):
        text = error
        head = _last_line(text)
    elif type(error).__name__ == "SupervisionError":
        text = str(error)
        head = _last_line(text)
    else:
        return _exception_line(error)
    killed = _KILLED.search(head)
    if killed:
        rank = _RANK.search(text)
        where = f" (proc {rank.group(1)})" if rank else ""
        return f"process killed by {_signal_name(int(killed.group(1)))}{where}"
    line = _with_frame(head.removeprefix("actor explicitly aborted due to: "), text)
    return f"{line} (proc {proc})" if proc else line


def _noted_proc(exc: BaseException) -> str | None:
    """`R/N` of an exception a proc of several raised (`ranked`'s note)."""
    for note in getattr(exc, "__notes__", ()):
        found = _RANK_NOTE.match(str(note))
        if found:
            return found.group(1)
    return None


def _with_frame(head: str, text: str) -> str:
    frame = _user_frame(text)
    return f"{head} (in {frame})" if frame else head


def failure_of(error: BaseException, service: str | None = None) -> ActorFailure:
    """An ActorFailure for a Monarch error; without `service`, the actor named in the error."""
    if service is None:
        named = _CALL.search(str(error).splitlines()[0] if str(error) else "")
        service = named.group(1) if named else "unknown"
    return ActorFailure(service, root_cause(error), error)


# What a collective says when the process on its other end went away (gloo, NCCL, a push
# whose peer never came, a CUDA IPC handle whose owner is gone, the TCP store of a push whose
# sender died): a consequence, whose cause is that peer's own death.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"ncclRemoteError|NCCL communicator was aborted|collective operation timeout|"
    r"was not pushed within|pidfd_(?:getfd|open): No such process|"
    r"Connection was likely closed|Failed to recv, got 0 bytes",
    re.IGNORECASE,
)


def lost_a_peer(failure: ActorFailure) -> bool:
    """Whether `failure` is a collective that lost its peer: the peer's own failure (a proc
    killed, out of memory) is then the run's root cause if it is reported soon."""
    return bool(_PEER_LOST.search(failure.cause))


def is_monarch_error(error: BaseException) -> bool:
    """Whether `error` is how Monarch reports a failed call (ActorError, SupervisionError)."""
    return isinstance(error, ActorError) or type(error).__name__ == "SupervisionError"


def _exception_line(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown failure"


def _user_frame(text: str) -> str | None:
    # code compiled from a string (a dataclass's generated __init__) names no file to look at
    frames = [f for f in _FRAME.findall(text) if not f[0].startswith("<")]
    if not frames:
        return None
    own = [f for f in frames if not f[0].startswith(_LIBRARY_DIRS)]
    path, line, func = (own or frames)[-1]
    return f"{os.path.basename(path)}:{line} {func}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
