"""Episodes hosted in worker processes beside the generator, many a node, on CPU.

Each worker is a process (forked from a forkserver) holding the environments of the episodes pinned to it (host.py)
and answering their calls each in a thread of its own, so that a slow tool holds only its own
episode. Here, every call waits at most the recipe's per-call time (less where the episode's
own time ends sooner):

- a tool that raises is an error observation ("raised"), from the worker;
- a call past its time ("timeout") kills its worker: the call's episode and every other episode
  on that worker are dropped (their next step ends them, close gives None), and a fresh worker
  takes its place;
- a worker that dies by itself (a segfault, os._exit, the OOM killer) drops its episodes
  ("crashed") and is replaced the same way;
- a worker that cannot start is tried again; where every worker has failed to start
  `max_failed_starts` times in a row, the run ends with EnvironmentsLost, one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from runtime.environments.host import Spec, serve
from runtime.environments.hosted import Hosted, Lost
from runtime.procs.failures import ActorFailure


class EnvironmentsLost(ActorFailure):
    """Every environment worker is gone and none could be started again; the run ends."""

    def __init__(self, cause: str) -> None:
        super().__init__("environment", cause)


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: Any = None
        self.conn: Connection | None = None
        self.generation = 0
        self.ready = False
        self.given_up = False
        self.failed_starts = 0
        self.pending: dict[int, asyncio.Future] = {}
        self.episodes: set[str] = set()
        # requests not yet written: sent together once the loop has run what queued them
        self.outbox: list[tuple[int, str, tuple]] = []


class Workers(Hosted):
    """The Environments protocol (api.py) over `count` worker processes."""

    def __init__(
        self,
        spec: Spec,
        count: int,
        *,
        call_timeout_s: float = 30.0,
        episode_timeout_s: float = 300.0,
        start_timeout_s: float = 120.0,
        max_failed_starts: int = 3,
    ) -> None:
        super().__init__(call_timeout_s, episode_timeout_s)
        if count < 1:
            raise ValueError(f"environment workers: at least 1, got {count}")
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.max_failed_starts = max_failed_starts
        self.workers = [_Worker(i) for i in range(count)]
        self.fatal: EnvironmentsLost | None = None
        self.last_failure = ""
        self._where: dict[str, _Worker] = {}
        self._reqs = itertools.count(1)
        # Workers fork from a forkserver that imported OpenEnv (and its gradio, seconds of CPU)
        # and the environment's module once: a worker replaced mid-run starts in milliseconds.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(
            ["runtime.environments.host", "openenv.core.env_server", spec.target.partition(":")[0]]
            # not this module: it imports Monarch, which a process that forks must not hold
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._starting: set[asyncio.Task] = set()

    # -- starting and losing workers -----------------------------------------------------------

    async def start(self) -> None:
        """Start every worker; EnvironmentsLost where none can start."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._start(w) for w in self.workers))
        self._raise_if_lost()

    async def _start(self, w: _Worker) -> None:
        while not w.given_up and not self._stopping:
            why = await self._spawn(w)
            if why is None:
                w.failed_starts = 0
                return
            w.failed_starts += 1
            self.last_failure = why
            if w.failed_starts >= self.max_failed_starts:
                w.given_up = True
        if all(x.given_up for x in self.workers) and self.fatal is None:
            n = len(self.workers)
            self.fatal = EnvironmentsLost(
                f"every environment worker is lost ({n} of {n}, each failed to start "
                f"{self.max_failed_starts} times in a row); the last: {self.last_failure}"
            )

    async def _spawn(self, w: _Worker) -> str | None:
        """One start of worker `w`: None once it is ready, else why it is not."""
        assert self._loop is not None
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=serve, args=(child, self.spec), name=f"forgesky-env-{w.index}", daemon=True
        )
        proc.start()
        child.close()
        w.generation += 1
        w.proc, w.conn, w.ready = proc, parent, False
        ready = self._loop.create_future()
        w.pending = {0: ready}
        threading.Thread(
            target=self._read, args=(w, w.generation, parent), daemon=True, name="forgesky-env-read"
        ).start()
        try:
            ok, value = await asyncio.wait_for(ready, self.start_timeout_s)
        except TimeoutError:
            ok, value = False, f"it did not start within {self.start_timeout_s:g} s"
        except Lost:
            proc.join(timeout=5)
            ok, value = False, f"it exited while starting (exit code {proc.exitcode})"
        if not ok:
            self._kill(w)
            return str(value)
        w.ready = True
        return None

    async def ready(self) -> None:
        """Wait until every worker that is not given up is ready (after restarts)."""
        while not all(w.ready or w.given_up for w in self.workers):
            self._raise_if_lost()
            await asyncio.sleep(0.05)
        self._raise_if_lost()

    def _read(self, w: _Worker, generation: int, conn: Connection) -> None:
        """A thread per worker: its answers to the loop, then its end."""
        loop = self._loop
        assert loop is not None
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # answers that cannot be unpickled: their calls time out
                continue
            try:
                loop.call_soon_threadsafe(self._answer, w, generation, batch)
            except RuntimeError:
                return  # the loop is closed
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._gone, w, generation)

    def _answer(self, w: _Worker, generation: int, batch: list[tuple[int, bool, Any]]) -> None:
        if generation != w.generation:
            return
        for req, ok, value in batch:
            future = w.pending.pop(req, None)
            if future is not None and not future.done():
                future.set_result((ok, value))

    def _post(self, w: _Worker, req: int, op: str, args: tuple) -> None:
        """Queue a request to `w`; what is queued goes in one write once the loop has run the
        callbacks ready now (every episode of a round queues its call first)."""
        assert self._loop is not None
        if not w.outbox:
            self._loop.call_soon(self._flush, w, w.generation)
        w.outbox.append((req, op, args))

    def _flush(self, w: _Worker, generation: int) -> None:
        if generation != w.generation or w.conn is None:
            return  # the worker went meanwhile: its requests failed with it
        batch, w.outbox = w.outbox, []
        if not batch:
            return
        try:
            w.conn.send(batch)
        except (OSError, ValueError):
            self._kill(w)  # its requests fail as the worker's loss

    def _gone(self, w: _Worker, generation: int) -> None:
        """Worker `w` ended (it crashed, or was killed): its episodes are dropped, it restarts."""
        if generation != w.generation:
            return
        w.generation += 1  # anything the old process still sends is ignored
        was_ready, w.ready = w.ready, False
        for future in w.pending.values():
            if not future.done():
                future.set_exception(Lost("crashed"))
        w.pending, w.outbox = {}, []
        episodes, w.episodes = w.episodes, set()
        for episode in episodes:
            self._drop(episode, "crashed")
            self._where.pop(episode, None)
        if w.proc is not None and w.proc.is_alive():
            w.proc.kill()
        if w.conn is not None:
            w.conn.close()
        if was_ready and not self._stopping:
            self._counts["workers_lost"] += 1
            task = asyncio.ensure_future(self._start(w))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    def _kill(self, w: _Worker) -> None:
        self._gone(w, w.generation)

    def _raise_if_lost(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    # -- requests ------------------------------------------------------------------------------

    async def _pick(self) -> _Worker:
        """The ready worker with the fewest episodes, waiting while workers restart."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._raise_if_lost()
            ready = [w for w in self.workers if w.ready]
            if ready:
                return min(ready, key=lambda w: len(w.episodes))
            if time.monotonic() > deadline:
                raise Lost("crashed", "no environment worker became ready in time")
            await asyncio.sleep(0.05)

    async def _request(self, w: _Worker, episode: str, op: str, args: tuple, timeout: float) -> Any:
        """Send one request to `w` and wait for its answer; Lost where the worker goes away or
        the call runs past `timeout` (which kills the worker when it is the full call time)."""
        assert self._loop is not None and w.conn is not None
        req = next(self._reqs)
        future = self._loop.create_future()
        w.pending[req] = future
        self._post(w, req, op, args)
        try:
            ok, value = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            w.pending.pop(req, None)
            text = f"the call ran past {timeout:g} s and was stopped"
            self._drop(episode, "timeout")
            w.episodes.discard(episode)
            self._where.pop(episode, None)
            if timeout >= self.call_timeout_s:
                self._kill(w)  # a hung tool: the worker goes, with its other episodes
            else:
                self._send_drop(w, episode)  # the episode's own time ended during the call
            raise Lost("timeout", text) from None
        if not ok:
            raise _Refused(str(value))
        return value

    def _send_drop(self, w: _Worker, episode: str) -> None:
        if w.conn is not None and w.ready:
            self._post(w, -1, "drop", (episode,))

    async def _open(self, episode: str, row: dict[str, Any], seed: int, timeout: float) -> dict:
        w = await self._pick()
        w.episodes.add(episode)
        self._where[episode] = w
        try:
            return await self._request(w, episode, "open", (episode, row, seed), timeout)
        except _Refused as e:
            raise Lost("crashed", f"opening the episode raised {e}") from None

    async def _call(self, episode: str, name: str, arguments: Any, timeout: float) -> dict:
        self._raise_if_lost()
        w = self._where.get(episode)
        if w is None or not w.ready:
            raise Lost("crashed")
        try:
            return await self._request(w, episode, "step", (episode, name, arguments), timeout)
        except _Refused as e:
            return {"text": f"error: {e}", "error": "raised", "seconds": 0.0}

    async def _close_episode(self, episode: str, answer: str, timeout: float) -> float:
        self._raise_if_lost()
        w = self._where.get(episode)
        if w is None or not w.ready:
            raise Lost("crashed")
        try:
            return await self._request(w, episode, "close", (episode, answer), timeout)
        except _Refused as e:
            raise Lost("crashed", str(e)) from None
        finally:
            w.episodes.discard(episode)
            self._where.pop(episode, None)

    def _forget(self, episode: str) -> None:
        w = self._where.pop(episode, None)
        if w is not None:
            w.episodes.discard(episode)
            self._send_drop(w, episode)

    async def step(self, episode: str, call: Any) -> Any:
        self._raise_if_lost()
        return await super().step(episode, call)

    async def close(self, episode: str, answer: str) -> float | None:
        self._raise_if_lost()
        return await super().close(episode, answer)

    async def shutdown(self) -> None:
        """Stop every worker (a run's end)."""
        self._stopping = True
        for task in list(self._starting):
            task.cancel()
        for w in self.workers:
            if w.conn is not None and w.ready:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send([(-1, "stop", ())])
        deadline = time.monotonic() + 5.0  # for all of them: a worker's own exit is at once
        for w in self.workers:
            if w.proc is not None:
                await asyncio.to_thread(w.proc.join, max(0.0, deadline - time.monotonic()))
                if w.proc.is_alive():
                    w.proc.kill()
            self._kill(w)

    @property
    def pids(self) -> list[int | None]:
        """The worker processes' ids, in worker order (None for one not running)."""
        return [w.proc.pid if w.proc is not None and w.ready else None for w in self.workers]


class _Refused(Exception):
    """The worker answered a request with an exception of the host's."""
