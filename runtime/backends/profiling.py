"""Where a trainer step's time goes: one step under torch.profiler, summarized.

`trainer.profile_step: N` in a recipe profiles optimizer step N on every trainer rank (the trainer
actor wraps its backend's step in `profiled`); the run writes each rank's summary to
`RUN_DIR/profile/step_N_rank_R.json` and prints one line of rank 0's. bench/gpu_grpo.py's
`train --profile` summarizes the trainer alone the same way.

The summary: the step's wall seconds; on a GPU the seconds its kernels ran, by kind (matmul,
attention, compiled (Triton), communication (NCCL), optimizer, copy, other) and the busiest
kernels by name (their seconds summed: kernels on several streams overlap, so a kind's seconds
can add up to more than the wall time), and the share of the wall time no kernel ran (launch
gaps, host work, waits); on a CPU, each op's own CPU seconds in their place (no idle share).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Kernel name fragments -> the part of a train step they belong to (first match wins).
KERNEL_KINDS = (
    ("communication", ("nccl",)),  # before "copy" and "other": all-gathers, reduce-scatters
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("compiled", ("triton",)),  # before "copy": fused kernels named after a to_copy they hold
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "_amp_")),
    ("copy", ("memcpy", "memset", "copy")),
)
TOP_KERNELS = 25


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(step: Callable[[], T], device: torch.device | str) -> tuple[T, dict[str, Any]]:
    """`step()` under torch.profiler: its result and the summary (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        result = step()
        _synchronize(device)
    wall = time.perf_counter() - start
    found = summary(prof, wall, cuda)
    # reading the events back takes long on a large step (24 s of qwen3-8b-sft's 40 s profiled
    # step on two H200s): the step's own seconds are `wall_s`, the rest is this
    found["summary_s"] = time.perf_counter() - start - wall
    return result, found


def measured_step(
    step: Callable[[], dict[str, Any]], device: torch.device | str, profile: bool
) -> dict[str, Any]:
    """`step()`'s stats with what this process saw during it (gpu_memory.StepEvents:
    `compile/graphs`, `memory/alloc_retries`, and `compile/reasons`, the guards that failed
    where a graph was compiled again) and, where `profile`, the step run under
    torch.profiler with this process's summary as `profile`. What the trainer actor's ranks and
    an SFT trainer in the controller's process both do with each training step."""
    from runtime.backends.gpu_memory import StepEvents

    events = StepEvents(device)
    before = events.read()
    if profile:
        stats, found = profiled(step, device)
        stats = {**stats, "profile": found}
    else:
        stats = step()
    again = events.recompiled()
    return stats | events.since(before) | ({"compile/reasons": again} if again else {})


def say_recompiles(
    stats: dict[str, Any], step: int, log: Callable[[str], Any], first: bool = False
) -> None:
    """Takes `compile/reasons` (from `measured_step`, or `rank_figures`) out of a step's stats
    and says, a line each, why torch.compile compiled a graph again during step `step`: what
    makes that step slow (`N graphs compiled` on its line). Not on the process's `first` step,
    where graphs are made anyway (the no-grad ones of a held-out pass before it fail on the
    grad mode then)."""
    for reason in stats.pop("compile/reasons", None) or []:
        if not first:
            log(f"trainer: step {step} compiled again, a guard failed: {reason}")


def summary(prof: Any, wall: float, cuda: bool) -> dict[str, Any]:
    """A finished profiler's kernels (or CPU ops) by kind and by name, over `wall` seconds."""
    kernels: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    if cuda:
        for event in prof.events():
            # a range annotated on the GPU's timeline (NCCL's `nccl:all_gather`, a
            # record_function) spans kernels already counted: torch's own totals skip them too
            if event.device_type != torch.autograd.DeviceType.CUDA or getattr(
                event, "is_user_annotation", False
            ):
                continue
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / 1e6
            spans.append((event.time_range.start, event.time_range.end))
    else:  # on a CPU the ops' own time stands in for kernels
        for avg in prof.key_averages():
            kernels[avg.key] = avg.self_cpu_time_total / 1e6
    by_kind: dict[str, float] = {}
    for name, seconds in kernels.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + seconds
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    # kernels on several streams overlap (a collective beside a matmul): the GPU was busy for
    # the union of their spans, less than the sum of their seconds
    busy = _covered(spans) / 1e6
    return {
        "device": "cuda" if cuda else "cpu",
        "wall_s": wall,
        "kernel_s": sum(kernels.values()),
        "busy_s": busy if cuda else None,
        "gpu_idle_share": max(0.0, 1 - busy / wall) if cuda and wall > 0 else None,
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_s": [{"name": name[:160], "s": s} for name, s in top],
    }


def _covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of `spans` (start, end)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summary_line(step: int, rank: int, s: dict[str, Any]) -> str:
    """`profile of step 3 (rank 0): 4.1 s, GPU idle 12 %; matmul 2.1 s, attention 0.6 s, ...`"""
    kinds = ", ".join(f"{k} {v:.2g} s" for k, v in list(s["by_kind_s"].items())[:5])
    idle = "" if s["gpu_idle_share"] is None else f", GPU idle {s['gpu_idle_share']:.0%}"
    where = "kernels" if s["device"] == "cuda" else "CPU ops"
    took = f" (the profile's summary took {s['summary_s']:.2g} s more)" if "summary_s" in s else ""
    return (
        f"profile of step {step} (rank {rank}): {s['wall_s']:.3g} s{idle}; {where}: {kinds}{took}"
    )


def every_rank(answers: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Rank 0's `stats` (a step's answers, one a rank) carry every rank's profile summary as
    `profile`, a list in rank order, where the step was profiled."""
    profiles = [a.get("profile") for a in answers]
    if any(p is not None for p in profiles):
        stats["profile"] = profiles
    else:
        stats.pop("profile", None)


def write_profiles(run_dir: Any, step: int, profiles: list[Any], log: Callable[[str], Any]) -> None:
    """Each rank's summary to RUN_DIR/profile/step_N_rank_R.json, and rank 0's in one line."""
    import json
    from pathlib import Path

    folder = Path(run_dir) / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    for rank, s in enumerate(profiles):
        if s is not None:
            path = folder / f"step_{step}_rank_{rank}.json"
            path.write_text(json.dumps({"step": step, "rank": rank, **s}, indent=1) + "\n")
    if profiles and profiles[0] is not None:
        log(f"{summary_line(step, 0, profiles[0])} ({folder}/step_{step}_rank_*.json)")
