"""Preemption on CPU with real processes: kill -9 and SIGTERM, restart, resume, same result.

All runs here are the tiny recipe (the SIGTERM test also tiny-lora, a LoRA run) for 8 steps with
a checkpoint every 2, in lock-step
(`grpo.max_policy_age=0`: a rollout starts only once the generator holds the version that will
train on it), which makes a run deterministic: generation seeds come from a call counter saved in
the checkpoint, and every process uses the same thread count, so an interrupted run that resumes
must end with bit-for-bit the weights of the uninterrupted one.

Metrics written after the last checkpoint and before a kill are redone on resume and appended
again: metrics.jsonl then holds such a step twice, and readers (`runtime.control.metrics.read_metrics`,
curves.png) keep the newer record. Lock-step makes the redone record equal the first one, which
the kill test checks. A SIGTERM checkpoints at the step it stopped at, so nothing is redone.

The longer sweep (>= 20 points) is bench/fault_sweep.py; its summary is in bench/results/.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from fault_runs import (
    STEPS,
    Point,
    RuntimeRun,
    final_weights,
    lock_step_args,
    partial_dirs,
    raw_metrics,
    run_to_point,
    session_pids,
    tensors_differ,
)
from runtime_helpers import NOISE, finish, start

from recipes import load_recipe
from runtime.backends import trainer_state
from runtime.control import checkpoint
from runtime.control.metrics import read_metrics

pytestmark = pytest.mark.slow

# Fields that depend only on what was trained on (timings do not).
DETERMINISTIC = ("reward/mean", "reward/std", "loss", "kl", "policy_version", "response/len_mean")


args = lock_step_args


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every interrupted one is compared with."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run = RuntimeRun(args(run_dir))
    assert run.finish(timeout=600) == 0, run.output
    assert f"finished at step {STEPS}" in run.output
    return run_dir


@pytest.mark.timeout(1200)  # the first to use `reference`, so it runs it
def test_a_checkpoint_holds_everything_a_resume_needs(reference: Path):
    root = reference / "checkpoints"
    # every 2 steps and at the end, the newest 3 kept, nothing half-written left behind
    assert [c.step for c in checkpoint.committed(root)] == [4, 6, 8]
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006", "step_000008"]
    ckpt = checkpoint.latest(root)
    marker = json.loads((ckpt.path / checkpoint.MARKER).read_text())
    assert marker == {
        "step": 8,
        "files": {
            str(f.relative_to(ckpt.path)): f.stat().st_size
            for f in sorted(ckpt.path.rglob("*"))
            if f.is_file() and f.name != "COMMITTED"
        },
    }
    assert "trainer/.metadata" in marker["files"]  # the trainer's DCP folder, listed file by file

    trainer = trainer_state.read_all(ckpt.path)
    assert trainer["step"] == 8
    assert trainer["scheduler"]["last_epoch"] == 8
    assert "tok_embeddings.weight" in trainer["model"]
    adam = trainer["optimizer"]["state"]
    # AdamW moments for every parameter it optimizes
    assert set(adam) == {i for g in trainer["optimizer"]["param_groups"] for i in g["params"]}
    assert all(s["step"] == 8 and {"exp_avg", "exp_avg_sq"} <= s.keys() for s in adam.values())

    state = torch.load(ckpt.path / "controller.pt", weights_only=False)
    assert (state["step"], state["version"]) == (8, 8)
    g = load_recipe("tiny").grpo  # one generator: one call of prompts_per_step prompts a step
    # data position: exactly the prompts of the generate calls made
    data = state["data"]
    taken = data["epoch"] * data["num_prompts"] + data["index"]
    assert taken == g.prompts_per_step * state["generate_calls"]
    # lock-step: one call per step; the stop may leave the groups for step 9, generated but
    # not trained on, and they are in the checkpoint
    assert state["generate_calls"] in (8, 9)
    assert len(state["buffer"]) == g.prompts_per_step * (state["generate_calls"] - 8)
    for group in state["buffer"]:
        assert group["policy_version"] == 8 and len(group["responses"]) == g.group_size
    assert isinstance(state["torch_rng"], torch.Tensor) and state["python_rng"][0] == 3
    assert state["wandb_run_id"] is None  # W&B off here; see the SIGTERM test
    assert json.loads((ckpt.path / "meta.json").read_text())["step"] == 8

    rows = raw_metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # lock-step: a call never starts before the last one's groups are queued
    assert all(r["generator/overlapped_calls"] == 0 for r in rows)


@pytest.mark.timeout(1800)  # five starts of the runtime: minutes on a loaded 2-core machine
def test_kill_9_at_random_points_resumes_from_the_last_committed_checkpoint(
    reference: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    rng = random.Random(20261121)
    points = [
        # a seeded moment of step 3 or 4, once the step-2 checkpoint is committed
        Point("step", rng.randint(3, 4), round(rng.uniform(0.0, 0.25), 3), after_commit=True),
        # resumed, the next checkpoint write
        Point("checkpoint_write"),
        # resumed again, while the restored version is published and loaded
        Point("restore", None, round(rng.uniform(0.0, 0.2), 3)),
        # resumed again, the weight sync of step 5 (after the step-4 checkpoint; no checkpoint
        # write right after step 5 comes first)
        Point("weight_sync", 3),
    ]
    results = []
    for point in points:
        result, run = run_to_point(args(run_dir), run_dir, point)
        results.append(result)
        report = f"{result.to_dict()}\n{run.output}"
        assert result.killed, report
        assert session_pids(run.proc.pid) == [], "a process of the killed run survived"
        # it resumed from the newest committed checkpoint, never from a partial one
        assert result.resumed_from == result.expected_resume, report
        if point.kind == "checkpoint_write":
            # frozen while the write was under way: the partial dir is there, uncommitted
            assert result.partial_at_kill, report
            partial_step = int(result.partial_at_kill[0].split("_")[1].split(".")[0])
            assert partial_step not in result.committed_at_kill, report

    # every restart after the first kill had a committed checkpoint to resume from
    assert all(r.expected_resume for r in results[1:]), [r.to_dict() for r in results]
    newest = checkpoint.latest(run_dir / "checkpoints")
    assert newest is not None
    last = RuntimeRun(args(run_dir))
    assert last.finish(timeout=600) == 0, last.output
    for word in NOISE:
        assert word not in last.output, last.output
    assert last.resumed_from() == newest.step, last.output
    assert f"finished at step {STEPS}" in last.output
    assert partial_dirs(run_dir) == []

    kept = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in kept] == list(range(1, STEPS + 1))
    rows = raw_metrics(run_dir)
    for record in kept:
        # the newer record of a redone step is kept, and redoing it gave the same numbers
        same_step = [r for r in rows if r["step"] == record["step"]]
        assert record == same_step[-1]
        for earlier in same_step[:-1]:
            assert {k: earlier[k] for k in DETERMINISTIC} == {k: record[k] for k in DETERMINISTIC}

    assert tensors_differ(final_weights(run_dir), final_weights(reference)) == [], [
        r.to_dict() for r in results
    ]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("recipe", ["tiny", "tiny-lora"])
def test_sigterm_checkpoints_exits_0_and_the_resumed_run_matches_an_uninterrupted_one(
    recipe: str, request: pytest.FixtureRequest, tmp_path: Path
):
    """Also for a LoRA run (its checkpoint: the adapter, its moments, the scheduler and the
    step; the frozen base is the seeded init again), resumed in lock-step to the same bits."""
    if recipe == "tiny":
        reference = request.getfixturevalue("reference")
    else:
        reference = request.getfixturevalue("tiny_lora_run")[0]
    run_dir = tmp_path / "run"
    first = RuntimeRun(args(run_dir, "--wandb", "offline", recipe=recipe))
    first.wait_line(r"^step 3/", timeout=600)
    first.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert first.finish(timeout=60) == 0, first.output
    assert time.monotonic() - sent < 30
    stopped_at = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert stopped_at < STEPS
    assert f"checkpoint step {stopped_at} " in first.output
    assert checkpoint.latest(run_dir / "checkpoints").step == stopped_at
    time.sleep(0.5)
    assert session_pids(first.proc.pid) == []

    second = RuntimeRun(args(run_dir, "--wandb", "offline", recipe=recipe))
    assert second.finish(timeout=600) == 0, second.output
    assert second.resumed_from() == stopped_at, second.output
    # resumed exactly where it stopped: no step redone, none missing, one file
    assert [r["step"] for r in raw_metrics(run_dir)] == list(range(1, STEPS + 1))
    ours, theirs = (
        read_metrics(run_dir / "metrics.jsonl"),
        read_metrics(reference / "metrics.jsonl"),
    )
    assert [{k: r[k] for k in DETERMINISTIC} for r in ours] == [
        {k: r[k] for k in DETERMINISTIC} for r in theirs
    ]
    final = final_weights(run_dir)
    assert tensors_differ(final, final_weights(reference)) == []
    if recipe == "tiny-lora":  # what it resumed and compared is the adapter alone
        assert final["model"] and all(".lora_" in k for k in final["model"]), list(final["model"])

    # the W&B run continues under the id the checkpoint carried
    state = torch.load(
        checkpoint.latest(run_dir / "checkpoints").path / "controller.pt", weights_only=False
    )
    run_id = state["wandb_run_id"]
    assert run_id
    offline_runs = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(name.endswith(f"-{run_id}") for name in offline_runs)


def test_sigusr1_prints_every_process_stacks_and_the_run_goes_on(tmp_path: Path):
    """What to do with a run that seems stuck: kill -USR1 prints the stacks of the controller
    and of every proc into the run's output, and the run carries on to its end."""
    run = RuntimeRun(args(tmp_path / "run"), log=tmp_path / "run.log")
    run.wait_line(r"services ready", timeout=300)
    before = len(run.lines)
    caught = run.dump_stacks()
    # the controller and the proc of each service: generator, reference, trainer, reward, and
    # the weight store's
    assert run.proc.pid in caught and len(caught) == 6, caught
    # on failure, the run's own lines without the stacks it printed
    assert run.finish(timeout=600) == 0, "".join(
        line for line in run.lines if not re.match(r"\s+File |\s{4}|Thread 0x|\s*$", line)
    )[-4000:]
    dumped = "".join(run.lines[before:])
    assert sorted(int(p) for p in re.findall(r"^stacks of pid (\d+)", dumped, re.M)) == sorted(
        caught
    ), dumped[-3000:]
    assert "runtime/control" in dumped  # the controller's own frames
    assert f"finished at step {STEPS}" in run.output


