"""One way for a run to end: normal end, SIGINT, SIGTERM and actor failures share one path.

    def main() -> int:
        return lifecycle.run(controller_main)        # exit code: 0, 1 (failure), 2, 130

    async def controller_main(life: RunLifecycle) -> None:
        trainer = await life.spawn_service("trainer", 1, gpus=[(0,)])
        actor = trainer.spawn_actor(Trainer, cfg)
        while not life.stopping.is_set():
            await life.call("trainer", actor.step.call())

- The first SIGINT/SIGTERM sets `stopping`; in-flight calls finish, then registered resources
  stop in reverse order. A second SIGINT kills every child process and exits 130 at once.
- Any failure (an endpoint raises, a proc dies, Monarch reports a mesh failure) ends the run with
  exit code 1 and one line: `forgesky: reward actor failed: ZeroDivisionError: ... (in f.py:12 g)`.
- On every exit path no child process survives and no shared-memory segment of the run remains.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, TypeVar

import psutil

from runtime.mesh import RUN_ID_ENV, ActorFailure, ServiceMesh, root_cause

T = TypeVar("T")

FORCED_EXIT_CODE = 130
_SHM_DIR = Path("/dev/shm")
# Monarch polls proc state every 10 s by default: a killed proc would go unnoticed that long.
_MONARCH_ENV_DEFAULTS = {"HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s"}
_PR_SET_CHILD_SUBREAPER = 36


class RunStopping(Exception):
    """Raised by an interruptible `RunLifecycle.call` once a stop was requested."""


@dataclass
class _Resource:
    name: str
    stop: Callable[[], Awaitable[Any]]
    timeout: float


class RunLifecycle:
    """Signals, supervised endpoint calls, and the shutdown of everything a run started."""

    def __init__(
        self,
        name: str = "forgesky",
        *,
        drain_timeout: float = 10.0,
        stop_grace: float | None = 300.0,
        failure_grace: float = 1.0,
    ) -> None:
        self.name = name
        self.drain_timeout = drain_timeout
        self.stop_grace = stop_grace
        self.failure_grace = failure_grace
        self.failure: ActorFailure | None = None
        self._resources: list[_Resource] = []
        self._meshes: list[ServiceMesh] = []
        self._inflight: set[asyncio.Future[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._stop_signals = 0
        self._shutting_down = False
        self._signal_fds: tuple[int, int] | None = None

    # --- setup ----------------------------------------------------------------------------------

    def install(self) -> None:
        """Take over SIGINT/SIGTERM and Monarch's fault hook; call once, from the running loop."""
        self._loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self._failed: asyncio.Future[None] = self._loop.create_future()
        self._stop_requested: asyncio.Future[None] = self._loop.create_future()
        os.environ.setdefault(RUN_ID_ENV, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        _become_subreaper()
        _start_monarch_quietly()
        import monarch.actor

        monarch.actor.unhandled_fault_hook = self._fault_hook
        self._install_signals()

    def _install_signals(self) -> None:
        # Signals reach a watcher thread through the wakeup fd, so a second Ctrl-C forces an exit
        # even while the main thread is stuck in native code.
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._signal_fds = (read_fd, write_fd)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        threading.Thread(target=self._watch_signals, name="signals", daemon=True).start()

    def _watch_signals(self) -> None:
        assert self._signal_fds is not None
        read_fd = self._signal_fds[0]
        while data := os.read(read_fd, 64):
            for number in data:
                if number == signal.SIGINT and self._stop_signals:
                    self._force_exit()
                if number in (signal.SIGINT, signal.SIGTERM):
                    self._stop_signals += 1
                    name = signal.Signals(number).name
                    self._call_soon(self.request_stop, f"received {name}")
        os.close(read_fd)

    def _force_exit(self) -> None:
        _say(self.name, "forced exit: killing child processes")
        _kill_descendants(grace=0.0)
        sweep_shared_memory()
        os._exit(FORCED_EXIT_CODE)

    def _call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is over anyway
            self._loop.call_soon_threadsafe(callback, *args)

    # --- stop and failure -----------------------------------------------------------------------

    def request_stop(self, reason: str = "") -> None:
        """Ask the run to finish its in-flight work and end (what the first Ctrl-C does)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._stop_requested.set_result(None)
        _say(self.name, "stopping: finishing in-flight work (Ctrl-C again to force)")

    def fail(self, failure: ActorFailure) -> None:
        """Record a failure; the first one is the root cause the run reports."""
        if self.failure is None:
            self.failure = failure
            self._failed.set_result(None)

    def _fault_hook(self, failure: Any) -> None:
        # Monarch calls this on its own thread for failures no actor handled; returning (not
        # raising) keeps Monarch from exiting the process on its own.
        try:
            name, report = failure.mesh_name, failure.report()
        except Exception:  # noqa: BLE001 - a hook that raises makes Monarch exit the process
            name, report = "unknown", str(failure)
        self._call_soon(self._start_attribution, name, report)

    def _start_attribution(self, mesh_name: str, report: str) -> None:
        task = self._loop.create_task(self._attribute(mesh_name, report))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _attribute(self, mesh_name: str, report: str) -> None:
        mesh = await self._mesh_of(mesh_name)
        if mesh is None:
            # A proc's death first fails Monarch's internal logger mesh, then the service's own
            # meshes; wait briefly for a failure that names the service.
            if self._shutting_down:
                return
            await asyncio.sleep(self.failure_grace)
            service = mesh_name.rsplit("-", 1)[0]
        elif mesh.stopped:
            return
        else:
            service = mesh.service
        self.fail(ActorFailure(service, root_cause(report)))

    async def _mesh_of(self, mesh_name: str) -> ServiceMesh | None:
        for mesh in self._meshes:
            if mesh_name in await mesh.mesh_names():
                return mesh
        return None

    # --- resources and calls --------------------------------------------------------------------

    def register(
        self, name: str, stop: Callable[[], Awaitable[Any]], timeout: float = 30.0
    ) -> None:
        """Stop `stop()` at shutdown, after everything registered later, within `timeout` s."""
        self._resources.append(_Resource(name, stop, timeout))

    def watch(self, mesh: ServiceMesh) -> None:
        """Attribute Monarch failures of `mesh`'s actors to its service."""
        self._meshes.append(mesh)

    async def spawn_service(
        self,
        service: str,
        procs: int,
        gpus: Sequence[tuple[int, ...]] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        threads: int | None = None,
        host: Any = None,
        stop_timeout: float = 30.0,
    ) -> ServiceMesh:
        """`ServiceMesh.spawn`, watched for failures and stopped at shutdown."""
        spawn = ServiceMesh.spawn(service, procs, gpus, env=env, threads=threads, host=host)
        mesh = await self.call(service, spawn)
        self.watch(mesh)
        self.register(f"{service} procs", mesh.stop, stop_timeout)
        return mesh

    async def call(
        self,
        service: str,
        awaitable: Awaitable[T],
        *,
        timeout: float | None = None,
        interruptible: bool = False,
    ) -> T:
        """Await an endpoint call of `service`; any failure of the run ends it as ActorFailure.

        Raises the run's first ActorFailure if this call fails or anything else fails first,
        RunStopping if `interruptible` and a stop is requested first.
        """
        if self.failure is not None:
            raise self.failure
        task = asyncio.ensure_future(awaitable)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        waits: set[asyncio.Future[Any]] = {task, self._failed}
        if interruptible:
            waits.add(self._stop_requested)
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            try:
                return task.result()
            except ActorFailure as e:
                self.fail(e)
            except Exception as e:  # noqa: BLE001 - Monarch's ActorError/SupervisionError
                if not _is_monarch_error(e):
                    raise
                self.fail(ActorFailure(service, root_cause(e), e))
            assert self.failure is not None
            raise self.failure
        _abandon(task)
        if self.failure is not None:
            raise self.failure
        if interruptible and self.stopping.is_set():
            raise RunStopping()
        self.fail(ActorFailure(service, f"no answer within {timeout:g} s"))
        raise self.failure  # type: ignore[misc]

    # --- running and shutting down --------------------------------------------------------------

    async def run(self, main: Callable[[RunLifecycle], Awaitable[None]]) -> int:
        """Run `main(self)` to its end, a stop or a failure; shut down; return the exit code."""
        from recipes import UserError

        self.install()
        code = 0
        try:
            await self._supervise(main)
        except ActorFailure:
            code = 1
        except (RunStopping, asyncio.CancelledError):
            code = 0
        except UserError as e:
            _say(self.name, str(e))
            code = 2
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            await self.shutdown()
            self._uninstall_signals()
        if self.failure is not None:
            _say(self.name, str(self.failure))
            code = code or 1
        return code

    async def _supervise(self, main: Callable[[RunLifecycle], Awaitable[None]]) -> None:
        # main may await things other than `call`: racing it against failures ends the run on a
        # failure even then, and a stop request gives it `stop_grace` seconds to wind down.
        task = asyncio.ensure_future(main(self))
        first = {task, self._failed, self._stop_requested}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and self.failure is None:
            timeout = self.stop_grace
            await asyncio.wait({task, self._failed}, timeout=timeout, return_when="FIRST_COMPLETED")
            if not task.done() and self.failure is None:
                _say(
                    self.name, f"in-flight work did not finish within {timeout:g} s; cancelling it"
                )
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=self.drain_timeout)
        if self.failure is not None:
            raise self.failure
        if task.done() and not task.cancelled():
            task.result()

    async def shutdown(self) -> None:
        """Drain in-flight calls, stop resources newest first, end Monarch, clean up the host."""
        self._shutting_down = True
        if self._inflight:
            # After a failure the answers no longer matter, and some would never come.
            drain = 0.0 if self.failure is not None else self.drain_timeout
            await asyncio.wait(set(self._inflight), timeout=drain)
            for task in list(self._inflight):
                _abandon(task)
        for resource in reversed(self._resources):
            try:
                await asyncio.wait_for(resource.stop(), resource.timeout)
            except TimeoutError:
                _say(self.name, f"{resource.name}: did not stop within {resource.timeout:g} s")
            except Exception as e:  # noqa: BLE001 - one line per resource, the others still stop
                _say(self.name, f"{resource.name}: stop failed: {root_cause(e)}")
        self._resources.clear()
        await _stop_monarch()
        _kill_descendants(grace=2.0)
        sweep_shared_memory()

    def _uninstall_signals(self) -> None:
        if self._signal_fds is None:
            return
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(
                sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler
            )
        os.close(self._signal_fds[1])  # ends the watcher thread, which closes its end
        self._signal_fds = None


