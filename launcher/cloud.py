"""Thin wrappers over the SkyPilot 0.14 client SDK: launch, status, logs, down, cancel.

SDK calls return request ids; `sky.stream_and_get` follows a request's log to its result (for
calls that do work), `sky.get` waits for the result quietly (for queries). `--managed` switches
to the managed-jobs API (`sky.jobs.*`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import sky
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


def launch(task: sky.Task, name: str, *, managed: bool, down: bool = False) -> str:
    """Submit `task`: a cluster named `name`, or a managed job of that name. Returns a summary."""
    if managed:
        job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=name))
        ids = ", ".join(str(i) for i in job_ids or [])
        return f"managed job {name} submitted (id {ids}); follow it: forgesky logs --managed {name}"
    job_id, _ = sky.stream_and_get(sky.launch(task, cluster_name=name, down=down))
    return f"job {job_id} running on cluster {name}; follow it: forgesky logs {name}"


def status(names: Sequence[str], *, managed: bool, out: TextIO | None = None) -> None:
    """Print a table of clusters (or managed jobs), those in `names` or all."""
    out = out or sys.stdout
    if managed:
        result = sky.get(sky.jobs.queue(refresh=False, skip_finished=False, version=2))
        # version=2 answers (records, total, status counts, total before filtering).
        records = result[0] if isinstance(result, tuple) else result
        if names:
            records = [r for r in records if r.get("job_name") in names]
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
        empty = "no managed jobs"
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
        empty = "no clusters"
    if not rows:
        print(empty + (f" named {', '.join(names)}" if names else ""), file=out)
        return
    print(format_table(header, rows), file=out)


def logs(name: str, *, managed: bool, follow: bool = True, job_id: int | None = None) -> int:
    """Stream a job's log; returns SkyPilot's exit code for it (0 succeeded, 100 failed)."""
    if managed:
        code = sky.jobs.tail_logs(name=None if job_id else name, job_id=job_id, follow=follow)
    else:
        code = sky.tail_logs(cluster_name=name, job_id=job_id, follow=follow)
    return int(code or 0)


def down(name: str) -> None:
    """Tear down cluster `name` (everything on its disks is lost; buckets stay)."""
    sky.stream_and_get(sky.down(name))


def cancel(name: str, *, managed: bool, job_ids: Sequence[int] = ()) -> None:
    """Cancel a managed job by name, or jobs on cluster `name` (all of them unless ids given)."""
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
