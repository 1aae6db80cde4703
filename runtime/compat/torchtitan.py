"""Let torchtitan 0.3.0 import on torch 2.11 (the GPU stack that vLLM 0.24 pins).

torchtitan 0.3.0's `torchtitan.distributed.fsdp` imports `DataParallelMeshDims` from
`torch.distributed.fsdp`, which torch added after 2.11. It is only used by TorchTitan's own
FSDP helpers for meshes that are already DTensor-sharded; forgesky shards with `fully_shard`
directly and never calls them, but the import runs whenever a model package is imported. So on a
torch without it, a stand-in with the same fields is installed before torchtitan is imported.
On torch >= 2.12 (the CPU wheel, 2.13) this does nothing. Measured on an H100 machine with
torch 2.11.0+cu130: this was the only missing name among the modules forgesky imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _DataParallelMeshDims:
    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None


def torchtitan_needs_compat() -> bool:
    import torch.distributed.fsdp as fsdp

    return not hasattr(fsdp, "DataParallelMeshDims")


def ensure_torchtitan_importable() -> None:
    """Install the stand-in where torch lacks it; idempotent."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        _DataParallelMeshDims.__name__ = "DataParallelMeshDims"
        fsdp.DataParallelMeshDims = _DataParallelMeshDims


ensure_torchtitan_importable()
