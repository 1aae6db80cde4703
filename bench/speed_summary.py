"""One row per speed comparison (ours against a peer), from the committed runs' JSON.

A comparison is a list of pairs of runs on one host, ours first, made back to back in the order
ours, peer, ours, peer, ... (`scripts/gpu/device_run.sh pairs` makes them so). Its row holds the
samples/s per GPU of each side in pair order (GRPO, `policy` "on" or "off"), or for SFT
(`policy` "sft", `pairs sft`) the tokens/s per GPU and MFU of each, each pair's ratio (ours /
peer) and their median, min and max. Fewer than three pairs stay in the summary, marked
`"median_of_3": false`.

The comparisons are listed in `bench/results/speed_comparisons.json`, each with `work`, `gpu`,
`gpus`, `policy` ("on"/"off", or "sft"), `peer`, `commit` and `pairs`: `[["FILE#OURS", "FILE#PEER"], ...]`
(paths under the specs' folder, bench/results/). A section stamped by `bench/pairs.py` (a `run` record) gives its
own start, end, host and commit; for an older section the spec names its log (`logs`:
`{"FILE#SECTION": "LOG"}`), whose first and last clock times (HH:MM:SS, on the JSON's date) say
when it ran, `host` names the machine and `commit_from` says where `commit` was read.

Refused, one line and exit 2, nothing written: a comparison whose runs are not in the order
ours, peer, ours, ... (by their start times; a run starting before the one before it ended),
whose runs span two hosts, whose file ran on another GPU than the row says, or a run that did
not complete.

    python bench/speed_summary.py             # writes bench/results/speed_summary.json
    python bench/speed_summary.py --markdown  # the rows as the table of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SPECS = RESULTS / "speed_comparisons.json"
OUT = RESULTS / "speed_summary.json"
CLOCK = re.compile(r"\b(\d{2}):(\d{2}):(\d{2})\b")
FIELDS = ("work", "gpu", "gpus", "policy", "peer", "pairs")
POLICIES = ("on", "off", "sft")


def figure(spec: dict[str, Any]) -> str:
    """What a comparison's runs are compared by: SFT's tokens/s per GPU, GRPO's samples/s."""
    return "tokens_per_s_per_gpu" if spec.get("policy") == "sft" else "samples_per_s_per_gpu"


class Refused(Exception):
    pass


def label(spec: dict[str, Any]) -> str:
    return (
        f"{spec.get('work')}, {spec.get('gpus')} {spec.get('gpu')}, "
        f"{spec.get('policy')}-policy against {spec.get('peer')}"
    )


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def log_times(log: Path, date: str) -> tuple[dt.datetime, dt.datetime]:
    """The first and last clock time a log shows, on `date` (a later day past midnight)."""
    clocks = [m.groups() for line in log.read_text().splitlines() for m in CLOCK.finditer(line)]
    if not clocks:
        raise Refused(f"{log.name} shows no clock time: when it ran is unknown")
    day = dt.datetime.fromisoformat(date).replace(tzinfo=dt.UTC)
    times, last = [], None
    for h, m, s in clocks:
        t = day.replace(hour=int(h), minute=int(m), second=int(s))
        while last is not None and t < last - dt.timedelta(hours=12):
            t += dt.timedelta(days=1)  # past midnight
        times.append(t)
        last = t
    return times[0], max(times)


