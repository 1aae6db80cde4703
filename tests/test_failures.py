"""Which failures are a lost peer (a consequence) rather than a root cause, which of several
ranks' failures a run names, and how an NCCL error is named by its cause."""

from __future__ import annotations

import traceback

import pytest
import torch
from monarch.actor import ActorError
from torch import OutOfMemoryError as TorchOutOfMemoryError
from torch.distributed import DistBackendError

from runtime.procs.failures import (
    ActorFailure,
    first_cause,
    is_consequence,
    lost_a_peer,
    nccl_last_error,
    nccl_notes,
    root_cause,
)


def test_a_collective_that_lost_its_peer_is_told_apart_from_a_root_cause():
    consequences = [
        "RuntimeError: weight push failed: [gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:1717 (in push.py:181 _raise_if_failed)",
        "DistBackendError: NCCL error: remote process exited or there was a network error",
        "RuntimeError: [Rank 0] Watchdog caught collective operation timeout",
        "TimeoutError: version 5 was not pushed within 300 s",
        # a generator opening the CUDA IPC handle of a trainer killed a moment before (seen on
        # an H100: tests/test_gpu_faults.py, trainer-killed)
        "RuntimeError: pidfd_getfd: No such process (in ipc.py:25 open_ipc)",
        # a generator waiting for a pushed version whose sender (the trainer) was killed: the
        # push's TCP store says so first (seen on two H100s, push-sender-killed)
        "RuntimeError: weight receiver failed: Failed to recv, got 0 bytes. Connection was "
        "likely closed. Did the remote server shutdown or crash? (in push.py:307 wait_for)",
    ]
    causes = [
        "process killed by SIGKILL (proc 1/2)",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (in vllm.py:10 x)",
        "ZeroDivisionError: division by zero (in faulty_rewards.py:11 explode)",
    ]
    assert all(lost_a_peer(ActorFailure("trainer", c)) for c in consequences)
    assert not any(lost_a_peer(ActorFailure("generator0", c)) for c in causes)


def _calls_generated_code() -> None:
    # as a dataclass's generated __init__ is: code compiled from a string
    scope: dict = {}
    source = "def __init__():\n    raise MemoryError('CUDA error: out of memory')"
    exec(compile(source, "<string>", "exec"), scope)
    scope["__init__"]()


def test_the_line_names_a_file_not_code_compiled_from_a_string():
    try:
        _calls_generated_code()
    except MemoryError:
        # an explicit limit: SkyPilot's print_exception_no_traceback, when what it wraps raises,
        # leaves sys.tracebacklimit at 0 in the process (here, the launcher tests' pytest)
        text = traceback.format_exc(limit=20)
    line = _calls_generated_code.__code__.co_firstlineno + 5
    assert root_cause(text) == (
        f"MemoryError: CUDA error: out of memory (in test_failures.py:{line} _calls_generated_code)"
    )


# Texts as torch raises them on a GPU: torch's NCCL group calls (`NCCL Error N: ...`, the whole
# message; 2 x H200, main at eeb25fd, rank 1 of the trainer with 0.5 GB of its GPU left), its
# process group's checks (DistBackendError, NCCL's last error after the first line), and the
# CUDA allocator's out-of-memory error (2 x H200, 2026-11-26c).
NCCL_GROUP_CALL = "NCCL Error 1: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
NCCL_CHECK = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.7\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\n"
    "Cuda failure 2 'out of memory'"
)
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3699, remote "
    "process exited or there was a network error, NCCL version 2.27.7\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.\n"
    "Last error:\n"
    "socketProgress: Connection closed by remote peer 10.0.0.2<45678>"
)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:21915. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF!"
)
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 188.00 MiB. GPU 0 has a total capacity of 139.80 GiB "
    "of which 19.94 MiB is free. Including non-PyTorch memory, this process has 11.52 GiB "
    "memory in use."
)
GB = 10**9


def raised_on(error: BaseException, proc: str = "", **notes) -> ActorError:
    """`error` as the controller gets it from a proc: with the notes `ranked` adds there
    (`nccl_notes` with NCCL's last error and the GPU's free memory as given), through Monarch's
    ActorError."""
    if proc:
        error.add_note(f"forgesky proc {proc}")
    for note in nccl_notes(error, **notes):
        error.add_note(note)
    try:
        raise error
    except type(error) as e:
        return ActorError(e)


def test_nccl_out_of_memory_is_named_out_of_memory_by_what_nccl_said_last():
    # torch's group call says only "unhandled cuda error": NCCL's own last error says why
    error = raised_on(
        RuntimeError(NCCL_GROUP_CALL),
        "1/2",
        last_error=lambda: "Cuda failure 2 'out of memory'",
        free=lambda: (int(0.48 * GB), int(150.1 * GB)),
    )
    assert root_cause(error) == (
        "out of memory in NCCL (NCCL: Cuda failure 2 'out of memory'; 0.5 of 150.1 GB free on "
        f"its GPU): RuntimeError: {NCCL_GROUP_CALL} (in test_failures.py:"
        f"{raised_on.__code__.co_firstlineno + 9} raised_on) (proc 1/2)"
    )
    # torch's process-group check carries NCCL's last error in its later lines
    checked = root_cause(raised_on(DistBackendError(NCCL_CHECK), "1/2", last_error=lambda: None))
    assert checked.startswith(
        "out of memory in NCCL (NCCL: Cuda failure 2 'out of memory'): DistBackendError: NCCL "
        "error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error"
    ), checked
    assert checked.endswith("(proc 1/2)"), checked


