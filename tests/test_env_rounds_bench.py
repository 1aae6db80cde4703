"""bench/env_rounds.py: a worker's tool rounds through the real Host and OpenEnv environment."""

from __future__ import annotations

import json

from bench import env_rounds


def test_the_rounds_bench_measures_held_sessions_and_refuses_bad_counts(capsys):
    assert env_rounds.main(["--episodes", "3", "--rounds", "2", "--tool-s", "0.01",
                            "--reps", "2", "--warmup", "0"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["sessions_held"] is True and out["episodes"] == 3
    for key in ("round_s", "open_s", "close_s", "cpu_ms_per_call"):
        assert out[key]["min"] <= out[key]["median"] <= out[key]["max"]
    assert out["round_s"]["min"] >= 0.01  # every round waited for its tool
    assert env_rounds.main(["--episodes", "0"]) == 2
    assert "at least 1" in capsys.readouterr().out
