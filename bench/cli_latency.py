"""Wall-clock latency of the forgesky CLI: `recipes`, `plan`, `render` (and `show`, `validate`).

Each command runs as a fresh process (what a user waits for), several times; the median is
reported next to a bare `python -c pass` on the same machine, since interpreter start-up and a
busy machine are part of every number. Writes bench/results/cli_latency.json.

    python bench/cli_latency.py [--repeats 7] [--out bench/results/cli_latency.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORGESKY = Path(sys.executable).parent / "forgesky"
# The catalog commands promise to answer within this (they import neither SkyPilot nor torch).
FAST_TARGET_S = 0.3
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "forgesky recipes": [str(FORGESKY), "recipes"],
    "forgesky show qwen3-8b": [str(FORGESKY), "show", "qwen3-8b"],
    "forgesky plan qwen3-8b --gpus 16": [str(FORGESKY), "plan", "qwen3-8b", "--gpus", "16"],
    "forgesky validate recipes/catalog/qwen3-8b.yaml": [
        str(FORGESKY),
        "validate",
        "recipes/catalog/qwen3-8b.yaml",
    ],
    "forgesky render qwen3-8b --managed --spot": [
        str(FORGESKY),
        "render",
        "qwen3-8b",
        "--managed",
        "--spot",
    ],
}
FAST = {
    "forgesky recipes",
    "forgesky show qwen3-8b",
    "forgesky plan qwen3-8b --gpus 16",
    "forgesky validate recipes/catalog/qwen3-8b.yaml",
}


def time_command(argv: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) per run; the first (cold file cache) run is discarded.

    CPU seconds (user + system of the child) are what the command itself costs; on a shared,
    busy machine wall time also counts the waits for a core.
    """
    walls, cpus = [], []
    for i in range(repeats + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i:
            walls.append(wall)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def device() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def versions() -> dict:
    out = {}
    for dist in ("forgesky", "skypilot", "pydantic", "PyYAML"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cli_latency.json")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    results = {}
    for name, command in COMMANDS.items():
        times, cpu = time_command(command, args.repeats)
        results[name] = {
            "median_s": round(statistics.median(times), 4),
            "min_s": round(min(times), 4),
            "max_s": round(max(times), 4),
            "cpu_median_s": round(statistics.median(cpu), 4),
            "runs_s": [round(t, 4) for t in times],
        }
        print(
            f"{name:50s} median {results[name]['median_s']:.3f} s  min {min(times):.3f} s  "
            f"cpu {results[name]['cpu_median_s']:.3f} s"
        )
    baseline = results["python -c pass"]["median_s"]
    for name in FAST:
        results[name]["over_python_startup_s"] = round(results[name]["median_s"] - baseline, 4)
    report = {
        "what": "seconds per CLI invocation (fresh process), median of repeats: wall clock, and "
        "CPU (user + system) of the process",
        "repeats": args.repeats,
        "fast_target_s": FAST_TARGET_S,
        "fast_commands_within_target": all(results[n]["median_s"] <= FAST_TARGET_S for n in FAST),
        "device": {**device(), "load_average_1m_before": round(load_before, 2)},
        "versions": versions(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