def load_run(
    spec: dict[str, Any], source: str, files: dict[Path, dict[str, Any]], root: Path
) -> dict[str, Any]:
    name, _, section = source.partition("#")
    path = root / name
    if path not in files:
        if not path.exists():
            raise Refused(f"{name} is not under {root}")
        files[path] = json.loads(path.read_text())
        device = files[path].get("device", {}).get("name", "")
        if spec["gpu"] not in device:
            raise Refused(f"{name} ran on {device or 'an unnamed device'}, not {spec['gpu']}")
    data = files[path].get(section)
    if not isinstance(data, dict):
        raise Refused(f"{source} is not a section of its file")
    stamp = data.get("run")
    key = figure(spec)
    if (
        data.get(key) is None
        or data.get("exit_code", 0) != 0
        or (stamp and stamp.get("exit_code", 0) != 0)
    ):
        raise Refused(f"{source} is not a completed run")
    run: dict[str, Any] = {"source": source, key: data[key], "mfu": data.get("mfu")}
    if stamp:
        run.update(
            started=parse_time(stamp["started"]),
            ended=parse_time(stamp["ended"]),
            host=(stamp["host"], stamp.get("boot_id")),
            side=stamp["side"],
            pair=stamp["pair"],
            commit=stamp.get("commit"),
            times_from="stamps",
        )
        return run
    log = spec.get("logs", {}).get(source)
    if not log:
        raise Refused(f"{source} has no run record and the spec names no log for it")
    date = data.get("date") or files[path].get("date")
    if not date:
        raise Refused(f"{source}: its file has no date")
    run["started"], run["ended"] = log_times(root / log, date)
    run.update(host=(spec.get("host"), None), commit=spec.get("commit"), times_from="logs")
    return run


def row(spec: dict[str, Any], files: dict[Path, dict[str, Any]], root: Path) -> dict[str, Any]:
    missing = [k for k in FIELDS if k not in spec]
    if missing:
        raise Refused(f"the spec lacks {', '.join(missing)}")
    if spec["policy"] not in POLICIES:
        raise Refused(f"policy is on or off (GRPO) or sft, not {spec['policy']!r}")
    if not spec["pairs"] or any(len(p) != 2 for p in spec["pairs"]):
        raise Refused("pairs are [OURS, PEER] sources, at least one")
    runs = []
    for k, pair in enumerate(spec["pairs"], 1):
        for side, source in zip(("ours", "peer"), pair, strict=True):
            run = load_run(spec, source, files, root)
            if run["times_from"] == "stamps" and (run["side"], run["pair"]) != (side, k):
                raise Refused(
                    f"{source} was made as pair {run['pair']} {run['side']}, listed as pair "
                    f"{k} {side}"
                )
            run["side"] = side
            runs.append(run)
    for before, after in zip(runs, runs[1:], strict=False):
        if not before["ended"] <= after["started"]:
            raise Refused(
                f"not in alternating order: {after['source']} started "
                f"{after['started']:%Y-%m-%d %H:%M:%S} before {before['source']} ended "
                f"({before['ended']:%H:%M:%S})"
            )
    hosts = {r["host"] for r in runs}
    if len(hosts) > 1 or None in {h for h, _ in hosts}:
        names = ", ".join(sorted(f"{h} (boot {b})" if b else str(h) for h, b in hosts))
        raise Refused(f"the runs span {len(hosts)} hosts or name none: {names}")
    commits = {r["commit"] for r in runs} - {None}
    if len(commits) > 1:
        raise Refused(f"the runs ran {len(commits)} commits: {', '.join(sorted(commits))}")
    key = figure(spec)
    ours = [round(r[key], 2) for r in runs if r["side"] == "ours"]
    peer = [round(r[key], 2) for r in runs if r["side"] == "peer"]
    ratios = [round(r1[key] / r2[key], 4) for r1, r2 in zip(runs[::2], runs[1::2], strict=True)]
    out = {k: spec[k] for k in ("work", "gpu", "gpus", "policy", "peer")}
    out.update({"pairs": len(ratios), "median_of_3": len(ratios) >= 3, f"ours_{key}": ours})
    out[f"peer_{key}"] = peer
    if spec["policy"] == "sft":
        for side in ("ours", "peer"):
            mfus = [r["mfu"] for r in runs if r["side"] == side]
            out[f"{side}_mfu"] = [None if m is None else round(m, 3) for m in mfus]
    out.update(
        ratios=ratios,
        ratio_median=round(statistics.median(ratios), 4),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        host=runs[0]["host"][0],
        date=f"{runs[0]['started']:%Y-%m-%d}",
        commit=next(iter(commits), None),
        commit_from="the runs' records"
        if all(r["times_from"] == "stamps" and r["commit"] for r in runs)
        else spec.get("commit_from", "the spec"),
        times_from=runs[0]["times_from"] if len({r["times_from"] for r in runs}) == 1 else "both",
        runs=[
            {
                "side": r["side"],
                "source": r["source"],
                "started": f"{r['started']:%Y-%m-%dT%H:%M:%SZ}",
                "ended": f"{r['ended']:%Y-%m-%dT%H:%M:%SZ}",
            }
            for r in runs
        ],
    )
    if spec.get("note"):
        out["note"] = spec["note"]
    return out


