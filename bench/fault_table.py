"""The reliability table from the logs of tests/test_gpu_faults.py (`device_run.sh faults`).

Each test prints the run's output, then `fault-exit NAME S s`; the line a run ended with is the
last `forgesky: ... failed` (or `error:`) line before it. A test that fails after its
fault-exit line failed a later check (the line's words, the clean node, the resume); the log's
pytest report says which.

    python bench/fault_table.py LOG [LOG ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

EXIT = re.compile(r"^fault-exit (\S+) ([\d.]+) s")
ENDED = re.compile(r"^(?:forgesky: .* failed: .*|\S+: error: .*)$")
OUTCOMES = {".": "passed", "F": "failed after the exit (the log says why)", "E": "error"}


def read(log: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ended = None
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        text = line.removeprefix("E       ").strip()
        if ENDED.match(text):
            ended = text
            continue
        m = EXIT.match(line)
        if not m:
            continue
        # pytest -q -s writes the test's outcome (. or F) at the start of the next line
        after = lines[i + 1] if i + 1 < len(lines) else ""
        outcome = OUTCOMES.get(after[:1], "no outcome: the log ends (the call's time limit)")
        rows.append(
            {
                "fault": m.group(1),
                "seconds_to_exit": float(m.group(2)),
                "line": ended,
                "test": outcome,
                "log": log.name,
            }
        )
        ended = None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    rows = [row for log in a.logs for row in read(log)]
    if not rows:
        print("error: no `fault-exit` line in these logs", file=sys.stderr)
        return 2
    print("| fault | exit after | the run's last line | test |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['seconds_to_exit']:.1f} s | `{r['line']}` | {r['test']} |")
    if a.out:
        a.out.write_text(json.dumps({"faults": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
