"""What one environment worker's share of a tool-use step costs on this machine's CPU.

One `Host` (runtime/environments/host.py, what a worker process runs) with `--episodes`
episodes of bench/tools_env.py's `WaitEnvironment` (an OpenEnv MCP environment whose one tool
sleeps `--tool-s`): open them all at once, `--rounds` rounds of one call each, all at once (as
the rollout loop sends a round), close them all; the first `--warmup` repetitions are not
counted. Prints one JSON line: the medians (and min, max) of a round's, an open's and a close's
wall seconds for all the episodes, and the process's CPU milliseconds per call.

    python bench/env_rounds.py --episodes 16 --tool-s 0.1

The bench's qwen3-1.7b-tools runs give each of 8 workers 16 episodes (128 a step), so a round
above 0.1 s is what the worker adds to every tool round of every step.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.environments.host import Host, Spec  # noqa: E402


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def measure(episodes: int, rounds: int, tool_s: float, reps: int, warmup: int) -> dict[str, Any]:
    host = Host(Spec("bench.tools_env:WaitEnvironment", {"tool_s": tool_s}))
    host.probe()
    pool = ThreadPoolExecutor(max_workers=64)  # as many as a worker's (host.serve)
    opens, round_s, closes, cpu_per_call = [], [], [], []
    try:
        for rep in range(reps + warmup):
            ids = [f"{rep}/{i}" for i in range(episodes)]
            start = time.perf_counter()
            list(pool.map(lambda e: host.open(e, {}, 0), ids))
            opened = time.perf_counter() - start
            cpu, these = _cpu_s(), []
            for _ in range(rounds):
                start = time.perf_counter()
                answers = list(pool.map(lambda e: host.step(e, "wait", {}), ids))
                these.append(time.perf_counter() - start)
                if any(a["error"] for a in answers):
                    raise SystemExit(f"a call failed: {next(a for a in answers if a['error'])}")
            calls_cpu = _cpu_s() - cpu
            start = time.perf_counter()
            list(pool.map(lambda e: host.close(e, ""), ids))
            closed = time.perf_counter() - start
            if rep >= warmup:
                opens.append(opened)
                round_s += these
                closes.append(closed)
                cpu_per_call.append(1000 * calls_cpu / (rounds * episodes))
    finally:
        pool.shutdown()
        stop = getattr(host, "stop", None)  # a build before held sessions has none
        if stop is not None:
            stop()
    return {
        "episodes": episodes,
        "rounds": rounds,
        "tool_s": tool_s,
        "repetitions": reps,
        "round_s": _spread(round_s),
        "open_s": _spread(opens),
        "close_s": _spread(closes),
        "cpu_ms_per_call": _spread(cpu_per_call),
        # whether its MCP sessions are held (False: a build before them, or a plain class)
        "sessions_held": bool(getattr(host, "awaitable", False)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=16, help="episodes the worker hosts")
    p.add_argument("--rounds", type=int, default=4, help="tool calls an episode")
    p.add_argument("--tool-s", type=float, default=0.1, help="seconds a tool call sleeps")
    p.add_argument("--reps", type=int, default=5, help="repetitions counted")
    p.add_argument("--warmup", type=int, default=1, help="repetitions not counted")
    a = p.parse_args(argv)
    if a.episodes < 1 or a.rounds < 1 or a.reps < 1 or a.warmup < 0 or a.tool_s < 0:
        print("env_rounds: --episodes, --rounds, --reps at least 1; --warmup, --tool-s at least 0")
        return 2
    result = measure(a.episodes, a.rounds, a.tool_s, a.reps, a.warmup)
    result["python"] = platform.python_version()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
