"""Direct weight paths on GPUs (run with `pytest -m gpu`): NCCL push between two GPUs, CUDA IPC on
one, each moving the Qwen3-1.7B state dict between two procs and checked tensor by tensor
(bench/weight_push.py does the moving and the checking)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import weight_push  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="push between GPUs needs two")
def test_nccl_push_between_two_gpus():
    result = weight_push.run_path("qwen3-1.7b", "push", versions=3, device="cuda")
    assert result["versions"] == 3 and result["bytes"] > 3e9
    assert result["transfer_s"] > 0


def test_cuda_ipc_on_one_gpu():
    result = weight_push.run_path("qwen3-1.7b", "ipc", versions=3, device="cuda")
    assert result["versions"] == 3 and result["bytes"] > 3e9
