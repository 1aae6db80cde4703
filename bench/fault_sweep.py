"""Kill -9 sweep: the tiny recipe killed at many seeded random points, restarted, resumed.

Each chain is one run directory: start the runtime, kill every process of it at a point (during a
checkpoint write, a weight sync, a random moment of a step, start-up, or the restore after a
resume), start the same command again, and so on; then one last start runs to the end. Every
start must resume from the newest committed checkpoint on disk (never a `.partial` one), and each
chain must end with steps 1..N in metrics.jsonl and, in lock-step (`grpo.max_policy_age=0`), with
bit-for-bit the weights of one uninterrupted run. tests/test_faults.py runs a few such points in
`make test`; this is the long version. It runs a snapshot of the repository's HEAD (`git
archive`), so commits landing during the hour it takes do not change what it tests.

    .venv/bin/python bench/fault_sweep.py [--chains 3] [--points-per-chain 8] [--steps 14]
        [--every 2] [--seed 0] [--out bench/results/fault_sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fault_runs import (  # noqa: E402 - the test helpers live in tests/
    RuntimeRun,
    final_weights,
    partial_dirs,
    random_points,
    raw_metrics,
    run_to_point,
    tensors_differ,
)

from runtime.control.metrics import read_metrics  # noqa: E402

DETERMINISTIC = ("reward/mean", "reward/std", "loss", "kl", "policy_version", "response/len_mean")


def run_args(run_dir: Path, steps: int, every: int) -> list[str]:
    return [
        "--recipe", "tiny", "--steps", str(steps), "--checkpoint-every", str(every),
        "--set", "grpo.max_policy_age=0", "--run-dir", str(run_dir),
    ]  # fmt: skip


def check_chain(run_dir: Path, steps: int, reference: Path) -> list[str]:
    """What is wrong with a finished chain's outputs (empty: nothing)."""
    problems = []
    kept = read_metrics(run_dir / "metrics.jsonl")
    if [r["step"] for r in kept] != list(range(1, steps + 1)):
        problems.append(f"metrics steps {[r['step'] for r in kept]}")
    rows = raw_metrics(run_dir)
    for record in kept:
        same = [r for r in rows if r["step"] == record["step"]]
        if same[-1] != record:
            problems.append(f"step {record['step']}: the kept record is not the newest")
        for earlier in same[:-1]:
            if any(earlier.get(k) != record.get(k) for k in DETERMINISTIC):
                problems.append(f"step {record['step']}: redone with different numbers")
    if partial_dirs(run_dir):
        problems.append(f"partial checkpoint dirs left: {partial_dirs(run_dir)}")
    diff = tensors_differ(final_weights(run_dir), final_weights(reference))
    if diff:
        problems.append(f"final weights differ from the uninterrupted run at {diff[:5]}")
    return problems


def point_problems(result) -> list[str]:
    problems = []
    reached_restore = result.resumed_from is not None or result.kind not in ("startup",)
    if result.killed and reached_restore and result.resumed_from != result.expected_resume:
        problems.append(
            f"resumed from {result.resumed_from}, newest committed was {result.expected_resume}"
        )
    if result.kind == "checkpoint_write" and result.killed and not result.partial_at_kill:
        problems.append("no partial checkpoint on disk at the kill")
    if not result.killed and result.exit_code != 0:
        problems.append(f"ended by itself with exit code {result.exit_code}")
    return problems


def device() -> dict[str, object]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "load_average_1m_start": round(os.getloadavg()[0], 2),
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "torchmonarch", "torchstore", "torchtitan", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=3)
    p.add_argument("--points-per-chain", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/fault_sweep.json")
    a = p.parse_args()

    began = time.monotonic()
    summary: dict[str, object] = {
        "what": "kill -9 of every process of a tiny run at seeded random points, then restart",
        "settings": {
            "chains": a.chains,
            "points_per_chain": a.points_per_chain,
            "steps": a.steps,
            "checkpoint_every": a.every,
            "seed": a.seed,
            "overrides": ["grpo.max_policy_age=0"],
        },
        "device": device(),
        "versions": versions(),
    }
    rng = random.Random(a.seed)
    chains = []
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    summary["commit"] = commit
    with tempfile.TemporaryDirectory(prefix="fault_sweep_") as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        reference = Path(tmp) / "reference"
        ref = RuntimeRun(run_args(reference, a.steps, a.every), source=source)
        if ref.finish(timeout=1800) != 0:
            print(ref.output, file=sys.stderr)
            return 1
        print(f"reference run done in {time.monotonic() - began:.0f} s", flush=True)
        for c in range(a.chains):
            run_dir = Path(tmp) / f"chain{c}"
            args = run_args(run_dir, a.steps, a.every)
            points = random_points(rng, a.points_per_chain)
            results = []
            for point in points:
                result, run = run_to_point(args, run_dir, point, source)
                entry = {**result.to_dict(), "problems": point_problems(result)}
                if entry["problems"]:
                    entry["output_tail"] = run.output.splitlines()[-15:]
                results.append(entry)
                print(f"chain {c}: {json.dumps(entry)}", flush=True)
            last = RuntimeRun(args, source=source)
            code = last.finish(timeout=1800)
            problems = [] if code == 0 else [f"final run exit code {code}"]
            if code == 0:
                problems += check_chain(run_dir, a.steps, reference)
            final = {
                "exit_code": code,
                "resumed_from": last.resumed_from(),
                "problems": problems,
                "metrics_lines": len(raw_metrics(run_dir)) if code == 0 else None,
            }
            if problems:
                final["output_tail"] = last.output.splitlines()[-15:]
            print(f"chain {c} final: {json.dumps(final)}", flush=True)
            chains.append({"points": results, "final": final})

    points = [pt for ch in chains for pt in ch["points"]]
    killed = [pt for pt in points if pt["killed"]]
    by_kind = Counter(pt["kind"] for pt in killed)
    caught = [pt for pt in killed if pt["kind"] == "checkpoint_write" and pt["partial_at_kill"]]
    failures = [pt for pt in points if pt["problems"]] + [
        ch["final"] for ch in chains if ch["final"]["problems"]
    ]
    summary.update(
        {
            "points": len(points),
            "killed": len(killed),
            "killed_by_kind": dict(sorted(by_kind.items())),
            "checkpoint_writes_caught_with_partial_dir": len(caught),
            "resumed_from_newest_committed": sum(
                1 for pt in killed if pt["resumed_from"] == pt["expected_resume"]
            ),
            "killed_before_the_resume_line": sum(
                1 for pt in killed if pt["resumed_from"] is None and pt["expected_resume"]
            ),
            "chains_ending_with_all_steps_and_reference_weights": sum(
                1 for ch in chains if not ch["final"]["problems"]
            ),
            "failures": len(failures),
            "median_seconds_per_point": statistics.median(pt["seconds"] for pt in points),
            "total_seconds": round(time.monotonic() - began, 1),
            "chains": chains,
        }
    )
    summary["device"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)  # type: ignore[index]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2) + "\n")
    head = {k: v for k, v in summary.items() if k not in ("chains",)}
    print(json.dumps(head, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
