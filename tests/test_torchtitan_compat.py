import dataclasses

import torch.distributed.fsdp as fsdp

from runtime.compat import torchtitan as compat


def test_cpu_torch_needs_no_stand_in():
    # torch 2.13 (CI) has the name; the stand-in is only for torch 2.11 on GPU nodes
    assert not compat.torchtitan_needs_compat()
    assert fsdp.DataParallelMeshDims is not compat._DataParallelMeshDims


def test_stand_in_is_installed_where_torch_lacks_it(monkeypatch):
    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert compat.torchtitan_needs_compat()
    compat.ensure_torchtitan_importable()
    dims = fsdp.DataParallelMeshDims(shard="fsdp")
    assert dataclasses.asdict(dims) == {"shard": "fsdp", "replicate": None}
    compat.ensure_torchtitan_importable()  # idempotent
    assert fsdp.DataParallelMeshDims is compat._DataParallelMeshDims
