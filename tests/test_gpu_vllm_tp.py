"""A tensor-parallel (TP=2) vLLM generator loads policy versions from a flat GPU buffer: what the
push and IPC weight paths hand it (run with `pytest -m gpu` on a machine with two GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a TP=2 engine needs two GPUs")
def test_tp2_engine_loads_flat_buffers_through_cuda_ipc():
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_tp_check.py")],
        capture_output=True,
        text=True,
        timeout=480,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    print({k: v for k, v in r.items() if not k.startswith("samples")})
    for v in (0, 1):
        # the samples follow the weights just loaded (bf16 noise), not any others
        assert r[f"mismatch_{v}"] < 0.05, r
        assert r[f"other_weights_{v}"] > 10 * r[f"mismatch_{v}"], r
    same = sum(a == b for a, b in zip(r["samples_0"], r["samples_1"], strict=True))
    assert same == 0  # version 1 replaced version 0 on both workers
    # Versions from another process's buffers (the trainer's CUDA IPC path, a handle per
    # worker): each buffer is freed once released, so the sender's memory does not grow.
    assert r["ipc_exit"] == 0, r
    rows = r["ipc_allocated"]
    assert len(rows) == 3, rows
    for row in rows:
        assert row["held"] > row["base"], row  # the version's buffer while it was out
        assert row["after_release"] <= row["base"] + (1 << 20), row  # and none of it after
    assert r["ipc_samples_1"] != r["ipc_samples_2"]
