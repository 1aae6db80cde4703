"""TRL's SFT bench counts the tokens of every process (bench/trl_sft.py): each process counts its
own micro-batches, the counts are gathered over the process group and summed before tokens/s
per GPU divides by the processes; and a run recorded with rank 0's counts alone is written again
only from a replay whose rank 0 agrees with it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import trl_sft  # noqa: E402

RESULTS = REPO / "bench/results/gpu_h200x2_2026-11-30-sft"


def _gather(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        running = [0, 10 + rank, 25 + 2 * rank]  # this process's running counts
        gathered = trl_sft.every_process(running)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def test_counts_are_gathered_from_every_process_in_rank_order_and_summed(tmp_path):
    out = tmp_path / "gathered.json"
    mp.spawn(_gather, args=(3, str(tmp_path / "store"), str(out)), nprocs=3, join=True)
    gathered = json.loads(out.read_text())
    assert gathered == [[0, 10, 25], [0, 11, 27], [0, 12, 29]]
    assert trl_sft.summed(gathered) == [0, 33, 81]
    assert trl_sft.increments(trl_sft.summed(gathered)) == [33, 48]
    # tokens/s per GPU then divides all the processes' tokens by their number
    got = trl_sft.figures([0.0, 1.0, 3.0], trl_sft.summed(gathered), warmup=1, world=3)
    assert got["tokens_per_s_per_gpu"] == pytest.approx(48 / 2.0 / 3)
    # outside a process group: this process's counts alone
    assert trl_sft.every_process([0, 5]) == [[0, 5]]


def _raw(rank0: list[int]) -> dict:
    peer = {
        "system": "trl",
        "gpus": 2,
        "recipe": "qwen3-1.7b-sft",
        "step_times_s": [3.0, 2.0, 2.0],
        "warmup_steps": 1,
        "tokens_per_step": rank0,
        "tokens_per_s_per_gpu": sum(rank0[1:]) / 4.0 / 2,
        "mfu": 0.05,
    }
    ours = {"system": "forgesky", "tokens_per_s_per_gpu": 30.0, "mfu": 0.4}
    return {"pair1_ours": ours, "pair1_peer": peer, "device": {"name": "x"}}


def _replay(by_process: list[list[int]]) -> dict:
    return {"replay": {"mode": "count_tokens", "tokens_per_step_by_process": by_process}}


def test_a_rank0_count_is_summed_from_a_replay_that_agrees_with_it(capsys):
    raw = _raw([100, 120, 80])
    fixed = trl_sft.sum_processes(raw, _replay([[100, 120, 80, 90], [110, 100, 100, 95]]))
    peer = fixed["pair1_peer"]
    assert peer["tokens_per_step"] == [210, 220, 180]
    assert peer["tokens_per_step_rank0"] == [100, 120, 80]
    assert peer["tokens_per_s_per_gpu"] == pytest.approx((220 + 180) / 4.0 / 2)
    assert peer["tokens_per_s_per_gpu_rank0_counted"] == pytest.approx(200 / 4.0 / 2)
    assert peer["mfu"] == pytest.approx(0.05 * 400 / 200) and peer["mfu_rank0_counted"] == 0.05
    assert fixed["pair1_ours"] == raw["pair1_ours"]  # forgesky's sections are left as they are
    assert raw["pair1_peer"]["tokens_per_step"] == [100, 120, 80]  # the input is not changed
    # other batches, a summed file, another process count: refused, nothing written
    for replay, what in [
        (_replay([[100, 121, 80], [1, 1, 1]]), "not the same batches"),
        (_replay([[100, 120, 80]]), "2 processes, the replay has 1"),
        ({"a": {"mode": "count_tokens"}, "b": {"mode": "count_tokens"}}, "2 --count-tokens"),
    ]:
        with pytest.raises(SystemExit) as stop:
            trl_sft.sum_processes(raw, replay)
        assert stop.value.code == 2 and what in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trl_sft.sum_processes(fixed, _replay([[210, 220, 180], [1, 1, 1]]))
    assert "already counts every process" in capsys.readouterr().err


def test_the_committed_two_gpu_trl_figures_are_the_replay_summed():
    raw = json.loads((RESULTS / "pairs_sft2.json").read_text())
    replay = json.loads((RESULTS / "trl_tokens_replay.json").read_text())
    summed = json.loads((RESULTS / "pairs_sft2_summed.json").read_text())
    assert trl_sft.sum_processes(raw, replay) == summed
    for k in (1, 2, 3):
        peer = summed[f"pair{k}_peer"]
        assert peer["tokens_per_step_by_process"][0] == raw[f"pair{k}_peer"]["tokens_per_step"]
        ratio = peer["tokens_per_s_per_gpu"] / raw[f"pair{k}_peer"]["tokens_per_s_per_gpu"]
        assert ratio > 1.9
