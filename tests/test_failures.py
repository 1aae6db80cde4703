"""Which failures are a lost peer (a consequence) rather than a root cause."""

from __future__ import annotations

from runtime.procs.failures import ActorFailure, lost_a_peer


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
    ]
    causes = [
        "process killed by SIGKILL (proc 1/2)",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (in vllm.py:10 x)",
        "ZeroDivisionError: division by zero (in faulty_rewards.py:11 explode)",
    ]
    assert all(lost_a_peer(ActorFailure("trainer", c)) for c in consequences)
    assert not any(lost_a_peer(ActorFailure("generator0", c)) for c in causes)
