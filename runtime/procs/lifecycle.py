"""One way for a run to end: normal end, SIGINT, SIGTERM and actor failures share one path.

    def main() -> int:
        return lifecycle.run(controller_main)        # exit code: 0, 1 (failure), 2, 130

    async def controller_main(life: RunLifecycle) -> None:
        trainer = await spawn_service(life, "trainer", 1, gpus=[(0,)])  # procs/spawn.py
        actor = trainer.spawn_actor(Trainer, cfg)
        while not life.stopping.is_set():
            await life.call("trainer", actor.step.call())

- The first SIGINT/SIGTERM sets `stopping`; in-flight calls finish, then registered resources
  stop in reverse order. A second SIGINT kills every child process and exits 130 at once.
- During start-up (`life.start(...)`) a stop abandons it: nothing is trained yet, so nothing is
  waited for; what was started stops within `failure_shutdown` s and the run exits 0.
- Any failure (an endpoint raises, a proc dies, Monarch reports a mesh failure) ends the run with
  exit code 1 and one line: `forgesky: reward actor failed: ZeroDivisionError: ... (in f.py:12 g)`.
  A collective that lost its peer, or a proc Monarch could only call silent (its agent's query
  timed out), waits `peer_grace` s for the proc's own failure, the root cause (a proc of this
  machine found ended meanwhile is named after `failure_grace` s).
- A call unanswered within its `timeout` ends the run too (the controller's watchdog).
- On every exit path no child process survives and no shared-memory segment of the run remains.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.procs.failures import (
    PROC,
    ActorFailure,
    failure_of,
    is_monarch_error,
    lost_a_peer,
    root_cause,
)
from runtime.procs.host import (
    become_subreaper,
    kill_descendants,
    proc_ended,
    start_monarch,
    sweep_shared_memory,
)
from runtime.procs.mesh import PROBE_SUFFIX, ServiceMesh, given_name
from runtime.procs.signals import StopSignals

T = TypeVar("T")

FORCED_EXIT_CODE = 130
# how often a collective that lost its peer looks at this machine's procs meanwhile
PEER_POLL_S = 0.25
_FAILED_MESH_STOP_S = 1.0


class RunStopping(Exception):
    """Raised by an interruptible `RunLifecycle.call` once a stop was requested."""


@dataclass
class _Resource:
    name: str
    stop: Callable[[], Awaitable[Any]]
    timeout: float
    mesh: ServiceMesh | None = None
    # keeps its own timeout after a failure too, outside `failure_shutdown`'s budget
    after_failure: bool = False
    # an actor's clean-up on `mesh` (not the procs' own stop): nothing to do once they ended
    on_mesh: bool = False


class RunLifecycle:
    """Signals, supervised endpoint calls, and the shutdown of everything a run started."""

    def __init__(
        self,
        name: str = "forgesky",
        *,
        drain_timeout: float = 10.0,
        stop_grace: float | None = 300.0,
        failure_grace: float = 1.0,
        failure_shutdown: float = 10.0,
        # Monarch reports a killed proc within seconds; on a loaded machine (two cores, a
        # checkpoint being written) once only after the 5 s this was
        peer_grace: float = 15.0,
        slow_shutdown_s: float = 5.0,
    ) -> None:
        self.name = name
        self.drain_timeout = drain_timeout
        self.stop_grace = stop_grace
        self.failure_grace = failure_grace
        self.failure_shutdown = failure_shutdown
        self.peer_grace = peer_grace
        # a clean shutdown longer than this says on stderr what took the time
        self.slow_shutdown_s = slow_shutdown_s
        self.failure: ActorFailure | None = None
        # service -> where it runs ("node 0 GPU 1"), added to the line a failure ends the run with
        self.places: dict[str, str] = {}
        # service of several procs -> where each runs, by proc rank: a failure that names its
        # proc ("(proc 1/2)", runtime.procs.failures) names that proc's GPU
        self.proc_places: dict[str, list[str]] = {}
        self._resources: list[_Resource] = []
        self._meshes: list[ServiceMesh] = []
        self._inflight: set[asyncio.Future[Any]] = set()
        # mesh failures waiting for how their proc ended (`_on_mesh_failure`)
        self._waiting: set[asyncio.Task[None]] = set()
        self._signals = StopSignals(
            on_stop=lambda: self._call_soon(self.request_stop), on_force=self._force_exit
        )
        self._shutting_down = False
        self._starting = False
        # a stop came during start-up: no work in flight is worth waiting for
        self.abandoned = False

    # --- setup ----------------------------------------------------------------------------------

    def install(self) -> None:
        """Take over SIGINT/SIGTERM and Monarch's fault hook; call once, from the running loop."""
        self._loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self._failed: asyncio.Future[None] = self._loop.create_future()
        self._stop_requested: asyncio.Future[None] = self._loop.create_future()
        become_subreaper()
        start_monarch()
        import monarch.actor

        monarch.actor.unhandled_fault_hook = self._fault_hook
        self._signals.install()

    def _force_exit(self) -> None:
        _say(self.name, "forced exit: killing child processes")
        kill_descendants(grace=0.0)
        sweep_shared_memory()
        os._exit(FORCED_EXIT_CODE)

    def _call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is over anyway
            self._loop.call_soon_threadsafe(callback, *args)

    # --- stop and failure -----------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the run to finish its in-flight work and end (what the first Ctrl-C does)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._stop_requested.set_result(None)
        what = (
            "start-up abandoned, nothing was trained"
            if self._starting
            else "finishing in-flight work"
        )
        _say(self.name, f"stopping: {what} (Ctrl-C again to force)")

    def fail(self, failure: ActorFailure) -> None:
        """Record a failure; the first one is the root cause the run reports."""
        if self.failure is None:
            self.failure = failure
            self._failed.set_result(None)

    def failure_line(self, failure: ActorFailure) -> str:
        """The failure's line, with where its service runs (its node and GPUs) when known."""
        line = str(failure)
        place = self.places.get(failure.service)
        procs = self.proc_places.get(failure.service, [])
        proc = PROC.search(line)
        if proc and int(proc.group(2)) == len(procs):
            place = procs[int(proc.group(1))]
        if place is None and failure.service == "generator":  # a call to every replica
            place = "; ".join(v for k, v in self.places.items() if k.startswith("generator"))
        return f"{line} (on {place})" if place and place not in line else line

    def _fault_hook(self, failure: Any) -> None:
        # Monarch calls this on its own thread for failures no actor handled; returning (not
        # raising) keeps Monarch from exiting the process on its own.
        try:
            name, report = failure.mesh_name, failure.report()
        except Exception:  # noqa: BLE001 - a hook that raises makes Monarch exit the process
            name, report = "unknown", str(failure)
        self._call_soon(self._on_mesh_failure, name, report)

    def _on_mesh_failure(self, mesh_name: str, report: str) -> None:
        mesh = next((m for m in self._meshes if m.owns(mesh_name)), None)
        if mesh is not None:
            if mesh.stopped:
                return
            mesh.failed = True
            failure, delay = ActorFailure(mesh.service, root_cause(report)), 0.0
        elif not self._shutting_down:
            # A proc's death fails Monarch's own logger mesh first, then the service's meshes:
            # give a failure that names the service a moment to arrive.
            service = given_name(mesh_name).removesuffix(PROBE_SUFFIX)
            # a proc of this machine found ended is the one whose death Monarch reports: its
            # service is the one to name, should the service's own report come late
            ended = self._ended_proc()
            if ended is not None:
                service = ended.service
            failure, delay = ActorFailure(service, root_cause(report)), self.failure_grace
        else:
            return
        if lost_a_peer(failure) and not self._shutting_down:
            # Monarch's query of the proc's agent timed out before it learned how the proc
            # ended (a loaded host), or a collective lost its peer: how the proc ended is the
            # cause to name, as for a call that failed so (`call`). (Shutting down, nothing is
            # left to wait with: the failure is recorded as it came.)
            task = self._loop.create_task(self._fail_after_peer(failure, delay))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
        elif delay:
            self._loop.call_later(delay, self.fail, failure)
        else:
            self.fail(failure)

    async def _fail_after_peer(self, failure: ActorFailure, delay: float) -> None:
        await self._await_peer()
        if delay and self.failure is None:
            await asyncio.wait({self._failed}, timeout=delay)
        self.fail(failure)

    # --- resources and calls --------------------------------------------------------------------

    def register(
        self,
        name: str,
        stop: Callable[[], Awaitable[Any]],
        timeout: float = 30.0,
        after_failure: bool = False,
        mesh: ServiceMesh | None = None,
    ) -> None:
        """Stop `stop()` at shutdown, after everything registered later, within `timeout` s
        (after a failure within what is left of `failure_shutdown`, unless `after_failure`:
        work worth its own time even then). `mesh`: the procs `stop` asks (an actor's own
        clean-up): it is skipped once they are ended, and bounded like them once they fail."""
        self._resources.append(
            _Resource(
                name, stop, timeout, mesh, after_failure=after_failure, on_mesh=mesh is not None
            )
        )

    def watch(self, mesh: ServiceMesh) -> None:
        """Attribute Monarch failures of `mesh`'s actors to its service."""
        self._meshes.append(mesh)

    def own(self, mesh: ServiceMesh, stop_timeout: float = 30.0) -> None:
        """Attribute `mesh`'s failures to its service and stop its procs at shutdown."""
        self.watch(mesh)
        self._resources.append(_Resource(f"{mesh.service} procs", mesh.stop, stop_timeout, mesh))

    async def call(
        self,
        service: str,
        awaitable: Awaitable[T],
        *,
        timeout: float | None = None,
        interruptible: bool = False,
        silence: Callable[[], str] | None = None,
    ) -> T:
        """Await an endpoint call of `service`; any failure of the run ends it as ActorFailure.

        Raises the run's first ActorFailure if this call fails or anything else fails first,
        RunStopping if `interruptible` and a stop is requested first. A call unanswered after
        `timeout` s fails the run too, with `silence()` as its cause where given.
        """
        if self.failure is not None:
            raise self.failure
        task = asyncio.ensure_future(awaitable)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        # Its failure is this call's to report, and when this call was cancelled first (the
        # controller drops work in flight as the run ends) it is a consequence nobody awaits:
        # taken here, asyncio does not print it as "never retrieved" when the process ends.
        task.add_done_callback(_taken)
        waits: set[asyncio.Future[Any]] = {task, self._failed}
        if interruptible:
            waits.add(self._stop_requested)
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            try:
                return task.result()
            except ActorFailure as e:
                failure = e
            except Exception as e:  # noqa: BLE001 - Monarch's ActorError/SupervisionError
                if not is_monarch_error(e):
                    raise
                failure = failure_of(e, service)
            if lost_a_peer(failure) and self.failure is None:
                # A collective whose peer died fails before Monarch reports the death (a
                # generator killed mid-push): the death is the root cause the run names.
                await self._await_peer()
            self.fail(failure)
            assert self.failure is not None
            raise self.failure
        task.cancel()  # nobody awaits its answer any more; its exception is taken (_taken)
        if self.failure is not None:
            raise self.failure
        if interruptible and self.stopping.is_set():
            raise RunStopping()
        cause = silence() if silence is not None else f"no answer within {timeout:g} s"
        self.fail(ActorFailure(service, cause))
        raise self.failure  # type: ignore[misc]

    async def start(self, startup: Awaitable[T]) -> T:
        """Await the run's start-up (`startup`: procs spawned, actors set up, state restored).

        A stop requested meanwhile abandons it and raises RunStopping: no step was trained, so
        there is nothing to finish or save, and waiting for the slowest service to come up
        first would only delay the exit. The calls in flight are dropped, and shutdown stops
        what was started within `failure_shutdown` s.
        """
        task = asyncio.ensure_future(startup)
        task.add_done_callback(_taken)  # its failure is raised below, or the run's already
        self._starting = True
        try:
            await asyncio.wait({task, self._stop_requested}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the run is ending (a failure): its start-up with it
            raise
        finally:
            self._starting = False
        if task.done() and not self._stop_requested.done():
            return task.result()
        self.abandoned = True
        if not task.done():
            task.cancel()
            # a spawn or a set-up cancelled in its await ends at once; its procs at shutdown
            await asyncio.wait({task}, timeout=self.drain_timeout)
        if task.done() and not task.cancelled() and not isinstance(task.exception(), RunStopping):
            task.result()  # a failure that came with the stop is still the run's end
        raise RunStopping()

    async def _await_peer(self) -> None:
        """A collective lost its peer: wait up to `peer_grace` s for the peer's own failure.
        A proc of this machine that has ended meanwhile is that peer: Monarch's report of it
        (a proc's death, within seconds as a rule) gets `failure_grace` s more, then the
        proc's own ending, read from the process, is the failure."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.peer_grace
        while self.failure is None and (left := end - loop.time()) > 0:
            ended = self._ended_proc()
            if ended is not None:
                await asyncio.wait({self._failed}, timeout=min(self.failure_grace, left))
                self.fail(ended)
                return
            await asyncio.wait({self._failed}, timeout=min(PEER_POLL_S, left))

    def _ended_proc(self) -> ActorFailure | None:
        """The first proc of a running service on this machine that has ended, as its failure
        (`process killed by SIGKILL (proc 1/2)`), or None."""
        for mesh in self._meshes:
            if mesh.stopped or not mesh.local:
                continue
            for rank, pid in enumerate(mesh.pids):
                how = proc_ended(pid)
                if how is not None:
                    # as Monarch's reports name a proc, of one too
                    return ActorFailure(
                        mesh.service, f"process {how} (proc {rank}/{len(mesh.pids)})"
                    )
        return None

    # --- running and shutting down --------------------------------------------------------------

    async def run(self, main: Callable[[RunLifecycle], Awaitable[None]]) -> int:
        """Run `main(self)` to its end, a stop or a failure; shut down; return the exit code."""
        from recipes import UserError

        self.install()
        code = 0
        try:
            await self._supervise(main)
        except ActorFailure as e:
            self.fail(e)  # one main raised itself, not through `call`, is the run's failure too
        except (RunStopping, asyncio.CancelledError):
            pass
        except UserError as e:
            _say(self.name, str(e))
            code = 2
        except Exception as e:
            if not is_monarch_error(e):
                traceback.print_exc()
                code = 1
            else:  # main awaited a call without `call`
                self.fail(failure_of(e))
        reported = self.failure
        if reported is not None:
            _say(self.name, self.failure_line(reported))
        try:
            await self.shutdown()
        finally:
            self._signals.uninstall()
        if self.failure is not None and self.failure is not reported:
            _say(self.name, self.failure_line(self.failure))
        return 1 if self.failure is not None else code

    async def _supervise(self, main: Callable[[RunLifecycle], Awaitable[None]]) -> None:
        # main may await things other than `call`: racing it against failures ends the run on a
        # failure even then, and a stop request gives it `stop_grace` seconds to wind down.
        task = asyncio.ensure_future(main(self))
        first = {task, self._failed, self._stop_requested}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and self.failure is None:
            grace = self.stop_grace
            await asyncio.wait(
                {task, self._failed}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
            )
            if not task.done() and self.failure is None:
                _say(self.name, f"in-flight work did not finish within {grace} s; cancelling it")
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=self.drain_timeout)
        if self.failure is not None:
            if task.done() and not task.cancelled():
                task.exception()  # main raised the failure itself: seen, so asyncio stays quiet
            raise self.failure
        if task.done() and not task.cancelled():
            task.result()

    async def shutdown(self) -> None:
        """Drain in-flight calls, stop resources newest first, end Monarch, clean up the host.

        After a failure everything gets `failure_shutdown` seconds in all: a mesh with a dead
        proc may never stop cleanly, and what does not stop is killed at the end anyway. After
        an abandoned start-up the same, and this machine's service procs are ended first: they
        hold nothing yet.
        """
        self._shutting_down = True
        brisk = self.failure is not None or self.abandoned
        began = self._loop.time()
        deadline = began + self.failure_shutdown
        parts: list[tuple[float, str]] = []
        if self._inflight:
            # After a failure or an abandoned start-up the answers no longer matter, and some
            # would never come.
            await asyncio.wait(set(self._inflight), timeout=0.0 if brisk else self.drain_timeout)
            for task in list(self._inflight):
                task.cancel()  # nobody awaits its answer any more; its exception is taken (_taken)
        if self.abandoned:
            self._end_local_procs()
        for resource in reversed(self._resources):
            seconds = await self._stop(resource, brisk, deadline)
            parts.append((seconds, resource.name))
            if resource.after_failure:
                deadline += seconds  # the others keep their budget
        self._resources.clear()
        start = self._loop.time()
        await _stop_monarch()
        kill_descendants(grace=2.0)
        sweep_shared_memory()
        parts.append((self._loop.time() - start, "Monarch and the host's clean-up"))
        took = self._loop.time() - began
        if not brisk and took > self.slow_shutdown_s:
            slowest = sorted(parts, reverse=True)[:4]
            _say(
                self.name,
                f"shutdown took {took:.1f} s: "
                + ", ".join(f"{name} {seconds:.1f} s" for seconds, name in slowest),
            )

    def _end_local_procs(self) -> None:
        """After an abandoned start-up: end this machine's service procs at once. They hold
        nothing yet, and a proc busy in its set-up (importing, building a model) would hold up
        Monarch's stop of it until the set-up is done; their children end with the host's
        clean-up, Monarch's view of them with Monarch."""
        for mesh in self._meshes:
            if not mesh.local or mesh.stopped:
                continue
            mesh.stopped = True  # its procs' deaths are this stop, not a failure
            for pid in mesh.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def _stop(self, resource: _Resource, brisk: bool, deadline: float) -> float:
        """Stop one resource within its time (`brisk`: what is left until `deadline`, too);
        the seconds it took. A resource that fails to stop is said in one line (not after a
        failure or an abandoned start-up: what is left is killed anyway)."""
        start = self._loop.time()
        if resource.on_mesh and resource.mesh is not None and resource.mesh.stopped:
            return 0.0  # its actor went with its procs
        timeout = resource.timeout
        if brisk and not resource.after_failure:
            timeout = max(0.5, min(timeout, deadline - start))
        if resource.mesh is not None and resource.mesh.failed:
            # Monarch waits out its 30 s spawn timeout for actors on a dead proc.
            timeout = min(timeout, _FAILED_MESH_STOP_S)
        try:
            await asyncio.wait_for(resource.stop(), timeout)
        except TimeoutError:
            if not brisk:
                _say(self.name, f"{resource.name}: did not stop within {timeout:g} s")
        except Exception as e:  # noqa: BLE001 - one line per resource, the others still stop
            if not brisk:
                _say(self.name, f"{resource.name}: stop failed: {root_cause(e)}")
        return self._loop.time() - start


def run(main: Callable[[RunLifecycle], Awaitable[None]], **options: Any) -> int:
    """Run a controller coroutine under a RunLifecycle; returns the process exit code."""
    return asyncio.run(RunLifecycle(**options).run(main))


# --- helpers -------------------------------------------------------------------------------------


def _say(name: str, message: str) -> None:
    print(f"{name}: {message}", file=sys.stderr, flush=True)


def _taken(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _stop_monarch() -> None:
    from monarch.actor import shutdown_context

    with contextlib.suppress(Exception):
        await asyncio.wait_for(_awaited(shutdown_context(host_timeout=2.0)), 5.0)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
