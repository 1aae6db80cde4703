"""The GPU benchmark's derived numbers, from metric records (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_grpo  # noqa: E402


def test_idle_share_uses_the_controllers_busy_share():
    records = [{"generator/busy_share": 0.8}, {"generator/busy_share": 0.6}]
    assert gpu_grpo.idle_share(records, generate_s=1.0, step_s=2.0) == pytest.approx(0.3)


def test_idle_share_falls_back_to_one_call_per_step():
    assert gpu_grpo.idle_share([{}], generate_s=1.0, step_s=4.0) == pytest.approx(0.75)
    assert gpu_grpo.idle_share([{}], generate_s=None, step_s=4.0) is None
    # a generation longer than the step (overlap) is not a negative idle share
    assert gpu_grpo.idle_share([{}], generate_s=5.0, step_s=4.0) == 0.0