def test_a_run_resumes_on_another_number_of_trainer_ranks(tmp_path: Path, nothing_left):
    """A checkpoint written by two trainer ranks (FSDP over gloo, each writing its own shards)
    resumes on one rank (DCP reshards on load): the step after the resume is the one a resume on
    two ranks trains, loss and gradient norm alike."""
    base = ["--recipe", "tiny", "--checkpoint-every", "2", "--set", "eval.enabled=false"]
    first = tmp_path / "two"
    code, out = finish(start([*base, "--run-dir", str(first), "--steps", "4",
                              "--set", "trainer.ranks=2"]), timeout=600)  # fmt: skip
    assert code == 0, out
    runs = {}
    for ranks in (1, 2):  # both from the same checkpoint of step 4, at once
        run_dir = tmp_path / f"resumed_on_{ranks}"
        shutil.copytree(first, run_dir)
        args = [*base, "--run-dir", str(run_dir), "--steps", "5", "--set", f"trainer.ranks={ranks}"]
        runs[ranks] = (run_dir, start(args))
    steps = {}
    for ranks, (run_dir, proc) in runs.items():
        code, out = finish(proc, timeout=600)
        assert code == 0, out
        assert "resumed from step 4" in out, out
        backend = "FSDPTrainer on 2 ranks" if ranks == 2 else "TitanTrainer on 1 rank"
        assert f"trainer: {backend}" in out, out
        nothing_left(out, proc.pid)
        steps[ranks] = read_metrics(run_dir / "metrics.jsonl")[-1]
    one, two = steps[1], steps[2]
    assert one["step"] == two["step"] == 5
    assert one["reward/mean"] == two["reward/mean"]  # the same rollouts: the same version
    for key in ("loss", "kl", "grad_norm", "entropy"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
