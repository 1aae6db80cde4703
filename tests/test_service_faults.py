"""A service proc killed mid-run, on CPU: the run ends in seconds naming the service and its
proc, leaves nothing behind, and the rerun resumes from the last committed checkpoint.

The CPU side of the GPU fault list: a trainer rank of two (gloo ranks, in their collectives), a
reference rank of two, and a generator while versions reach it by push (the sender in a gloo
collective with it).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runtime_helpers import finish, service_proc, start, wait_for_line

pytestmark = pytest.mark.slow

# A bound that catches a hang; it does not measure speed.
EXIT_BOUND_S = 60.0


@pytest.mark.parametrize(
    ("service", "rank", "sets", "line"),
    [
        (
            "trainer",
            1,
            ["trainer.ranks=2"],
            "forgesky: trainer actor failed: process killed by SIGKILL (proc 1/2)",
        ),
        (
            "reference",
            1,
            ["reference.ranks=2", "grpo.kl_beta=0.1"],
            "forgesky: reference actor failed: process killed by SIGKILL (proc 1/2)",
        ),
        (
            "generator0",
            0,
            ["weight_sync.transport=push"],
            "forgesky: generator0 actor failed: process killed by SIGKILL",
        ),
    ],
    ids=["trainer-rank", "reference-rank", "generator-receiving-pushes"],
)
def test_a_killed_service_proc_ends_the_run_and_the_rerun_resumes(
    tmp_path: Path, nothing_left, service, rank, sets, line
):
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--run-dir", str(run_dir), "--checkpoint-every", "2"]
    for item in ["eval.enabled=false", *sets]:
        args += ["--set", item]
    proc = start([*args, "--steps", "200"])
    # once a checkpoint is committed (written in the background, committed a step or more
    # later), so that the rerun has one to resume from
    wait_for_line(proc, "checkpoint step ", timeout=600)
    wait_for_line(proc, "step ", timeout=120)
    service_proc(proc.pid, service, rank).kill()
    killed = time.monotonic()
    code, out = finish(proc, timeout=EXIT_BOUND_S + 30)
    assert code == 1, out
    assert time.monotonic() - killed < EXIT_BOUND_S, out
    reports = [x for x in out.splitlines() if x.startswith("forgesky:") and "failed" in x]
    assert reports and reports[0].startswith(line), out
    nothing_left(out, proc.pid)

    committed = [
        int(p.parent.name.removeprefix("step_"))
        for p in (run_dir / "checkpoints").glob("step_*/COMMITTED")
    ]
    assert committed, out
    newest = max(committed)
    again = start([*args, "--steps", str(newest + 1)])
    code, out = finish(again, timeout=300)
    assert code == 0, out
    assert f"resumed from step {newest}" in out
    nothing_left(out, again.pid)


def test_a_trainer_rank_killed_mid_publish_ends_the_run_and_the_rerun_resumes(
    tmp_path: Path, nothing_left
):
    """Rank 1 of two dies between two gathered groups of a version (tests/failing_losses.py
    arms the kill from inside its proc, a few steps in); rank 0 is in the next group's gather
    with a peer that is gone. The run ends naming the trainer's proc, and the rerun resumes."""
    import re

    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--run-dir", str(run_dir), "--checkpoint-every", "2"]
    for item in ["eval.enabled=false", "trainer.ranks=2"]:
        args += ["--set", item]
    proc = start(
        [*args, "--steps", "200", "--set", "grpo.loss=failing_losses:rank_1_killed_mid_publish"]
    )
    code, out = finish(proc, timeout=600)
    ended = time.monotonic()
    found = re.search(r"failing_losses: rank 1 killed mid-publish at ([0-9.]+)", out)
    assert found, out[-3000:]
    assert code == 1, out
    print(f"fault-exit trainer-rank-killed-mid-publish {ended - float(found[1]):.1f} s")
    assert ended - float(found[1]) < EXIT_BOUND_S, out
    reports = [x for x in out.splitlines() if x.startswith("forgesky:") and "failed" in x]
    assert reports, out
    assert reports[0].startswith(
        "forgesky: trainer actor failed: process killed by SIGKILL (proc 1/2)"
    ), reports[0]
    nothing_left(out, proc.pid)
    committed = [
        int(p.parent.name.removeprefix("step_"))
        for p in (run_dir / "checkpoints").glob("step_*/COMMITTED")
    ]
    assert committed, out
    again = start([*args, "--steps", str(max(committed) + 1)])
    code, out = finish(again, timeout=300)
    assert code == 0, out
    assert f"resumed from step {max(committed)}" in out
    nothing_left(out, again.pid)
