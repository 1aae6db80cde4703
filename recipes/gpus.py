"""The GPU types forgesky plans for, and what the planner needs to know of each.

One row a type: the memory CUDA reports (what every memory estimate is checked against,
recipes/memory.py), HBM bandwidth and dense bf16 peak (what scales measured speeds to a type
never measured, recipes/costs.py), and how nvidia-smi names it (the runtime's check of the GPU
it got). Bandwidth and peak are the vendor's datasheet figures for the SXM parts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    memory_mib: int  # what CUDA reports as the device's memory
    memory_source: str
    bandwidth_tbs: float  # HBM, TB/s
    bf16_tflops: float  # dense bf16 tensor peak, TFLOP/s
    smi_name: str  # a part of what nvidia-smi names it


GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec(81559, "nvidia-smi on an H100 SXM", 3.35, 989.0, "H100"),
    "H200": GpuSpec(143771, "nvidia-smi on an H200 SXM", 4.8, 989.0, "H200"),
    "A100-80GB": GpuSpec(
        81920, "SkyPilot's catalog (GpuInfo of p4de.24xlarge)", 2.039, 312.0, "A100-SXM4-80GB"
    ),
    "B200": GpuSpec(
        183359, "SkyPilot's catalog (GpuInfo of p6-b200.48xlarge)", 8.0, 2250.0, "B200"
    ),
}
GPU_TYPES = tuple(GPUS)


def check_gpu_type(text: str) -> str:
    """`text` as a GPU type of GPUS (any case), else UserError naming the close ones."""
    import difflib

    by_lower = {k.lower(): k for k in GPUS}
    name = by_lower.get(text.strip().lower())
    if name is not None:
        return name
    typed = text.strip().lower()
    close = [k for k in by_lower if k.startswith(typed) and typed] or difflib.get_close_matches(
        typed, list(by_lower), n=3, cutoff=0.4
    )
    hint = f"; did you mean {' or '.join(by_lower[c] for c in close)}?" if close else ""
    return _refuse(text, hint)


def _refuse(text: str, hint: str) -> str:
    from recipes.errors import UserError

    raise UserError(
        f"--gpu-type {text!r}: not a GPU type forgesky plans for ({', '.join(GPUS)}){hint}"
    )
