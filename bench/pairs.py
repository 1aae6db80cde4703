"""Alternating pairs of runs in one JSON: ours, the peer, ours, the peer, ... on one host.

`scripts/gpu/device_run.sh pairs` calls this around each run it makes; each run's result is a
section of one JSON named by its pair and side (`pair1_ours`, `pair1_peer`, `pair2_ours`, ...),
and each section gets a `run` record: pair, side, system, start and end (UTC), exit code, host,
boot id and commit.

    python bench/pairs.py next --json FILE [--pairs 3]        # prints "K SIDE", or "done"
    python bench/pairs.py stamp --json FILE --pair K --side ours|peer --system NAME \
        --started ISO --ended ISO --exit-code RC [--commit HASH]

`next` names the run the order calls for: the first slot, in the order ours 1, peer 1, ours 2,
..., that holds no completed run (a section with samples/s per GPU, or tokens/s per GPU for
SFT, and exit code 0). A run that
failed or was cut is therefore made again before anything after it. `stamp` refuses (one
line, exit 2) a run that is not the one `next` names, or one from another host than the runs
already in the file: the order and the host are enforced where the runs are made, and
`bench/speed_summary.py` checks them again from the records.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

SIDES = ("ours", "peer")


def section_name(pair: int, side: str) -> str:
    return f"pair{pair}_{side}"


# a run's figure: samples/s per GPU for GRPO, tokens/s per GPU for SFT
FIGURES = ("samples_per_s_per_gpu", "tokens_per_s_per_gpu")


def figure(section: dict[str, Any]) -> str:
    """The key of `section`'s figure: samples/s per GPU where it has one (a GRPO run's),
    else tokens/s per GPU (an SFT run's)."""
    return FIGURES[0] if FIGURES[0] in section else FIGURES[1]


def measured(section: dict[str, Any]) -> bool:
    return section.get(figure(section)) is not None


def completed(section: Any) -> bool:
    """A run that measured its steps and ended by itself."""
    return (
        isinstance(section, dict)
        and measured(section)
        and section.get("exit_code", 0) == 0
        and section.get("run", {}).get("exit_code", 0) == 0
    )


def next_run(result: dict[str, Any], pairs: int) -> tuple[int, str] | None:
    """(pair, side) of the run the order calls for, or None when `pairs` pairs are complete."""
    for pair in range(1, pairs + 1):
        for side in SIDES:
            if not completed(result.get(section_name(pair, side))):
                return pair, side
    return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def order(pair: int, side: str) -> int:
    return 2 * (pair - 1) + SIDES.index(side)


def stamp(result: dict[str, Any], pair: int, side: str, run: dict[str, Any]) -> dict[str, Any]:
    """Add `run` to the section of (pair, side), made if the run wrote none (it died first).
    Raises ValueError where a run before it in the order is not complete, a run after it is
    already in the file, or the file's runs are from another host."""
    name = section_name(pair, side)
    here = order(pair, side)
    for k, s in result.items():
        if not (k.startswith("pair") and isinstance(s, dict) and isinstance(s.get("run"), dict)):
            continue
        if order(s["run"]["pair"], s["run"]["side"]) > here:
            raise ValueError(f"{name} is out of order: {k} is already in the file")
    for before in range(here):
        slot = section_name(before // 2 + 1, SIDES[before % 2])
        if not completed(result.get(slot)):
            raise ValueError(f"{name} is out of order: {slot} has no completed run before it")
    hosts = {
        s["run"]["host"]
        for s in result.values()
        if isinstance(s, dict) and isinstance(s.get("run"), dict)
    }
    if hosts and run["host"] not in hosts:
        raise ValueError(
            f"{name} ran on {run['host']}, the file's other runs on {', '.join(sorted(hosts))}: "
            "pairs are on one host (start a new file)"
        )
    section = result.setdefault(name, {})
    section["run"] = {"pair": pair, "side": side, **run}
    if not measured(section):
        section.setdefault("exit_code", run["exit_code"] or 1)
    if not completed(section):
        # kept, as the section itself is replaced by the run made again
        result.setdefault("pairs_failed_runs", []).append({"section": name, **section["run"]})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("next", help="the run the order calls for")
    n.add_argument("--json", required=True)
    n.add_argument("--pairs", type=int, default=3)
    s = sub.add_parser("stamp", help="record a run's start, end, host and commit in its section")
    s.add_argument("--json", required=True)
    s.add_argument("--pair", type=int, required=True)
    s.add_argument("--side", choices=SIDES, required=True)
    s.add_argument("--system", required=True, help="forgesky, trl, trl-lora, verl, ...")
    s.add_argument("--started", required=True, help="UTC, ISO 8601")
    s.add_argument("--ended", required=True, help="UTC, ISO 8601")
    s.add_argument("--exit-code", type=int, required=True)
    s.add_argument("--commit", default=None)
    s.add_argument("--tag", default="")
    a = p.parse_args(argv)
    path = Path(a.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    if a.command == "next":
        if a.pairs < 1:
            print(f"pairs: --pairs must be at least 1, not {a.pairs}", file=sys.stderr)
            return 2
        slot = next_run(result, a.pairs)
        print("done" if slot is None else f"{slot[0]} {slot[1]}")
        return 0
    if a.pair < 1:
        print(f"pairs: --pair must be at least 1, not {a.pair}", file=sys.stderr)
        return 2
    run = {
        "system": a.system,
        "started": a.started,
        "ended": a.ended,
        "exit_code": a.exit_code,
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "commit": a.commit,
        "tag": a.tag,
    }
    try:
        stamp(result, a.pair, a.side, run)
    except ValueError as e:
        print(f"pairs: {e}", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"pairs: {section_name(a.pair, a.side)} stamped ({a.system}, exit {a.exit_code})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
