"""Fixtures every test file can take, and the rule that a Monarch fault fails the test that
caused it."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import runtime_helpers
from hypothesis import settings

# `pytest --hypothesis-profile=deep tests/test_fuzz.py`: many more examples than the suite's.
settings.register_profile("deep", max_examples=3000)


class MonarchFaults:
    """Failures Monarch reported that no actor handled (a proc that died, a mesh that failed),
    as they arrive on Monarch's own thread."""

    def __init__(self) -> None:
        self.reports: list[Any] = []
        self._arrived = threading.Condition()

    def record(self, failure: Any) -> None:
        with self._arrived:
            self.reports.append(failure)
            self._arrived.notify_all()

    def wait_for(self, count: int = 1, timeout: float = 30.0) -> list[Any]:
        """Block until `count` reports have come (Monarch polls its procs every second)."""
        return self._wait(lambda: len(self.reports) >= count, timeout)

    def wait_for_meshes(self, given: set[str], timeout: float = 120.0) -> list[Any]:
        """Block until a report has come for each mesh `given` names (`<given>-<suffix>`):
        every mesh on a dead proc is reported, and on a loaded host some only when Monarch's
        query of the proc's agent times out, which must not land in a later test."""
        from runtime.procs.mesh import given_name

        return self._wait(lambda: given <= {given_name(r.mesh_name) for r in self.reports}, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        with self._arrived:
            while not done() and time.monotonic() < deadline:
                self._arrived.wait(deadline - time.monotonic())
        return list(self.reports)


_current: MonarchFaults | None = None


def _route(failure: Any) -> None:
    if _current is not None:
        _current.record(failure)


@pytest.fixture(autouse=True)
def monarch_faults(request: pytest.FixtureRequest) -> Iterator[MonarchFaults]:
    """Monarch's default hook for a failure nobody handled exits the process. Here each test
    records them, and any it recorded fail it at teardown: a proc that died unexpectedly fails
    the test that started it, not the session. A test that causes faults on purpose carries
    `@pytest.mark.monarch_faults`, takes this fixture, and waits for and checks its reports
    (`wait_for`), so none arrives during a later test."""
    global _current
    faults = MonarchFaults()
    if importlib.util.find_spec("monarch") is None:
        # a machine with the trainer's stack alone (scripts/gpu/device_run.sh trainer-tests):
        # no test there can start a Monarch proc, so none can fail unhandled
        yield faults
        return
    import monarch.actor

    _current = faults
    monarch.actor.unhandled_fault_hook = _route
    yield faults
    _current = None
    if faults.reports and request.node.get_closest_marker("monarch_faults") is None:
        pytest.fail(
            f"Monarch reported {len(faults.reports)} unhandled failure(s) during this test: "
            + "; ".join(_describe(f) for f in faults.reports),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def traceback_limit_as_python_sets_it() -> Iterator[None]:
    """SkyPilot's print_exception_no_traceback sets sys.tracebacklimit to 0 and, when what it
    wraps raises, leaves it there: after a launcher test the suite's process would format every
    later traceback without frames (the failure line's `(in FILE:LINE func)` then goes)."""
    yield
    if getattr(sys, "tracebacklimit", None) is not None:
        del sys.tracebacklimit


def _describe(failure: Any) -> str:
    try:
        return f"{failure.mesh_name}: {failure.report().strip().splitlines()[-1]}"
    except Exception:  # noqa: BLE001 - a description, whatever Monarch handed over
        return repr(failure)


@pytest.fixture(scope="session")
def tiny_lora_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(run dir, output) of a real `tiny-lora` run, uninterrupted, in lock-step (tests/
    fault_runs.py's lock_step_args): what test_faults.py resumes a LoRA run against, and the
    run whose checkpoints test_lora_runs.py exports and evaluates (one run for both: each is
    half a minute of the suite)."""
    from fault_runs import STEPS, RuntimeRun, lock_step_args

    run_dir = tmp_path_factory.mktemp("tiny-lora") / "run"
    run = RuntimeRun(lock_step_args(run_dir, recipe="tiny-lora"))
    assert run.finish(timeout=600) == 0, run.output
    assert f"finished at step {STEPS}" in run.output, run.output
    return run_dir, run.output


@pytest.fixture
def token_batch() -> Any:
    """`token_batch(vocab, rows, width, prompt=8, seed=0, short=None, empty=False)`: random
    tokens, a right-padded response mask and per-row advantages (runtime_helpers)."""
    return runtime_helpers.token_batch


@pytest.fixture
def free_port() -> Any:
    """`free_port(*hosts)`: a TCP port free on every host given (default: the loopback)."""
    return runtime_helpers.free_port


@pytest.fixture
def nothing_left() -> Any:
    """`nothing_left(output, pgid=...)`: the run printed no noise and left no process of its
    session and no shared-memory segment made since the test began."""
    before = runtime_helpers.shm_entries()

    def check(output: str, pgid: int | None = None, noise: tuple[str, ...] = runtime_helpers.NOISE):
        runtime_helpers.assert_nothing_left(output, pgid=pgid, shm_before=before, noise=noise)

    return check


def pytest_ignore_collect(collection_path: Any, config: Any) -> bool | None:
    """`pytest -m gpu` on a GPU machine: the peer comparison of the losses (CPU tests, none of
    them gpu-marked) imports verl, which `make install` puts in the CPU venv and a GPU stack
    does not have; there it is not collected. Every other run collects it (and fails without
    verl)."""
    if config.option.markexpr == "gpu" and collection_path.name == "test_losses.py":
        return True
    return None
