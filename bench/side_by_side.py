"""Side-by-side figures of forgesky and TRL runs on one host, from their committed files.

Each run is `LABEL=SOURCE`: `json:PATH#SECTION` (a section `bench/gpu_grpo.py` or
`bench/trl_grpo.py` wrote) or `log:PATH` (a runtime log whose `step i/N | ... | X s/step`
lines are all that is left of a run, e.g. when the call's time limit came during its final
checkpoint). Step time is the mean over the steps after `--warmup`, as both benches count it;
samples/s per GPU = completions a step / step time / GPUs; tokens/s per GPU (prompt +
completion) only where the run's JSON counted its tokens.

    python bench/side_by_side.py --host NAME --pair ON OURS TRL [--pair ...] --out FILE.json
    python bench/side_by_side.py --refresh --out FILE.json   # targets only, nothing re-read

Pairs named `on_policy` and `one_step_off_policy` also get the ratio they aim at (TARGETS: 2x
and 2.5x the tuned TRL per GPU) and how far short of it the run fell.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

# forgesky / TRL samples/s per GPU that the speed work aims at, by pair name
TARGETS = {"on_policy": 2.0, "one_step_off_policy": 2.5}

STEP = re.compile(r"^step (\d+)/(\d+) \|.*\| ([0-9.e+-]+) s/step\s*$")


def from_log(path: Path, warmup: int, completions: int, gpus: int) -> dict[str, Any]:
    times = [float(m.group(3)) for line in path.read_text().splitlines() if (m := STEP.match(line))]
    if len(times) <= warmup:
        raise SystemExit(f"{path}: {len(times)} step lines, not more than the {warmup} left out")
    step = statistics.fmean(times[warmup:])
    return {
        "source": str(path),
        "step_times_s": times,
        "measured_steps": len(times) - warmup,
        "step_s": round(step, 3),
        "samples_per_s_per_gpu": round(completions / step / gpus, 2),
        "tokens_per_s_per_gpu": None,
        "note": "step times from the log's step lines (3 significant digits); no JSON",
    }


def from_json(path: Path, section: str) -> dict[str, Any]:
    data = json.loads(path.read_text())[section]
    keep = ("step_s", "samples_per_s_per_gpu", "tokens_per_s_per_gpu", "policy_staleness_mean")
    out: dict[str, Any] = {"source": f"{path}#{section}"}
    out.update({k: data.get(k) for k in keep})
    out["step_times_s"] = data.get("step_times_s") or [
        r["time/step_s"] for r in data.get("records", [])
    ]
    out["step_s"] = round(out["step_s"], 3)
    out["samples_per_s_per_gpu"] = round(out["samples_per_s_per_gpu"], 2)
    if out["tokens_per_s_per_gpu"] is not None:
        out["tokens_per_s_per_gpu"] = round(out["tokens_per_s_per_gpu"])
    return out


def load(source: str, warmup: int, completions: int, gpus: int) -> dict[str, Any]:
    kind, _, rest = source.partition(":")
    if kind == "log":
        return from_log(Path(rest), warmup, completions, gpus)
    if kind == "json":
        path, _, section = rest.partition("#")
        return from_json(Path(path), section)
    raise SystemExit(f"{source}: expected log:PATH or json:PATH#SECTION")


def add_targets(result: dict[str, Any]) -> None:
    """Each pair with a target gets it and `short_of_target`: the share of the target ratio the
    run fell short by (0 where it met it)."""
    for host in result.values():
        for name, pair in host.get("pairs", {}).items():
            if name not in TARGETS:
                continue
            target = TARGETS[name]
            ratio = pair["forgesky_over_trl_samples_per_s_per_gpu"]
            pair["target_forgesky_over_trl"] = target
            pair["short_of_target"] = round(max(0.0, 1 - ratio / target), 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", help="which machine (one host, both systems)")
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3")
    p.add_argument("--date")
    p.add_argument("--versions", default="{}", help="JSON: package versions on the host")
    p.add_argument("--differences", action="append", default=[], help="a setting that differs")
    p.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "OURS", "TRL"))
    p.add_argument("--refresh", action="store_true", help="add the targets to --out, no more")
    p.add_argument("--staleness", action="append", default=[], help="NAME=OURS,TRL (logs)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--completions", type=int, default=128, help="completions a step")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.refresh:
        result = json.loads(out.read_text())
        add_targets(result)
        out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if not (a.host and a.date and a.pair):
        p.error("--host, --date and at least one --pair are needed (or --refresh)")
    stale = {k: v.split(",") for k, v in (s.split("=", 1) for s in a.staleness)}
    pairs = {}
    for name, ours_src, trl_src in a.pair:
        ours = load(ours_src, a.warmup, a.completions, a.gpus)
        trl = load(trl_src, a.warmup, a.completions, a.gpus)
        if name in stale:
            ours.setdefault("policy_staleness_mean", float(stale[name][0]))
            trl.setdefault("policy_staleness_mean", float(stale[name][1]))
        pairs[name] = {
            "forgesky": ours,
            "trl": trl,
            "forgesky_over_trl_samples_per_s_per_gpu": round(
                ours["samples_per_s_per_gpu"] / trl["samples_per_s_per_gpu"], 2
            ),
        }
        print(
            f"{a.host} {name}: forgesky {ours['step_s']} s/step "
            f"({ours['samples_per_s_per_gpu']} samples/s/GPU), TRL {trl['step_s']} s/step "
            f"({trl['samples_per_s_per_gpu']}): "
            f"{pairs[name]['forgesky_over_trl_samples_per_s_per_gpu']}x"
        )
    result = json.loads(out.read_text()) if out.exists() else {}
    result[a.host] = {
        "device": a.device,
        "gpus": a.gpus,
        "date": a.date,
        "versions": json.loads(a.versions),
        "settings_that_differ": a.differences,
        "pairs": pairs,
    }
    add_targets(result)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
