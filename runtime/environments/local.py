"""Episodes hosted in this process (CPU tests, tiny runs): the same conversion as the workers
(host.py), each call in a thread of its own so that a slow tool holds only its episode.

What only a process of its own can give is missing here: a tool that hangs is answered with a
timeout and its episode dropped, but its thread runs on; one that crashes the process ends the
run. Runs that need either use the workers (workers.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime.environments.host import Host, Spec
from runtime.environments.hosted import Hosted, Lost


class LocalEnvironments(Hosted):
    """The Environments protocol (api.py) over environments in this process."""

    def __init__(
        self, spec: Spec, *, call_timeout_s: float = 30.0, episode_timeout_s: float = 300.0
    ) -> None:
        super().__init__(call_timeout_s, episode_timeout_s)
        self.host = Host(spec)
        self.tools = self.host.probe()  # a class or tool schema that cannot work fails here
        self._threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="forgesky-env")

    async def _run(self, timeout: float, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._threads, fn, *args), timeout)
        except TimeoutError:
            raise Lost("timeout", f"the call ran past {timeout:g} s and was stopped") from None

    async def _open(self, episode: str, row: dict[str, Any], seed: int, timeout: float) -> dict:
        try:
            return await self._run(timeout, self.host.open, episode, row, seed)
        except Lost:
            raise
        except Exception as e:
            raise Lost("crashed", f"opening the episode raised {type(e).__name__}: {e}") from None

    async def _call(self, episode: str, name: str, arguments: Any, timeout: float) -> dict:
        return await self._run(timeout, self.host.step, episode, name, arguments)

    async def _close_episode(self, episode: str, answer: str, timeout: float) -> float:
        try:
            return await self._run(timeout, self.host.close, episode, answer)
        except Lost:
            raise
        except Exception as e:
            raise Lost("crashed", f"closing the episode raised {type(e).__name__}: {e}") from None

    def _forget(self, episode: str) -> None:
        self.host.drop(episode)

    async def shutdown(self) -> None:
        self.host.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)
