"""SIGINT and SIGTERM for a run: each asks it to stop; a second SIGINT forces the exit at once.

The signals reach a watcher thread through the wakeup fd, so a second Ctrl-C forces the exit
even while the main thread is stuck in native code.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While installed: `on_stop()` for every SIGINT or SIGTERM (on the watcher thread), and
    `on_force()` for a SIGINT after the first stop signal."""

    def __init__(self, on_stop: Callable[[], None], on_force: Callable[[], None]) -> None:
        self._on_stop = on_stop
        self._on_force = on_force
        self._received = 0
        self._fds: tuple[int, int] | None = None

    def install(self) -> None:
        """Take over SIGINT and SIGTERM; from the main thread."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._fds = (read_fd, write_fd)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda *_: None)
        threading.Thread(target=self._watch, args=(read_fd,), name="signals", daemon=True).start()

    def uninstall(self) -> None:
        """Give SIGINT and SIGTERM back to Python's defaults; from the main thread."""
        if self._fds is None:
            return
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(self._fds[1])  # ends the watcher thread, which closes its end
        self._fds = None

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            for number in data:
                if number == signal.SIGINT and self._received:
                    self._on_force()
                if number in STOP_SIGNALS:
                    self._received += 1
                    self._on_stop()
        os.close(read_fd)
