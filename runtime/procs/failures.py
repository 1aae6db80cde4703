"""Monarch's failures as one readable line: which service, what went wrong, where.

An endpoint that raised (ActorError), an actor or proc that died (SupervisionError, a mesh
failure report) or any exception becomes `ActorFailure(service, cause)`, whose `str()` is the
line a run ends with: `reward actor failed: ZeroDivisionError: ... (in f.py:12 g)`.

A proc's own failure is the cause a run names, not what its peers then report: several procs of
one service failing close together are ranked (`first_cause`), and an NCCL error is named by
what NCCL itself said (its last error, where torch's text leaves it out) and the free memory of
the proc's GPU, so that NCCL running out of memory reads as out of memory.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import sys
import sysconfig
from collections.abc import Awaitable, Callable, Sequence
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
# The notes a proc adds to an exception it raises (`ranked`): which proc of several, and for an
# NCCL error what NCCL said last and the bytes free on the proc's GPU, "FREE of TOTAL".
_RANK_NOTE = re.compile(r"^forgesky proc (\d+/\d+)$")
_NCCL_NOTE = "forgesky nccl last error: "
_FREE_NOTE = "forgesky gpu free: "
_NCCL = re.compile(r"\bnccl", re.IGNORECASE)
# Where torch's text of an NCCL error carries NCCL's last error (DistBackendError), after its
# first line.
_LAST_ERROR = re.compile(r"Last error:\s*(\S[^\n]*)")
# Less free than this on the GPU of an NCCL call that failed in CUDA: NCCL's own buffers (a
# communicator's, a collective's first use of a channel) did not fit.
NCCL_ROOM_BYTES = 2**30
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
    that proc's GPU (an out-of-memory error names the GPU as its process sees it: cuda:0).
    An NCCL error also carries what NCCL and the GPU said of it (`nccl_notes`), read here in
    the proc, where they are known."""

    @functools.wraps(endpoint)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except Exception as e:
            size = int(os.environ.get(PROCS_ENV, "1"))
            if size > 1:
                e.add_note(f"forgesky proc {os.environ.get(RANK_ENV, '?')}/{size}")
            for note in nccl_notes(e):
                e.add_note(note)
            raise

    return call  # type: ignore[return-value]


def nccl_last_error() -> str | None:
    """NCCL's last error in this process (`ncclGetLastError`: NCCL keeps it whatever
    NCCL_DEBUG says), where this process has loaded NCCL; else None."""
    try:
        nccl = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        last = nccl.ncclGetLastError
    except (OSError, AttributeError):
        return None
    last.restype = ctypes.c_char_p
    last.argtypes = [ctypes.c_void_p]
    text = (last(None) or b"").decode(errors="replace").strip()
    return text if text and "unknown nccl error" not in text.lower() else None


