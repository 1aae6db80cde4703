"""Which failures are a lost peer (a consequence) rather than a root cause."""

from __future__ import annotations

import traceback

from runtime.procs.failures import ActorFailure, lost_a_peer, root_cause


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