def summarize(specs: list[dict[str, Any]], root: Path = RESULTS) -> dict[str, Any]:
    """The rows of `specs`, whose paths are under `root`; Refused names the comparison."""
    files: dict[Path, dict[str, Any]] = {}
    rows = []
    for spec in specs:
        try:
            rows.append(row(spec, files, root))
        except Refused as e:
            raise Refused(f"{label(spec)}: {e}") from None
    return {
        "made_by": "bench/speed_summary.py from bench/results/speed_comparisons.json",
        "rows": rows,
    }


def markdown(summary: dict[str, Any]) -> str:
    """The GRPO rows' table, then the SFT rows' (where there are any)."""
    grpo = [r for r in summary["rows"] if r["policy"] != "sft"]
    sft = [r for r in summary["rows"] if r["policy"] == "sft"]
    lines = [
        "| work | GPUs | policy | peer | pairs | ours samples/s/GPU | peer samples/s/GPU "
        "| ratio median (min-max) | host, date, commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_line(r, "samples_per_s_per_gpu") for r in grpo]
    if sft:
        lines += [
            "",
            "| work | GPUs | peer | pairs | ours tokens/s/GPU (MFU) | peer tokens/s/GPU (MFU) "
            "| ratio median (min-max) | host, date, commit |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_line(r, "tokens_per_s_per_gpu") for r in sft]
    return "\n".join(lines) + "\n"


def _line(r: dict[str, Any], key: str) -> str:
    spread = f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
    if not r["median_of_3"]:
        pairs = f"{r['pairs']} pair{'s' if r['pairs'] > 1 else ''}"
        spread = f"{r['ratio_median']:.2f}x ({pairs}: not a median of 3)"
    commit = r["commit"] or "not recorded"
    if r["commit"] and r["commit_from"] != "the runs' records":
        commit += " (not in the runs' records)"

    def figures(side: str) -> str:
        values = [
            f"{x:,.0f}" if key.startswith("tokens") else f"{x:.2f}" for x in r[f"{side}_{key}"]
        ]
        if f"{side}_mfu" in r:
            values = [
                v if m is None else f"{v} ({m:.2f})"
                for v, m in zip(values, r[f"{side}_mfu"], strict=True)
            ]
        return ", ".join(values)

    policy = "" if r["policy"] == "sft" else f" {r['policy']} |"
    return (
        f"| {r['work']} | {r['gpus']} {r['gpu']} |{policy} {r['peer']} | {r['pairs']} | "
        f"{figures('ours')} | {figures('peer')} | {spread} | {r['host']}, {r['date']}, {commit} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specs", default=str(SPECS))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--markdown", action="store_true", help="print the table, write nothing")
    a = p.parse_args(argv)
    try:
        specs = json.loads(Path(a.specs).read_text())
        if not (isinstance(specs, list) and all(isinstance(x, dict) for x in specs)):
            raise ValueError("a list of comparisons (JSON objects) is expected")
        summary = summarize(specs, Path(a.specs).resolve().parent)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"speed_summary: {a.specs}: {e}", file=sys.stderr)
        return 2
    except Refused as e:
        print(f"speed_summary: refused: {e}", file=sys.stderr)
        return 2
    if a.markdown:
        print(markdown(summary), end="")
        return 0
    Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    for r in summary["rows"]:
        print(
            f"{r['work']}, {r['gpus']} {r['gpu']}, {r['policy']}-policy vs {r['peer']}: "
            f"{r['ratio_median']}x over {r['pairs']} pair(s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
