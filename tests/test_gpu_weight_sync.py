"""Weight paths on GPUs (run with `pytest -m gpu`): NCCL push between two GPUs, CUDA IPC on one,
the store path from GPU tensors, each moving the Qwen3-1.7B state dict and checking it tensor by
tensor (bench/weight_push.py does the moving and the checking)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import weight_push  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="push between GPUs needs two")
@pytest.mark.parametrize("path", ["push", "push_groups"])
def test_nccl_push_between_two_gpus(path: str):
    # push_groups: each block's tensors broadcast as handed over (weight_sync.push_buffer
    # groups), no staging buffer of a version
    result = weight_push.run_path("qwen3-1.7b", path, versions=3, device="cuda")
    assert result["versions"] == 3 and result["bytes"] > 3e9
    assert result["transfer_s"] > 0


def test_cuda_ipc_on_one_gpu():
    result = weight_push.run_path("qwen3-1.7b", "ipc", versions=3, device="cuda")
    assert result["versions"] == 3 and result["bytes"] > 3e9


def test_the_store_path_streams_a_version_from_gpu_tensors():
    # the path of the recipes too large for a flat buffer on trainer rank 0 (qwen3-14b, 32b):
    # Qwen3-1.7B's state dict on GPU 0 handed over a tensor at a time, into TorchStore, fetched
    # into GPU 1 (or 0), checked tensor by tensor; its seconds a GB go to the log
    result = weight_push.run_store("qwen3-1.7b", versions=3, device="cuda")
    assert result["versions"] == 3 and result["bytes"] > 3e9
    # streamed: the publish never held a second copy of the version on the trainer's GPU
    extra = max(r["publish_gpu_extra_bytes"] for r in result["rows"])
    assert extra < 0.5 * result["bytes"], (extra, result["bytes"])
    print(
        f"store path: publish {result['stage_s']:.2f} s, fetch {result['load_s']:.2f} s, "
        f"{result['bytes'] / 1e9 / result['end_to_end_s']:.2f} GB/s end to end, "
        f"{extra / 1e9:.2f} GB allocated on GPU 0 beside the weights"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a push generator needs a second GPU")
def test_ipc_and_push_together_keep_one_buffer_of_a_version():
    """Trainer rank 0 on GPU 0 with a generator by ipc beside it and one by push on GPU 1 (the
    on-policy plan of two GPUs): each version goes out of one flat buffer, the ipc path's."""
    import asyncio

    from runtime.weights.flat import flat_layout, views
    from runtime.weights.push import PushReceiver
    from runtime.weights.transport import Publisher

    g = torch.Generator().manual_seed(0)
    sd = {  # ~400 MB of bf16 in 8 tensors
        f"layer{i}.weight": torch.randn(5000, 5000, generator=g).to(torch.bfloat16).cuda(0)
        for i in range(8)
    }
    entries, _ = flat_layout(sd)
    version_bytes = max(e.offset + e.nbytes for e in entries.values())

    class Manifests:
        async def put_manifest(self, version, manifest, *, check=False):
            self.last = manifest

    publisher = Publisher(Manifests(), ["ipc", "push"], torch.device("cuda:0"))
    address, port = publisher.open()["push"]
    receiver = PushReceiver(address, port, 1, 2, torch.device("cuda:1"))
    push = next(s for s in publisher.senders if s.name == "push")
    ipc = next(s for s in publisher.senders if s.name == "ipc")
    try:
        publisher.set_layout({n: t.to("meta") for n, t in sd.items()})
        for version in range(3):
            torch.cuda.synchronize(0)
            base = torch.cuda.memory_allocated(0)
            torch.cuda.reset_peak_memory_stats(0)
            groups = ({n: t.clone()} for n, t in sd.items())  # gathered a tensor at a time
            asyncio.run(publisher.publish_groups(version, groups))
            assert receiver.wait_for(version, timeout=120) == version
            with receiver.lock:
                pushed = views(receiver.buffer, entries)
                assert all(torch.equal(pushed[n].cpu(), t.cpu()) for n, t in sd.items())
            opened = views(ipc.buffer(version), entries)
            assert all(torch.equal(opened[n], t) for n, t in sd.items())
            peak = torch.cuda.max_memory_allocated(0) - base
            # one version's buffer and one gathered group in flight, not two buffers
            assert version_bytes <= peak < 1.5 * version_bytes, (peak, version_bytes)
            assert push.own_bytes == 0
            publisher.loaded(version)
    finally:
        publisher.close()
        receiver.close()