def test_without_nccls_word_a_cuda_failure_with_its_gpu_full_is_out_of_memory():
    full = raised_on(
        RuntimeError(NCCL_GROUP_CALL), last_error=lambda: None, free=lambda: (400 << 20, 80 << 30)
    )
    assert root_cause(full).startswith(
        "out of memory in NCCL, by its GPU's free memory (0.4 of 85.9 GB free on its GPU): "
        f"RuntimeError: {NCCL_GROUP_CALL}"
    )
    # NCCL's words for an allocation that failed, without CUDA's
    allocation = raised_on(
        RuntimeError(NCCL_GROUP_CALL),
        last_error=lambda: "Failed to CUDA calloc 6291456 bytes",
        free=lambda: (300 << 20, 80 << 30),
    )
    assert root_cause(allocation).startswith(
        "out of memory in NCCL, by its GPU's free memory (NCCL: Failed to CUDA calloc 6291456 "
        "bytes; 0.3 of 85.9 GB free on its GPU): RuntimeError: NCCL Error 1"
    )
    # NCCL named another CUDA failure: that, whatever the GPU's free memory
    invalid = raised_on(
        RuntimeError(NCCL_GROUP_CALL),
        last_error=lambda: "Cuda failure 1 'invalid argument'",
        free=lambda: (300 << 20, 80 << 30),
    )
    assert root_cause(invalid).startswith(
        f"RuntimeError: {NCCL_GROUP_CALL} (NCCL: Cuda failure 1 'invalid argument'; 0.3 of 85.9"
    )
    # with room on the GPU the error is told as it is, with what was known
    room = raised_on(
        RuntimeError(NCCL_GROUP_CALL), last_error=lambda: None, free=lambda: (40 * GB, 80 * GB)
    )
    assert root_cause(room).startswith(
        f"RuntimeError: {NCCL_GROUP_CALL} (40.0 of 80.0 GB free on its GPU)"
    )
    other = raised_on(
        RuntimeError("NCCL Error 3: internal error"),
        last_error=lambda: "Invalid config blocking attribute value -2147483648",
        free=lambda: None,
    )
    assert root_cause(other).startswith(
        "RuntimeError: NCCL Error 3: internal error (NCCL: Invalid config blocking attribute "
        "value -2147483648)"
    )
    # nothing is added to what is not NCCL's
    assert nccl_notes(ValueError("bad value"), lambda: "stale", lambda: (1, 2)) == []
    if not torch.distributed.is_nccl_available():
        # a CPU build of torch loads no NCCL and sets up no GPU: nothing to add, nothing raised
        assert nccl_last_error() is None
        assert nccl_notes(RuntimeError(NCCL_GROUP_CALL)) == []


@pytest.mark.parametrize("order", ["out-of-memory-first", "collective-first"])
def test_the_rank_out_of_memory_is_named_whichever_failure_came_first(order):
    """Rank 1 runs out of memory (in its CUDA allocator, or in NCCL); rank 0 fails in the
    collective that rank 1 then left: in either order the run names rank 1's error."""
    for oom, collective in [
        (TorchOutOfMemoryError(CUDA_OOM), RuntimeError(GLOO_CLOSED)),
        (RuntimeError(NCCL_GROUP_CALL), DistBackendError(NCCL_REMOTE)),
    ]:
        cause = raised_on(
            oom, "1/2", last_error=lambda: "Cuda failure 2 'out of memory'", free=lambda: None
        )
        symptom = raised_on(collective, "0/2", last_error=lambda: None, free=lambda: None)
        errors = [cause, symptom] if order == "out-of-memory-first" else [symptom, cause]
        assert first_cause(errors) is cause
        assert "out of memory" in root_cause(cause).lower()
        assert is_consequence(root_cause(symptom)), root_cause(symptom)
        assert not is_consequence(root_cause(cause))


def test_a_cause_is_named_before_consequences_and_the_earliest_of_a_kind():
    def plain(error: BaseException, proc: str) -> ActorError:
        return raised_on(error, proc, last_error=lambda: None, free=lambda: None)

    bug = plain(ZeroDivisionError("division by zero"), "1/4")
    closed = plain(RuntimeError(GLOO_CLOSED), "0/4")
    remote = plain(DistBackendError(NCCL_REMOTE), "2/4")
    timeout = plain(RuntimeError("[Rank 3] Watchdog caught collective operation timeout"), "3/4")
    assert first_cause([closed, remote, bug, timeout]) is bug
    assert first_cause([closed, remote, timeout]) is closed
    other = plain(KeyError("step"), "3/4")
    assert first_cause([closed, bug, other]) is bug
    destroyed = plain(RuntimeError("Process group has been destroyed or aborted"), "0/2")
    assert is_consequence(root_cause(destroyed))