def gpu_free() -> tuple[int, int] | None:
    """(free, total) bytes of this proc's current GPU, where it has set up CUDA; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001 - a device in a sticky error state answers nothing
        return None
    return int(free), int(total)


def nccl_notes(
    error: BaseException,
    last_error: Callable[[], str | None] = nccl_last_error,
    free: Callable[[], tuple[int, int] | None] = gpu_free,
) -> list[str]:
    """For an NCCL error raised in this proc: what NCCL said last (`last_error()`), where
    torch's text leaves it out (its NCCL group calls raise `NCCL Error 1: unhandled cuda
    error` alone), and the free memory of this proc's GPU (`free()`); `root_cause` reads
    them back."""
    text = str(error)
    if not _NCCL.search(text):
        return []
    notes = []
    if not _LAST_ERROR.search(text) and (last := last_error()):
        notes.append(_NCCL_NOTE + last)
    room = free()
    if room is not None:
        notes.append(f"{_FREE_NOTE}{room[0]} of {room[1]}")
    return notes


def root_cause(error: BaseException | str) -> str:
    """One line for a failure: the exception, or how the proc died, and where.

    Accepts Monarch's ActorError (an endpoint raised), SupervisionError (an actor or proc
    died), a MeshFailure report, or any exception.
    """
    proc = None
    if isinstance(error, ActorError):
        exc = error.exception
        head = _nccl_cause(_exception_line(exc), exc)
        text = error.exception_formatted
        proc = _noted_proc(exc)
    elif isinstance(error, str):
        text = error
        head = _last_line(text)
    elif type(error).__name__ == "SupervisionError":
        text = str(error)
        head = _last_line(text)
    else:
        return _nccl_cause(_exception_line(error), error)
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


def _nccl_cause(head: str, exc: BaseException) -> str:
    """`head`, an NCCL error's first line, with what NCCL said last and its GPU's free memory
    (from the exception's text or `nccl_notes`), led by "out of memory" where that is what
    they say: NCCL allocates outside torch's allocator, and its CUDA failure is otherwise told
    only as `unhandled cuda error`."""
    message = str(exc)
    if not _NCCL.search(message):
        return head
    notes = [str(n) for n in getattr(exc, "__notes__", ())]
    found = _LAST_ERROR.search(message)
    last = found.group(1).strip() if found else _noted(notes, _NCCL_NOTE)
    if last and "unknown nccl error" in last.lower():
        last = None
    free = _noted(notes, _FREE_NOTE)
    said = []
    if last:
        said.append(f"NCCL: {last}")
    room = None
    if free:
        room, total = (int(x) for x in free.split(" of "))
        said.append(f"{room / 1e9:.1f} of {total / 1e9:.1f} GB free on its GPU")
    if not said:
        return head
    if last and "out of memory" in last.lower():
        return f"out of memory in NCCL ({'; '.join(said)}): {head}"
    # a CUDA call of NCCL's failed on a GPU without room for its buffers, and NCCL named no
    # other CUDA failure (an allocation "failed", say)
    cuda = "cuda" in message.lower() or "cuda" in (last or "").lower()
    other = last is not None and "cuda failure" in last.lower()
    if cuda and not other and room is not None and room < NCCL_ROOM_BYTES:
        return f"out of memory in NCCL, by its GPU's free memory ({'; '.join(said)}): {head}"
    return f"{head} ({'; '.join(said)})"


def _noted(notes: list[str], prefix: str) -> str | None:
    return next((n.removeprefix(prefix) for n in notes if n.startswith(prefix)), None)


def _with_frame(head: str, text: str) -> str:
    frame = _user_frame(text)
    return f"{head} (in {frame})" if frame else head


def failure_of(error: BaseException, service: str | None = None) -> ActorFailure:
    """An ActorFailure for a Monarch error; without `service`, the actor named in the error."""
    if service is None:
        named = _CALL.search(str(error).splitlines()[0] if str(error) else "")
        service = named.group(1) if named else "unknown"
    return ActorFailure(service, root_cause(error), error)


# What a collective says when the process on its other end went away or failed (gloo, NCCL, a
# push whose peer never came, a CUDA IPC handle whose owner is gone, the TCP store of a push
# whose sender died, a process group its peer's failure aborted or destroyed, torch's watchdog
# of a collective that never ended): a consequence, whose cause is that peer's own failure.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"ncclRemoteError|NCCL communicator was aborted|collective operation timeout|"
    r"was not pushed within|pidfd_(?:getfd|open): No such process|"
    r"Connection was likely closed|Failed to recv, got 0 bytes|"
    r"unhandled system error|ncclSystemError|watchdog thread terminated|"
    r"process ?group\b[^\n]*\b(?:destroyed|aborted|shut ?down)",
    re.IGNORECASE,
)


# What Monarch says of a call whose proc stopped answering before it learned how the proc ended
# (its agent's query timed out: a loaded host): the proc's own ending is the cause to name.
_PROC_SILENT = re.compile(
    r"process likely crashed|timeout waiting for message from proc mesh agent", re.IGNORECASE
)


def lost_a_peer(failure: ActorFailure) -> bool:
    """Whether `failure` is a collective that lost its peer, or a call whose proc went silent
    without Monarch saying how: the peer's (or the proc's) own failure (killed, out of
    memory) is then the run's root cause if it is reported soon."""
    return is_consequence(failure.cause) or bool(_PROC_SILENT.search(failure.cause))


def is_consequence(cause: str) -> bool:
    """Whether the failure `cause` (a `root_cause` line) is what a proc sees of another's
    failure (a collective that lost or was aborted by its peer) rather than a cause."""
    return bool(_PEER_LOST.search(cause))


def first_cause(errors: Sequence[BaseException]) -> BaseException:
    """Of the failures several procs of one service raised close together, in the order they
    came: the one the run names. An out-of-memory error first (the proc that ran out fails
    its peers' collectives), then any other cause, then a consequence (`is_consequence`);
    the earliest of its kind."""

    def kind(error: BaseException) -> int:
        cause = root_cause(error)
        return 0 if "out of memory" in cause.lower() else 2 if is_consequence(cause) else 1

    return min(errors, key=kind)


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
