"""`forgesky status`, `logs`, `down` and `cancel`: a launched cluster or managed job, through
SkyPilot's API server (launcher.cloud). SkyPilot is imported when one of them runs."""

from __future__ import annotations

import argparse
from typing import Any

from launcher.arguments import add_command, add_managed, confirm


def add_commands(sub: Any) -> None:
    """The four subcommands, with their arguments."""
    p = add_command(sub, "status", "clusters (or managed jobs with --managed)", _status)
    p.add_argument("names", nargs="*", metavar="NAME", help="cluster or job names (default: all)")
    add_managed(p)

    p = add_command(sub, "logs", "stream the log of a run", _logs)
    p.add_argument("name", metavar="CLUSTER", help="cluster name (job name with --managed)")
    add_managed(p)
    p.add_argument("--job-id", type=int, help="a job id (default: the latest job)")
    p.add_argument("--no-follow", action="store_true", help="print the log so far and exit")

    p = add_command(sub, "down", "tear down a cluster", _down)
    p.add_argument("name", metavar="CLUSTER")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = add_command(sub, "cancel", "cancel the jobs on a cluster, or a managed job", _cancel)
    p.add_argument("name", metavar="CLUSTER", help="cluster name (job name with --managed)")
    add_managed(p)
    p.add_argument(
        "--job-id",
        type=int,
        action="append",
        default=[],
        help="cancel only this job (repeatable; default: all jobs of CLUSTER)",
    )


def _status(args: argparse.Namespace) -> int:
    from launcher import cloud

    cloud.status(args.names, managed=args.managed)
    return 0


def _logs(args: argparse.Namespace) -> int:
    from launcher import cloud

    return cloud.logs(
        args.name, managed=args.managed, follow=not args.no_follow, job_id=args.job_id
    )


def _down(args: argparse.Namespace) -> int:
    if not args.yes:
        confirm(
            f"Tear down cluster {args.name} (its disks are lost)?",
            f"not tearing down {args.name}",
        )
    from launcher import cloud

    cloud.down(args.name)
    print(f"cluster {args.name} is down")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from launcher import cloud

    cloud.cancel(args.name, managed=args.managed, job_ids=args.job_id)
    what = f"managed job {args.name}" if args.managed else f"jobs on {args.name}"
    print(f"cancelled {what}")
    return 0
