"""The table of `device_run.sh cpus`: vLLM alone in several processes, each a section `cpus_*` of
one JSON (bench/gpu_grpo.py vllm), by process: its CPU set, each call's seconds, the CPUs its
engine thread was seen on and the seconds the hypervisor stole from them (of all CPUs' stolen);
a `--cpu-sweep` process's calls by the CPU the thread was pinned to.

    python bench/cpu_runs.py /tmp/bench/gpu_grpo_cpus.json

A call at ~2.5 s beside one at ~3.3 s on the same CPU within one process points away from the
CPU; the two speeds following CPUs (or their cores, or nodes: the topology line) point at it.
Where they follow neither: a slow call with its GC seconds up points at the process's own work,
one with the probe's MB/s down at the host's CPUs running slower under other load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def seen(cpus: dict[str, Any]) -> str:
    """The CPUs a call's engine thread was seen on, most samples first ("3 (60), 11 (2)"); by
    thread where several engine threads were watched."""
    if cpus and all(isinstance(v, dict) for v in cpus.values()):
        return "; ".join(f"{k}: {seen(v)}" for k, v in cpus.items())
    ranked = sorted(cpus.items(), key=lambda kv: (-kv[1], int(kv[0])))
    return ", ".join(f"{cpu} ({n})" for cpu, n in ranked) or "-"


def stolen(call: dict[str, Any]) -> str:
    """The seconds stolen from the CPUs a call's engine thread was seen on, and from all the
    host's CPUs ("0.02 of 0.31"); "-" where the call did not record them."""
    if "steal_s" not in call:
        return "-"
    return f"{call['steal_s']:.2f} of {call.get('host_steal_s', 0.0):.2f}"


def pace(call: dict[str, Any]) -> str:
    """This process's seconds in garbage collection during a call and the speed probe's median
    MB/s ("0.04 | 1180"); "-" for what the call did not record."""
    gc = f"{call['gc_s']:.2f}" if "gc_s" in call else "-"
    probe = call.get("probe_mb_per_s")
    return f"{gc} | {probe:.0f}" if probe is not None else f"{gc} | -"


def markdown(result: dict[str, Any]) -> str:
    """The processes' rows, then the sweeps' (one row a pinned CPU), then the host's layout."""
    sections = [(k, v) for k, v in result.items() if k.startswith("cpus_") and isinstance(v, dict)]
    lines = [
        "| process | hash seed | --cpus | CPUs allowed | call s | CPUs seen (samples) | stolen s "
        "| GC s | probe MB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sweeps, topology = [], None
    for name, section in sections:
        placement = section.get("cpu_placement", {})
        topology = topology or placement.get("topology")
        calls = section.get("calls_list", [])
        for i, call in enumerate(calls):
            head = [name, *(placement.get(k, "-") for k in ("python_hash_seed", "cpus_spec",
                                                            "affinity"))]  # fmt: skip
            cells = [*(head if i == 0 else [""] * 4), f"{call['s']:.2f}"]
            lines.append(
                f"| {' | '.join(cells)} | {seen(call.get('cpus_seen', {}))} | {stolen(call)} "
                f"| {pace(call)} |"
            )
        if not calls:
            lines.append(f"| {name} | - | - | - | no call | - | - | - | - |")
        sweeps += [(name, row) for row in section.get("cpu_sweep", [])]
    if sweeps:
        lines += [
            "",
            "| process | engine thread pinned to | call s | stolen s | GC s | probe MB/s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {row['cpu']} | {row['s']:.2f} | {stolen(row)} | {pace(row)} |"
            for name, row in sweeps
        ]
    if topology:
        lines += [
            "",
            f"CPUs {topology['cpus']}; SMT siblings {' '.join(topology['smt_siblings'])}; "
            f"NUMA nodes {topology['numa_nodes'] or '-'}; the GPU's node "
            f"{topology['gpu_numa_node']}",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/cpu_runs.py RESULT.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.exists():
        print(f"cpu_runs.py: no {path}", file=sys.stderr)
        return 2
    print(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