def run(main: Callable[[RunLifecycle], Awaitable[None]], **options: Any) -> int:
    """Run a controller coroutine under a RunLifecycle; returns the process exit code."""
    return asyncio.run(RunLifecycle(**options).run(main))


# --- helpers -------------------------------------------------------------------------------------


def _say(name: str, message: str) -> None:
    print(f"{name}: {message}", file=sys.stderr, flush=True)


def _is_monarch_error(error: BaseException) -> bool:
    from monarch.actor import ActorError

    return isinstance(error, ActorError) or type(error).__name__ == "SupervisionError"


def _abandon(task: asyncio.Future[Any]) -> None:
    # A call whose answer nobody awaits any more must not print "exception was never retrieved"
    # when its mesh stops under it.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    task.cancel()


def _become_subreaper() -> None:
    # Orphans of a dead proc (its resource tracker, workers) are reparented to us instead of init,
    # so the final sweep can find and end them.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _start_monarch_quietly() -> None:
    """Start Monarch's client with our defaults, keeping its one-line banner off stderr."""
    for key, value in _MONARCH_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import monarch.actor
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    reload_config_from_env()
    # The host agent prints where Monarch's own log file is, unconditionally, to fd 2.
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            monarch.actor.context()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        other = [
            line
            for line in captured.read().decode(errors="replace").splitlines(keepends=True)
            if not line.startswith("Monarch internal logs are being written to")
        ]
    sys.stderr.write("".join(other))


