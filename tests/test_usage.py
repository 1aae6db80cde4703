"""runtime.procs.usage: a thread's CPU seconds and context switches around a call."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.procs.usage import thread_usage

pytestmark = pytest.mark.skipif(thread_usage() is None, reason="no per-thread usage here")


def test_cpu_work_counts_as_cpu_and_sleeping_does_not():
    before = thread_usage()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    busy = thread_usage().since(before)
    assert busy.cpu_s > 0.2

    before = thread_usage()
    for _ in range(20):
        time.sleep(0.01)
    idle = thread_usage().since(before)
    assert idle.cpu_s < 0.05
    # each sleep gave the core up by choice
    assert idle.voluntary_switches >= 20


def test_waiting_on_a_lock_held_elsewhere_is_a_voluntary_switch_of_this_thread_alone():
    lock, taken = threading.Lock(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            time.sleep(0.2)

    other = threading.Thread(target=hold)
    other.start()
    taken.wait()
    before = thread_usage()
    with lock:
        pass
    waited = thread_usage().since(before)
    other.join()
    assert waited.voluntary_switches >= 1
    assert waited.cpu_s < 0.1  # 0.2 s waited, not spent


def test_as_metrics_names_every_figure_under_the_prefix():
    u = thread_usage()
    metrics = u.as_metrics("generator/engine_thread")
    assert set(metrics) == {
        "generator/engine_thread_cpu_s",
        "generator/engine_thread_voluntary_switches",
        "generator/engine_thread_involuntary_switches",
    }
    assert all(isinstance(v, float) for v in metrics.values())
