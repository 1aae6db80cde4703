"""A whole run's predicted wall time against the measured one, from the runs' summaries.

    python bench/run_time_check.py RUN_DIR_OR_JSON [...] [--out bench/results/run_time_check.json]

Each run writes RUN_DIR/summary.json at its end (runtime/control/metrics.py): the wall time
measured on the nodes (every process of the run, start-up included) beside the prediction the
plan made of it (recipes/run_cost.py, less the provisioning before the run starts). An argument
is a run directory, its summary.json, a JSON file holding such summaries (a list, or
{"runs": [...]}: what --out writes), or a JSON of bench/gpu_grpo.py (each section's
`run_summary`). The error is (measured - predicted) / predicted; the
target is within 15 % on GPU runs of 20 steps or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGET_ERROR = 0.15
MIN_STEPS = 20


def summaries(source: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary) of each run `source` holds."""
    path = source / "summary.json" if source.is_dir() else source
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]
    if isinstance(data, dict) and "measured_wall_s" not in data:
        # a JSON of bench/gpu_grpo.py: each section's run carries its summary as run_summary
        found = [
            (f"{source}#{name}", _with_run_lengths(part["run_summary"], part))
            for name, part in data.items()
            if isinstance(part, dict) and part.get("run_summary")
        ]
        if found:
            return found
        if not any(k in data for k in ("predicted", "steps")):
            return []
    if isinstance(data, dict):
        return [(str(source), data)]
    return [(str(d.get("run", f"{source}#{i}")), d) for i, d in enumerate(data)]


def _with_run_lengths(summary: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """A bench section's summary, given the prediction at the run's lengths from the section's
    own `predicted_step_s` (bench/gpu_grpo.py: the cost model at the run's mean lengths) where
    the runtime did not record it."""
    predicted = summary.get("predicted")
    if not predicted or predicted.get("at_run_lengths") or not section.get("predicted_step_s"):
        return summary
    step = section["predicted_step_s"]
    at = {
        "prompt_tokens": section.get("prompt_tokens_mean"),
        "response_tokens": section.get("response_tokens_mean"),
        "step_s": step,
        "wall_s_on_the_nodes": round(
            predicted["wall_s_on_the_nodes"] + predicted["steps"] * (step - predicted["step_s"]), 1
        ),
    }
    return {**summary, "predicted": {**predicted, "at_run_lengths": at}}


def check(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    predicted = (summary.get("predicted") or {}).get("wall_s_on_the_nodes")
    measured = summary.get("measured_wall_s")
    row: dict[str, Any] = {
        "run": name,
        "steps": summary.get("steps"),
        "measured_wall_s": measured,
        "predicted_wall_s": predicted,
        "predicted": summary.get("predicted"),
    }
    at = (summary.get("predicted") or {}).get("at_run_lengths") or {}
    if at.get("wall_s_on_the_nodes") and measured is not None:
        # the model given the lengths the run had: its error apart from the plan's assumption
        # that every prompt and completion is as long as the recipe allows
        row["predicted_at_run_lengths_s"] = at["wall_s_on_the_nodes"]
        row["error_at_run_lengths"] = round(
            (measured - at["wall_s_on_the_nodes"]) / at["wall_s_on_the_nodes"], 3
        )
    if predicted and measured is not None:
        row["error"] = round((measured - predicted) / predicted, 3)
        row["within_target"] = abs(row["error"]) <= TARGET_ERROR
    else:
        row["error"] = None  # a CPU run, or one without a price table's prediction
    if summary.get("cost_usd") is not None:
        row["cost_usd"] = summary["cost_usd"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, metavar="RUN_DIR_OR_JSON")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for source in args.sources:
        if not (source.is_file() or (source / "summary.json").is_file()):
            print(f"run_time_check: {source}: no summary.json", file=sys.stderr)
            return 2
        found = summaries(source)
        if not found:
            print(f"run_time_check: {source}: no run's summary in it", file=sys.stderr)
            return 2
        rows.extend(check(name, s) for name, s in found)
    for r in rows:
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        predicted = "-" if r["predicted_wall_s"] is None else f"{r['predicted_wall_s']:.0f} s"
        short = " (under 20 steps)" if (r["steps"] or 0) < MIN_STEPS else ""
        at = ""
        if r.get("error_at_run_lengths") is not None:
            at = (
                f"; at the run's lengths {r['predicted_at_run_lengths_s']:.0f} s, "
                f"error {r['error_at_run_lengths']:+.1%}"
            )
        print(
            f"{r['run']}: {r['steps']} steps, measured {r['measured_wall_s']:.0f} s, "
            f"predicted {predicted}, error {error}{at}{short}"
        )
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if errors:
        print(
            f"largest error {max(errors):.1%} over {len(errors)} runs (target {TARGET_ERROR:.0%})"
        )
    if args.out:
        args.out.write_text(json.dumps({"target": TARGET_ERROR, "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
