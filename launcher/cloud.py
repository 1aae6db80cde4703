"""Thin wrappers over the SkyPilot 0.14 client SDK: launch, status, logs, down, cancel.

SDK calls return request ids; `sky.stream_and_get` follows a request's log to its result (for
calls that do work), `sky.get` waits for the result quietly (for queries). `--managed` switches
to the managed-jobs API (`sky.jobs.*`). The first SDK call on a machine starts SkyPilot's local
API server, which outlives the command: each wrapper says so before that wait.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import sky
from launcher.names import PROG
from recipes.errors import one_line
from sky import exceptions as sky_exceptions

# SkyPilot errors that are the state of the world, not a bug: one line, no traceback.
CLOUD_ERRORS: tuple[type[BaseException], ...] = (
    sky_exceptions.ClusterDoesNotExist,
    sky_exceptions.ClusterNotUpError,
    sky_exceptions.ClusterOwnerIdentityMismatchError,
    sky_exceptions.CloudUserIdentityError,
    sky_exceptions.NoCloudAccessError,
    sky_exceptions.ResourcesUnavailableError,
    sky_exceptions.InvalidClusterNameError,
    sky_exceptions.NotSupportedError,
    sky_exceptions.ApiServerConnectionError,
    sky_exceptions.RequestCancelled,
)

SERVER_STARTS = (
    f"{PROG}: starting SkyPilot's API server on this machine (half a minute or more, once); it "
    "keeps running in the background for the next commands: `sky api stop` stops it"
)
# Terminal escape sequences: CSI (colours, cursor), OSC (titles, links), character-set
# designations and the other two-byte ones.
_ESCAPES = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -/]+[0-~]|[@-Z\\-_])"
)


def local_server_to_start() -> bool:
    """Whether the next SDK call starts SkyPilot's local API server: SkyPilot's own test
    (sky.server.common.check_server_healthy_or_start_fn), an endpoint on this machine where no
    server answers. A remote endpoint (`sky api login`) is never started."""
    from sky.server import common as server_common
    from sky.utils import env_options

    endpoint = server_common.get_local_server_dial_url("127.0.0.1")
    if not server_common.is_api_server_local(endpoint):
        return False
    if env_options.Options.DISABLE_LOCAL_API_SERVER.get():
        return False  # SkyPilot refuses to start one, and says so
    status = server_common.get_api_server_status(endpoint).status
    return status is server_common.ApiServerStatus.UNHEALTHY


def say_if_server_starts(err: TextIO | None = None) -> None:
    """Before the first SDK call: a line on stderr when it is about to start the server."""
    if local_server_to_start():
        print(SERVER_STARTS, file=err or sys.stderr, flush=True)


def error_line(error: BaseException) -> str:
    """A SkyPilot error as one plain line: its first line with SkyPilot's colours removed."""
    lines = [line.strip() for line in _ESCAPES.sub("", str(error)).splitlines()]
    return one_line(next((line for line in lines if line), type(error).__name__))


def launch(task: sky.Task | sky.Dag, name: str, *, managed: bool, down: bool = False) -> str:
    """Submit `task`: a cluster named `name`, or a managed job of that name. Returns a summary."""
    say_if_server_starts()
    if managed:
        if isinstance(task, sky.Dag):  # a job group (launcher/task.py): named as built
            name = task.name or name
        job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=name))
        ids = ", ".join(str(i) for i in job_ids or [])
        return f"managed job {name} submitted (id {ids}); follow it: {PROG} logs --managed {name}"
    job_id, _ = sky.stream_and_get(sky.launch(task, cluster_name=name, down=down))
    return f"job {job_id} running on cluster {name}; follow it: {PROG} logs {name}"


def status(names: Sequence[str], *, managed: bool, out: TextIO | None = None) -> None:
    """Print a table of clusters (or managed jobs), those in `names` or all; none is a line
    saying so."""
    out = out or sys.stdout
    say_if_server_starts()
    if managed:
        records, empty = _managed_jobs()
        if names:
            records = [r for r in records if r.get("job_name") in names]
            empty = f"no managed job named {', '.join(names)}"
        rows = [
            (
                str(r.get("job_id", "")),
                str(r.get("job_name") or ""),
                _enum_name(r.get("status")),
                str(r.get("cluster_resources") or r.get("resources") or "-"),
                str(r.get("recovery_count") or 0),
                _duration(r.get("job_duration")),
            )
            for r in records
        ]
        header = ("ID", "NAME", "STATUS", "RESOURCES", "RECOVERIES", "DURATION")
    else:
        records = sky.get(sky.status(cluster_names=list(names) or None))
        rows = [
            (
                str(r.get("name")),
                _enum_name(r.get("status")),
                str(r.get("resources_str") or "-"),
                _age(r.get("launched_at")),
            )
            for r in records
        ]
        header = ("NAME", "STATUS", "RESOURCES", "LAUNCHED")
        empty = (
            f"no cluster named {', '.join(names)}"
            if names
            else f"no clusters; `{PROG} launch NAME` starts one"
        )
    print(format_table(header, rows) if rows else empty, file=out)


def _managed_jobs() -> tuple[list[dict[str, Any]], str]:
    """The managed jobs SkyPilot lists, and the line to print when there are none."""
    no_jobs = f"no managed jobs; `{PROG} launch NAME --managed` submits one"
    try:
        result = sky.get(sky.jobs.queue(refresh=False, skip_finished=False, version=2))
    except sky_exceptions.ClusterNotUpError as e:
        # SkyPilot's answer when its jobs controller was never launched (no status) or has
        # stopped, which it does once every job has ended: no job runs. Any other state of the
        # controller (starting, unreachable) is an error.
        state = getattr(e.cluster_status, "value", e.cluster_status)
        if state is None:
            return [], no_jobs
        if state == "STOPPED":
            return [], (
                "no managed job in progress (SkyPilot's jobs controller has stopped; "
                "`sky jobs queue --refresh` starts it again to list the jobs that ended)"
            )
        raise
    # version=2 answers (records, total, status counts, total before filtering).
    return list(result[0] if isinstance(result, tuple) else result), no_jobs


def logs(name: str, *, managed: bool, follow: bool = True, job_id: int | None = None) -> int:
    """Stream a job's log; returns SkyPilot's exit code for it (0 succeeded, 100 failed)."""
    say_if_server_starts()
    if managed:
        code = sky.jobs.tail_logs(name=None if job_id else name, job_id=job_id, follow=follow)
    else:
        code = sky.tail_logs(cluster_name=name, job_id=job_id, follow=follow)
    return int(code or 0)


def down(name: str) -> None:
    """Tear down cluster `name` (everything on its disks is lost; buckets stay)."""
    say_if_server_starts()
    sky.stream_and_get(sky.down(name))


def cancel(name: str, *, managed: bool, job_ids: Sequence[int] = ()) -> None:
    """Cancel a managed job by name, or jobs on cluster `name` (all of them unless ids given)."""
    say_if_server_starts()
    if managed:
        if job_ids:
            sky.stream_and_get(sky.jobs.cancel(job_ids=list(job_ids)))
        else:
            sky.stream_and_get(sky.jobs.cancel(name=name))
    else:
        request = sky.cancel(name, all=not job_ids, job_ids=list(job_ids) or None)
        sky.stream_and_get(request)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    table = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table
    )


def _enum_name(value: Any) -> str:
    return getattr(value, "value", None) or str(value or "-")


def _duration(seconds: Any) -> str:
    if not seconds:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _age(timestamp: Any) -> str:
    if not timestamp:
        return "-"
    return _duration(time.time() - float(timestamp)) + " ago"
