"""SkyPilot's API server replaced at the calls that would reach it, for the launcher's tests.

The SDK functions that send a request (sky.launch, sky.status, sky.jobs.queue, ...) record it
and return a request id; the waits (sky.get, sky.stream_and_get) return the result given for
that id, or raise it when it is an exception, as the client raises what the server sent.
The health check of the local API server says it is running; with `server_up=False` it finds
nothing there (the one HTTP request it makes answers as a refused connection), SkyPilot's own
check around each call (sky.server.common.check_server_healthy_or_start) runs, and only the
start of the server process is replaced: it writes STARTING to stderr and is recorded.
"""

from __future__ import annotations

import sys

from sky.server import common as server_common
from sky.server.requests.serializers import decoders, encoders

import sky

STARTING = "<the API server process starts here>"


class FakeSky:
    """Records the SDK calls a command makes; each returns a request id, waits return results."""

    def __init__(self, monkeypatch, results=None, *, server_up: bool = True):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.results = results or {}
        self.server_up = server_up
        for name in ("launch", "status", "down", "cancel", "tail_logs"):
            monkeypatch.setattr(sky, name, self._record(f"sky.{name}"))
        for name in ("launch", "queue", "cancel", "tail_logs"):
            monkeypatch.setattr(sky.jobs, name, self._record(f"sky.jobs.{name}"))
        monkeypatch.setattr(sky, "stream_and_get", self._wait("stream_and_get"))
        monkeypatch.setattr(sky, "get", self._wait("get"))
        if server_up:
            healthy = server_common.ApiServerInfo(status=server_common.ApiServerStatus.HEALTHY)
            monkeypatch.setattr(server_common, "get_api_server_status", lambda *a, **k: healthy)
        else:
            monkeypatch.setattr(server_common, "get_api_server_status_response", _refused)
            monkeypatch.setattr(server_common, "_start_api_server", self._start)

    def _record(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            result = self.results.get(name, f"request-{name}")
            if isinstance(result, BaseException):
                raise result
            return result

        if self.server_up:
            return call
        return server_common.check_server_healthy_or_start(call)

    def _wait(self, name):
        def wait(request_id, *args, **kwargs):
            self.calls.append((name, (request_id,), kwargs))
            result = self.results[request_id]
            if isinstance(result, BaseException):
                raise result
            return result

        return wait

    def _start(self, *args, **kwargs) -> None:
        print(STARTING, file=sys.stderr, flush=True)
        self.calls.append(("start the API server", args, kwargs))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def task(self) -> sky.Task:
        launched = [c for c in self.calls if c[0] in ("sky.launch", "sky.jobs.launch")]
        assert len(launched) == 1
        return launched[0][1][0]


def _refused(*args) -> None:
    """GET /api/health where nothing listens: SkyPilot makes None of the refused connection."""


_refused.cache_clear = lambda: None  # SkyPilot empties its cache of answers before asking again


def from_server(error: BaseException) -> BaseException:
    """`error` as the client gets it back from the API server: serialized and encoded with the
    request there, decoded and rebuilt here (sky.server.requests.requests.Request)."""
    sent = encoders.pickle_and_encode(sky.exceptions.serialize_exception(error))
    return sky.exceptions.deserialize_exception(decoders.decode_and_unpickle(sent))
