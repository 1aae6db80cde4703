"""A collective that lost its peer (runtime.procs.lifecycle): the peer's death is the run's root
cause. Monarch reports a dead proc within seconds as a rule; a proc of this machine that has
ended is read from the process itself, so the run names it without waiting out the grace."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from runtime.procs.failures import ActorFailure
from runtime.procs.host import proc_ended
from runtime.procs.lifecycle import RunLifecycle
from runtime.procs.mesh import PROBE_SUFFIX, given_name

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@dataclass
class Procs:
    """What the lifecycle reads of a service's mesh: its name, its pids, where they run."""

    service: str
    pids: list[int] = field(default_factory=list)
    local: bool = True
    stopped: bool = False
    failed: bool = False

    def owns(self, mesh_name: str) -> bool:
        return given_name(mesh_name) in (self.service, self.service + PROBE_SUFFIX)


def _ended(proc: subprocess.Popen, within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while (how := proc_ended(proc.pid)) is None:
        assert time.monotonic() < deadline, "the process did not end"
        time.sleep(0.01)
    return how


def test_how_a_child_ended_is_read_without_reaping_it():
    running = subprocess.Popen(SLEEPER)
    killed = subprocess.Popen(SLEEPER)
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        killed.send_signal(signal.SIGKILL)
        assert _ended(killed) == "killed by SIGKILL"
        assert _ended(exited) == "exited with code 3"
        assert proc_ended(running.pid) is None
        # still waitable by whoever started them
        assert killed.wait(5) == -signal.SIGKILL and exited.wait(5) == 3
        # reaped, it is no child any more, and gone
        assert proc_ended(killed.pid) == "ended"
    finally:
        running.kill()
        running.wait()


async def _await_peer(life: RunLifecycle, meshes: list[Procs], report: ActorFailure | None = None):
    life._failed = asyncio.get_running_loop().create_future()
    life._meshes = meshes  # type: ignore[assignment]
    if report is not None:  # Monarch's report, a moment after the peer died
        asyncio.get_running_loop().call_later(0.05, life.fail, report)
    start = time.monotonic()
    await life._await_peer()
    return life.failure, time.monotonic() - start


@contextlib.contextmanager
def two_ranks(killed: int) -> Iterator[list[int]]:
    """Two processes standing for a service's procs, rank `killed` killed (and ended)."""
    ranks = [subprocess.Popen(SLEEPER) for _ in range(2)]
    try:
        ranks[killed].send_signal(signal.SIGKILL)
        _ended(ranks[killed])
        yield [p.pid for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_a_peer_of_this_machine_that_ended_is_named_without_waiting_out_the_grace():
    with two_ranks(killed=1) as pids:
        life = RunLifecycle(peer_grace=60.0, failure_grace=0.2)
        meshes = [Procs("reward", pids[:1]), Procs("trainer", pids)]
        failure, took = asyncio.run(_await_peer(life, meshes))
    assert str(failure) == "trainer actor failed: process killed by SIGKILL (proc 1/2)"
    assert took < 5.0, took  # the grace is 60 s


def test_monarchs_report_of_the_peer_comes_first_where_it_comes_in_time():
    with two_ranks(killed=0) as pids:
        life = RunLifecycle(peer_grace=60.0, failure_grace=2.0)
        report = ActorFailure("trainer", "process killed by SIGKILL (proc 0/2)")
        failure, took = asyncio.run(_await_peer(life, [Procs("trainer", pids)], report))
    assert failure is report and took < 2.0, took


def test_procs_of_other_machines_or_stopped_services_are_not_read():
    # their pids mean nothing here (another machine) or they were ended on purpose
    gone = subprocess.Popen(SLEEPER)
    gone.kill()
    gone.wait()
    life = RunLifecycle(peer_grace=0.6, failure_grace=0.1)
    meshes = [Procs("generator1", [gone.pid], local=False), Procs("reference", [gone.pid])]
    meshes[1].stopped = True
    failure, took = asyncio.run(_await_peer(life, meshes))
    assert failure is None and 0.5 < took < 3.0, took


def test_a_call_whose_proc_went_silent_names_how_the_proc_ended():
    # On a loaded host Monarch can answer a call to a killed proc with its agent's timeout
    # ("likely crashed") before it learns how the proc died: the run names the proc's ending.
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    silent = (
        'timeout waiting for message from proc mesh agent while querying for "reward-x". '
        "The process likely crashed"
    )

    async def answered_silence():
        raise SupervisionError(silent)

    async def scenario(pids):
        life = RunLifecycle(peer_grace=60.0, failure_grace=0.2)
        life._failed = asyncio.get_running_loop().create_future()
        life._meshes = [Procs("reward", pids[:1])]  # type: ignore[assignment]
        start = time.monotonic()
        with contextlib.suppress(ActorFailure):
            await life.call("reward", answered_silence())
        return life.failure, time.monotonic() - start

    with two_ranks(killed=0) as pids:
        failure, took = asyncio.run(scenario(pids))
    assert str(failure) == "reward actor failed: process killed by SIGKILL (proc 0/1)", failure
    assert took < 5.0, took  # the grace is 60 s


SILENT = (
    'timeout waiting for message from proc mesh agent while querying for "{}". '
    "The process likely crashed"
)


async def _failed_after(life: RunLifecycle, meshes: list[Procs], mesh_name: str):
    """The run's failure after Monarch reports `mesh_name` silent, and the seconds it took."""
    life._loop = asyncio.get_running_loop()
    life._failed = life._loop.create_future()
    life._meshes = meshes  # type: ignore[assignment]
    start = time.monotonic()
    life._on_mesh_failure(mesh_name, SILENT.format(mesh_name))
    assert life.failure is None  # not the report at once
    await asyncio.wait_for(asyncio.shield(life._failed), 10.0)
    return life.failure, time.monotonic() - start


def test_a_mesh_whose_proc_went_silent_names_how_the_proc_ended():
    """Monarch's report of a mesh on a killed proc can be its agent's timeout (a loaded host),
    for the service's own mesh or for Monarch's logger mesh: either way the run names how the
    proc ended, not the timeout."""

    for mesh_name in ("generator0_probe-uEYxxKrUd9F", "logger-abEh4xzbDgC"):
        with two_ranks(killed=0) as pids:
            life = RunLifecycle(peer_grace=60.0, failure_grace=0.2)
            meshes = [Procs("generator0", pids[:1])]
            failure, took = asyncio.run(_failed_after(life, meshes, mesh_name))
        assert str(failure) == "generator0 actor failed: process killed by SIGKILL (proc 0/1)", (
            mesh_name,
            failure,
        )
        assert took < 5.0, took  # the grace is 60 s


def test_a_silent_mesh_with_no_ended_proc_is_named_by_its_report_after_the_grace():
    life = RunLifecycle(peer_grace=0.5, failure_grace=0.1)
    meshes = [Procs("reward", [], local=False)]
    failure, took = asyncio.run(_failed_after(life, meshes, "reward-x"))
    assert str(failure).startswith("reward actor failed: timeout waiting for message"), failure
    assert 0.4 < took < 5.0, took


def test_the_logger_meshs_report_of_a_killed_proc_names_the_procs_service():
    """Monarch's logger mesh can report a proc's death, with its cause, before the service's
    own mesh does (on a loaded host by more than the grace): the run names the service whose
    proc of this machine ended, not the logger."""
    with two_ranks(killed=1) as pids:
        life = RunLifecycle(peer_grace=60.0, failure_grace=0.1)

        async def scenario():
            life._loop = asyncio.get_running_loop()
            life._failed = life._loop.create_future()
            life._meshes = [Procs("reward", pids[:1]), Procs("trainer", pids)]  # type: ignore[assignment]
            life._on_mesh_failure("logger-abEh4xzbDgC", "process killed by SIGKILL (proc 1/2)")
            await asyncio.wait_for(asyncio.shield(life._failed), 10.0)
            return life.failure

        failure = asyncio.run(scenario())
    assert str(failure) == "trainer actor failed: process killed by SIGKILL (proc 1/2)", failure
