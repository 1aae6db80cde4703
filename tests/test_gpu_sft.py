"""SFT on a GPU (run with `pytest -m gpu`): the path `forgesky local qwen3-1.7b-sft` takes on
one GPU (the trainer actor's one rank, FSDPTrainer in bf16), on a Qwen3 0.6B of random weights
and the shipped counting chats (nothing to download), with each way of keeping packed rows
apart that trains on GPUs: `varlen` (sft.attention auto there: TorchTitan's varlen attention on
torch's flash kernel) and `document` (SDPA under a dense same-row mask, what the CPU takes).
Flex is left out: its block mask fails on the nodes' torch 2.11. The loss falls, the MFU and
memory are recorded, the model folder is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import finish, metrics, start

pytestmark = pytest.mark.gpu

SETTINGS = (
    "model.size=0.6b",
    "model.dtype=bfloat16",
    "resources.accelerator=H200",
    "resources.alternatives=[]",
    "sft.learning_rate=3e-4",
    "sft.steps=30",
    "sft.checkpoint_interval=15",
)


@pytest.mark.parametrize("attention", ["varlen", "document"])
def test_sft_on_one_gpu_through_the_trainer_actor(tmp_path: Path, nothing_left, attention: str):
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-sft", "--gpus", "1", "--run-dir", str(run_dir)]
    for s in (*SETTINGS, f"sft.attention={attention}"):
        args += ["--set", s]
    proc = start(args)
    code, out = finish(proc, timeout=900)
    print(out)
    assert code == 0, out
    assert "trainer: FSDPTrainer on 1 rank (cuda)" in out, out
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    assert all(0 < r["mfu"] < 1 for r in rows), [r["mfu"] for r in rows]
    assert rows[-1]["memory/train_gb"] > 0
    model = run_dir / "model"
    assert json.loads((model / "forgesky.json").read_text())["step"] == 30
    assert (model / "model.safetensors").is_file()
    nothing_left(out, proc.pid)