async def _stop_monarch() -> None:
    from monarch.actor import shutdown_context

    with contextlib.suppress(Exception):
        await asyncio.wait_for(_awaited(shutdown_context(host_timeout=2.0)), 5.0)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _kill_descendants(grace: float) -> int:
    """End every process below this one (SIGTERM, then SIGKILL after `grace` s); reap them."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace > 0 else (signal.SIGKILL,):
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        _, children = psutil.wait_procs(children, timeout=grace or 1.0)
        if not children:
            break
    return len(children)


# --- shared memory ------------------------------------------------------------------------------
# Python 3.11 registers every SharedMemory it creates *or attaches* with the process's resource
# tracker. When one proc unlinks a segment another proc attached to, the other's tracker unlinks
# it again at exit and prints "No such file or directory" and "leaked shared_memory objects".
# Segments made here are untracked instead, named after the run, and swept at shutdown.


def shm_prefix() -> str:
    """Name prefix of this run's shared-memory segments."""
    return f"forgesky_{os.environ.get(RUN_ID_ENV, os.getpid())}_"


def create_shared_memory(tag: str, size: int) -> shared_memory.SharedMemory:
    """A new segment named after the run, unknown to the resource tracker."""
    return _untracked(shared_memory.SharedMemory(shm_prefix() + tag, create=True, size=size))


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open a segment another proc created, without registering it for cleanup here."""
    return _untracked(shared_memory.SharedMemory(name))


def unlink_shared_memory(segment: shared_memory.SharedMemory) -> None:
    """Remove a segment made by these helpers (`segment.unlink()` would confuse the tracker)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_SHM_DIR / segment.name)


def sweep_shared_memory(prefix: str | None = None) -> int:
    """Unlink every segment left by this run; returns how many there were."""
    prefix = shm_prefix() if prefix is None else prefix
    removed = 0
    for path in _SHM_DIR.glob(prefix + "*") if _SHM_DIR.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def _untracked(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment
