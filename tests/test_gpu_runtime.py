"""The whole runtime on GPUs (run with `pytest -m gpu`): `python -m runtime --recipe tiny-gpu
--gpus 2` as a launched task runs it. vLLM samples, the TorchTitan trainer trains, each version
goes to the generator by NCCL push; a policy with random weights learns the tiny task by RL."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from runtime_helpers import finish, metrics, start

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="the tiny-gpu plan gives the generator and the trainer a GPU each",
)
def test_tiny_gpu_learns_through_vllm_and_the_weight_push(tmp_path: Path, nothing_left):
    run_dir = tmp_path / "run"
    proc = start(["--recipe", "tiny-gpu", "--gpus", "2", "--run-dir", str(run_dir)])
    code, out = finish(proc, timeout=900)
    print(out)
    assert code == 0, out
    assert "weights reach the generators by: push" in out
    assert "backend vllm*" in out and "enforce_eager on" in out  # the plan it ran, as printed
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61))
    first = statistics.mean(r["reward/mean"] for r in rows[:5])
    last = statistics.mean(r["reward/mean"] for r in rows[-5:])
    assert first < 0.3 and last >= 0.8, (first, last)
    assert all(r["time/push_s"] > 0 for r in rows[1:])
    assert rows[-1]["buffer/dropped_stale"] == 0
    nothing_left(out, proc.pid)
