"""CPU step-time breakdown of the `tiny` recipe through the whole runtime.

Runs `python -m runtime --recipe tiny` (real Monarch procs, TorchStore, TorchTitan), then reads
its metrics.jsonl and reports where a step's time goes (generate, reward, reference, train,
weight sync), the start-up time, and the learning curve's milestones.

    .venv/bin/python bench/cpu_step_breakdown.py [--steps N] [--out bench/results/cpu_step_breakdown.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = (
    "time/generate_s",
    "time/reward_s",
    "time/reference_s",
    "time/train_s",
    "time/publish_s",
    "time/weight_sync_s",
    "time/wait_rollouts_s",
    "time/step_s",
)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "torchmonarch", "torchstore", "torchtitan", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def device() -> dict[str, object]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "machine": platform.machine()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    p.add_argument("--out", default=str(ROOT / "bench/results/cpu_step_breakdown.json"))
    args = p.parse_args()

    load_before = os.getloadavg()
    run_dir = Path(tempfile.mkdtemp(prefix="forgesky-bench-"))
    cmd = [sys.executable, "-m", "runtime", "--recipe", "tiny", "--run-dir", str(run_dir)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    start = time.perf_counter()
    first_step_at = None
    services_ready_s = None  # as the runtime reports it: every proc started and set up
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if first_step_at is None and line.startswith("step 1/"):
            first_step_at = time.perf_counter() - start
        if services_ready_s is None and line.startswith("services ready in "):
            services_ready_s = float(line.split()[3])
    code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        print(f"runtime exited {code}", file=sys.stderr)
        return code
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 5 :] or rows  # skip warm-up steps
    breakdown = {
        k: round(statistics.mean(r[k] for r in steady if k in r), 4)
        for k in PARTS
        if any(k in r for r in steady)
    }
    rewards = [r["reward/mean"] for r in rows]
    window = 5
    smooth = [statistics.mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    t_train = 0.0
    reached = None
    for r, s in zip(rows, smooth, strict=True):
        t_train += r["time/step_s"]
        if reached is None and s >= 0.8:
            reached = {"step": r["step"], "train_seconds": round(t_train, 1)}
    result = {
        "benchmark": "cpu_step_breakdown",
        "recipe": "tiny",
        "steps": len(rows),
        "device": device(),
        "versions": versions(),
        # other work on the machine inflates every timing here: the 1-minute load before/after
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "wall_seconds": round(wall, 1),
        "startup_seconds_to_first_step": round(first_step_at or 0.0, 1),
        "services_ready_seconds": services_ready_s,
        "train_seconds": round(sum(r["time/step_s"] for r in rows), 1),
        "mean_seconds_per_step_after_warmup": breakdown,
        "reward": {
            "first5_mean": round(statistics.mean(rewards[:window]), 3),
            "last5_mean": round(statistics.mean(rewards[-window:]), 3),
            "smoothed_reaches_0.8": reached,
        },
        "note": "time/*_s of generate, reward and reference are per rollout call and overlap "
        "with training; time/step_s is the trainer's wall time per step.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
