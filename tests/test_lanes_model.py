"""bench/lanes_model.py: the rollout loop's lanes and freshness rule in simulated time. Cases
with answers by hand, and the model beside the two-GPU tools runs it was written from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from lanes_model import Parts, main, model  # noqa: E402

RUNS = ROOT / "bench/results/gpu_h200x2_2026-11-29b-lanes"
PARTS = Parts(turn_s=0.8, tool_s=0.2, open_s=0.4, close_s=0.4, train_s=2.0, turns=4)
CALL = 0.4 + 4 * (0.8 + 0.2) + 0.4  # one call alone: 4.8 s


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_in_lock_step_calls_and_steps_follow_one_another_whatever_the_lanes(lanes):
    f = model(PARTS, lanes, max_policy_age=0)
    assert f["step_s"] == pytest.approx(CALL + 2.0)
    assert f["generator_idle_share"] == pytest.approx(1 - 3.2 / (CALL + 2.0))


def test_one_lane_one_step_off_is_bound_by_the_slower_of_its_call_and_the_trainer():
    f = model(PARTS, 1, max_policy_age=1)
    assert f["step_s"] == pytest.approx(CALL)  # training hides behind the next call
    assert f["generator_idle_share"] == pytest.approx(1 - 3.2 / CALL)
    slow = Parts(**{**PARTS.__dict__, "train_s": 6.0})
    assert model(slow, 1, max_policy_age=1)["step_s"] == pytest.approx(6.0)


def test_a_second_lane_one_step_off_waits_for_the_trainer_and_runs_freely_two_off():
    # tools long and the generator's calls instant, so the lanes never queue at the replica
    tools = Parts(turn_s=0.0, tool_s=1.0, open_s=0.4, close_s=0.4, train_s=2.0, turns=4)
    call = 0.4 + 4 * 1.0 + 0.4
    assert model(tools, 1, max_policy_age=1)["step_s"] == pytest.approx(call)
    # one step off a lane's next call may start only once the trainer has trained the step
    # before it: (call + train) for every two steps
    assert model(tools, 2, max_policy_age=1)["step_s"] == pytest.approx((call + 2.0) / 2)
    # two steps off nothing holds the lanes: two calls a call's time
    assert model(tools, 2, max_policy_age=2)["step_s"] == pytest.approx(call / 2)
    # with the generator's calls queued at the replica: slower than that, never below the
    # generator's own seconds, and idle less than with one lane
    one = model(PARTS, 1, max_policy_age=1)
    two_at_1 = model(PARTS, 2, max_policy_age=1)
    two_at_2 = model(PARTS, 2, max_policy_age=2)
    assert two_at_2["step_s"] < two_at_1["step_s"] < one["step_s"]
    assert two_at_2["step_s"] >= 4 * 0.8 - 1e-9
    assert two_at_2["generator_idle_share"] < two_at_1["generator_idle_share"]


def test_the_parts_come_from_a_runs_means_and_the_model_is_near_what_it_measured(capsys):
    for name, lanes in (("gpu_tools_one.json", 1), ("gpu_tools.json", 2)):
        section = json.loads((RUNS / name).read_text())["tools_2gpu"]
        assert section["batches_in_flight"] == lanes and section["max_policy_age"] == 1
        parts = Parts.of_run(section)
        m = section["means"]
        assert parts.turns == 4 and parts.prompts_per_step == 16
        assert parts.turn_s == pytest.approx(m["episode/sampling_s"] / 4)
        assert parts.open_s + parts.close_s + 4 * parts.tool_s == pytest.approx(
            section["env_wait_s_per_step"]
        )
        predicted = model(parts, lanes, max_policy_age=1)["step_s"]
        # the model leaves out the controller's own seconds: it runs fast, within 15 %
        assert 0.85 <= predicted / section["step_s"] <= 1.0, (name, predicted)
    # a run that measured its opening and closing: those, and the rounds the rest
    measured = {**section, "open_s_per_step": 0.3, "close_s_per_step": 0.1}
    parts = Parts.of_run(measured)
    assert (parts.open_s, parts.close_s) == (0.3, 0.1)
    assert parts.tool_s == pytest.approx((section["env_wait_s_per_step"] - 0.4) / 4)
    assert main([str(RUNS / "gpu_tools_one.json"), "--lanes", "1", "2", "--ages", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 1 |" in out and "measured 5.17 s a step" in out
