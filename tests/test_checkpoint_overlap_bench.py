"""bench/checkpoint_overlap.py on CPU: the runtime's trainer and checkpoint writer (two gloo
ranks, the tiny recipe), the host copy made before training as the runtime makes it, then two
writes one after the other, each overlapped by training steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_writes_each_overlapped_by_steps(tmp_path):
    out, scratch = tmp_path / "overlap.json", tmp_path / "writes"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "checkpoint_overlap.py"),
            "--device=cpu",
            "--recipe=tiny",
            "--ranks=2",
            "--rows=4",
            "--width=48",
            "--prompt=16",
            f"--dir={scratch}",
            f"--out={out}",
            "--prepare",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [w["write"] for w in result["writes"]] == [1, 2]
    sizes = {w["checkpoint_bytes"] for w in result["writes"]}
    assert len(sizes) == 1 and sizes.pop() > 0  # the same state both times
    assert len(result["ranks_detail"]) == 2 and result["prepared_before_training"]
    for rank in result["ranks_detail"]:
        assert rank["prepared"]["call_s"] >= 0 and len(rank["prepared"]["staging_wait_s"]) == 1
        assert len(rank["writes"]) == 2
        for write in rank["writes"]:
            assert write["bytes_written_by_rank"] > 0
            assert write["steps_done_during_write"] == len(write["step_s_during_write"]) >= 1
            assert len(write["step_s_after"]) == 2
        assert "during write 2" in rank["timer_lateness_max_s"]
