"""The MCP sessions of a host's episodes, held open from an episode's open to its close.

An OpenEnv `MCPEnvironment`'s synchronous `step` runs each call in an event loop of its own
(`asyncio.run`) and opens its in-memory MCP client session for that call alone: about half of
a small call's CPU, paid under the worker's GIL by every episode it hosts. OpenEnv's own server
instead keeps the environment's `mcp_session()` open for a session's life and awaits
`step_async` on its event loop; an environment whose `step_async` is its own (not
`Environment`'s, which calls `step`) is hosted that way here: one event loop a host, in a thread
of its own started at first use (after a worker's fork), and one task an episode that holds its
session. Synchronous tools still run concurrently (FastMCP runs them in threads; the loop's
thread limit is raised to the host's).

A class that overrides `step` below the class that gave it `step_async` keeps its `step` (its
override would be skipped otherwise): `awaitable(cls)` says which path a class takes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

# Threads a loop may run synchronous tools in (the host's thread pool has as many).
TOOL_THREADS = 64
# Seconds a closing episode waits for its session to end before it is left to end on its own.
CLOSE_WAIT_S = 10.0


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def awaitable(cls: type) -> bool:
    """Whether episodes of `cls` step through its own `step_async` on the host's loop."""
    from openenv.core.env_server.interfaces import Environment

    by_async, by_step = _owner(cls, "step_async"), _owner(cls, "step")
    if by_async is None or by_async is Environment:
        return False
    return by_step is None or issubclass(by_async, by_step)


class Loop:
    """An event loop in a daemon thread, started by the first `run`."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_run_until_stopped, args=(loop,), daemon=True, name="forgesky-env-loop"
                )
                self._thread.start()
                asyncio.run_coroutine_threadsafe(_raise_thread_limit(), loop).result()
                self._loop = loop
                # sessions still held when the process ends close first (no noise at exit)
                atexit.register(self.stop, CLOSE_WAIT_S / 5)
            return self._loop

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """`coro`'s result, run on the loop (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._started()).result(timeout)

    def soon(self, fn: Any, *args: Any) -> None:
        """Call `fn(*args)` on the loop, without waiting (nothing if it never started)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn, *args)

    def stop(self, wait_s: float = 0.0) -> None:
        """Cancel what runs on the loop (a caller waiting on it gets CancelledError), then end
        its thread, waiting for that at most `wait_s`."""
        with self._lock:
            loop, self._loop = self._loop, None
            thread, self._thread = self._thread, None
        if loop is None:
            return
        atexit.unregister(self.stop)
        asyncio.run_coroutine_threadsafe(_cancel_all_then_stop(), loop)
        if thread is not None and wait_s > 0:
            thread.join(wait_s)


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _cancel_all_then_stop() -> None:
    here = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not here]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
    asyncio.get_running_loop().stop()


async def _raise_thread_limit() -> None:
    import anyio.to_thread

    anyio.to_thread.current_default_thread_limiter().total_tokens = TOOL_THREADS


class Session:
    """An environment's `mcp_session()` held open by a task of the loop (where the environment
    has one), so that each call skips opening it."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(cls, env: Any) -> Session:
        session = cls()
        opened = asyncio.get_running_loop().create_future()
        session._task = asyncio.ensure_future(session._hold(env, opened))
        await opened
        return session

    async def _hold(self, env: Any, opened: asyncio.Future) -> None:
        factory = getattr(env, "mcp_session", None)
        held = factory() if callable(factory) else contextlib.nullcontext()
        try:
            async with held:
                opened.set_result(None)
                await self._ended.wait()
        except BaseException as e:
            if not opened.done():
                opened.set_exception(e)
                return
            raise

    def end_soon(self) -> None:
        """Let the session end (from the loop's thread)."""
        self._ended.set()

    async def close(self) -> None:
        """End the session and wait for it (at most CLOSE_WAIT_S)."""
        self._ended.set()
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_WAIT_S)
