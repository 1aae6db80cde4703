"""The runtime end to end on CPU: real Monarch procs, real TorchStore, the `tiny` recipe.

Each test runs `python -m runtime` in its own session and checks what a user would see: exit
codes, output free of tracebacks and shutdown noise, no process or shared-memory segment left.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from runtime_helpers import (
    ROOT,
    finish,
    kill_tree,
    metrics,
    start,
    wait_for_line,
)

from launcher.cli import main as cli_main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_tiny_run_learns_and_exits_cleanly(tmp_path: Path, nothing_left, loss):
    run_dir = tmp_path / "run"
    proc = start(["--recipe", "tiny", "--run-dir", str(run_dir), "--set", f"grpo.loss={loss}"])
    code, out = finish(proc, timeout=900)
    assert code == 0, out
    nothing_left(out, proc.pid)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for key in ("reward/mean", "loss", "kl", "policy_version", "time/step_s", "time/weight_sync_s"):
        assert key in rows[0], key
    # a version's publish in parts: its staging on the paths, then its manifest's put
    assert all(0 < r["time/publish_stage_s"] <= r["time/publish_s"] for r in rows), rows[0]
    # a generate call's seconds, and the engine's own part of them
    calls = [r for r in rows if "time/generate_s" in r]
    assert calls and all(0 < r["time/engine_s"] <= r["time/generate_s"] for r in calls)
    # what the engine's thread spent in those seconds: CPU and context switches in every call's
    # record; the kernel may count CPU by its tick (4 ms at 250 Hz), so a call of a few ms can
    # read 0 or a tick more than it lasted: over the run, the CPU is there and below the wall
    names = ("cpu_s", "voluntary_switches", "involuntary_switches")
    for r in calls:
        assert all(r[f"generator/engine_thread_{n}"] >= 0 for n in names), r
        # and the CPUs it was seen on (sampled as the call starts, as it ends and between)
        assert r["generator/engine_thread_cpus_seen"] >= 1, r
        assert r["generator/engine_thread_cpu_moves"] >= 0, r
        assert r["generator/engine_thread_cpu_steal_s"] >= 0, r
        # this process's seconds in the garbage collector during the call (GIL held)
        assert 0 <= r["generator/gc_s"] <= r["time/generate_s"], r
    cpu = sum(r["generator/engine_thread_cpu_s"] for r in calls)
    engine = sum(r["time/engine_s"] for r in calls)
    assert 0 < cpu <= engine + 0.004 * len(calls), (cpu, engine)
    # what each periodic checkpoint (every 20 steps) held the loop up, in the next step's record
    stalls = [r["step"] for r in rows if "time/checkpoint_stall_s" in r]
    assert stalls == [21, 41], stalls
    # and what its copy of the trainer's state held up that step's optimizer step
    waits = [r["step"] for r in rows if "time/checkpoint_staging_wait_s" in r]
    assert waits == [21, 41], waits
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    # a broken sign or advantage leaves the reward where it started
    assert last >= first + 0.3, (first, last)
    assert last >= 0.6, (first, last)
    # max_policy_age 1: the generator starts its next call while the reference scores the last
    # (at the latest on the first step, when the trainer waits for rollouts)
    assert sum(r["generator/overlapped_calls"] for r in rows) > 0
    if loss == "dapo":  # dynamic sampling dropped the groups that all scored alike
        assert sum(r["rollout/dropped_uninformative"] for r in rows) > 0
    # and never one that would be stale by the time it is trained on
    assert rows[-1]["buffer/dropped_stale"] == 0
    # the held-out prompts (four digits shown, never trained on): the initial policy, every 10
    # steps and the final one; greedy accuracy rises with the training reward
    evals = [r for r in rows if "eval/pass@1" in r]
    versions = [r["eval/version"] for r in evals]  # a generator may be one version on by then
    assert len(versions) == 7 and versions[0] == 0 and versions[-1] == 60, evals
    assert all(10 * i <= v <= 10 * i + 1 for i, v in enumerate(versions)), evals
    assert evals[0]["eval/pass@1"] <= 0.2 and evals[-1]["eval/pass@1"] >= 0.7, evals
    assert evals[-1]["step"] == 60 and evals[-1]["eval/prompts"] == 10
    assert all(0 <= r["eval/pass@4"] <= 1 for r in evals)
    # `forgesky eval` of the finished run, in one process, gives the run's own final numbers
    out_file = tmp_path / "eval.json"
    assert cli_main(["eval", str(run_dir), "--out", str(out_file)]) == 0
    offline = json.loads(out_file.read_text())
    assert offline["step"] == 60
    for key in ("eval/pass@1", "eval/reward_mean", "eval/pass@4", "eval/mean@4"):
        assert offline[key] == pytest.approx(evals[-1][key]), (key, offline, evals[-1])
    # the model the run left, in Hugging Face format, evaluates the same
    model = run_dir / "model"
    assert f"model -> {model}" in out
    # what the end of the run waits for is said before it waits (a 21 GB checkpoint of a 1.7B
    # model takes half a minute)
    final = out.index("writing the checkpoint of step 60 (")
    assert final < out.index("checkpoint step 60 ->") < out.index("writing the model (~0.3 MB")
    assert out.index("writing the model (") < out.index(f"model -> {model}")
    assert json.loads((model / "forgesky.json").read_text())["step"] == 60
    assert cli_main(["eval", str(model), "--recipe", "tiny", "--out", str(out_file)]) == 0
    exported = json.loads(out_file.read_text())
    assert exported["eval/pass@1"] == pytest.approx(evals[-1]["eval/pass@1"])
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p.name.startswith("step_") for p in (run_dir / "checkpoints").iterdir())


def test_tiny_lora_run_trains_the_adapter_alone_and_leaves_a_peft_folder(
    tmp_path: Path, nothing_left
):
    """`forgesky local tiny-lora` (the same entry point): no reference proc, the reference's kl
    is 0 before the adapter moves, the reward rises, the run leaves a PEFT adapter folder and
    `forgesky eval` reads the run. Learning to 0.8 is test_tiny's (in process, 150 steps)."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-lora", "--steps", "30", "--run-dir", str(run_dir)]
    proc = start([*args, "--set", "trainer.profile_step=3"])
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    nothing_left(out, proc.pid)
    # the trainer actor ran step 3 under torch.profiler: its summary, and one line of it
    profile = json.loads((run_dir / "profile" / "step_3_rank_0.json").read_text())
    assert profile["step"] == 3 and profile["by_kind_s"]["optimizer"] > 0
    assert "profile of step 3 (rank 0): " in out
    assert "reference (in the trainer)" in out
    assert not any(line.strip().startswith("reference ready") for line in out.splitlines()), out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if r.get("trainer/profiled")] == [3]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[0]["kl"] == 0  # B starts at zero: the policy is its base
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    # over 30 steps the 5-step mean rose by 0.18-0.66 on seeds 0-7 (bench/tiny_learning.py
    # --lag 1); a broken sign, advantage or adapter sync leaves it where it started
    assert last >= first + 0.1, (first, last)
    model = run_dir / "model"
    assert f"adapter -> {model}" in out
    assert (model / "adapter_model.safetensors").is_file()
    config = json.loads((model / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32)
    out_file = tmp_path / "eval.json"
    assert cli_main(["eval", str(run_dir), "--out", str(out_file)]) == 0
    offline = json.loads(out_file.read_text())
    assert offline["step"] == 30 and 0 <= offline["eval/pass@1"] <= 1
    final = [r for r in rows if "eval/pass@1" in r][-1]
    assert offline["eval/pass@1"] == pytest.approx(final["eval/pass@1"])


def test_a_run_with_wandb_offline_ends_without_a_traceback(tmp_path: Path, nothing_left):
    # (wandb's exit hook said goodbye to its service process after the run's clean-up had
    # ended it: a ConnectionResetError traceback after every run)
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--steps", "2", "--run-dir", str(run_dir), "--wandb", "offline"]
    proc = start(args, env={"HOME": str(tmp_path / "home")})
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    assert "finished at step 2" in out
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb")), out
    nothing_left(out, proc.pid)  # no "Traceback" among the rest


def test_sigterm_checkpoints_exits_zero_and_the_rerun_resumes(tmp_path: Path, nothing_left):
    run_dir = tmp_path / "run"
    # at a price a node-hour (what launch sets from the plan): the run counts its dollars
    price = ["--set", "resources.usd_per_node_hour=36", "--set", "resources.price_source=a test"]
    args = ["--recipe", "tiny", "--steps", "12", "--run-dir", str(run_dir), *price]
    proc = start(args)
    wait_for_line(proc, "step 4/12", timeout=600)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, timeout=60)
    assert time.monotonic() - sent < 30
    assert code == 0, out
    nothing_left(out, proc.pid)
    stopped_at = metrics(run_dir)[-1]["step"]
    assert f"checkpoint step {stopped_at}" in out
    assert stopped_at < 12
    assert not (run_dir / "model").exists()  # a stopped run leaves checkpoints, not a model

    again = start(args)
    code, out = finish(again, timeout=600)
    assert code == 0, out
    assert f"reading the checkpoint of step {stopped_at} (" in out
    assert f"resumed from step {stopped_at}" in out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["policy_version"] == 12
    assert json.loads((run_dir / "model/forgesky.json").read_text())["step"] == 12
    # the clock and the dollars carry over the restart, which counts as a recovery
    spent = [r["cost/usd"] for r in rows]
    assert all(0 < a < b for a, b in zip(spent, spent[1:], strict=False)), spent
    assert "recovery/count" not in rows[stopped_at - 1] and rows[-1]["recovery/count"] == 1
    assert rows[-1]["time/run_s"] > rows[stopped_at - 1]["time/run_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recoveries"] == 1 and summary["steps"] == 12
    assert summary["cost_usd"] >= round(spent[-1], 2)
    assert summary["usd_per_1k_samples"] > 0 and summary["measured_wall_s"] > 0
    assert f"${summary['cost_usd']:,.2f} (a test)" in out


def test_sigint_stops_cleanly(tmp_path: Path, nothing_left):
    proc = start(["--recipe", "tiny", "--steps", "50", "--run-dir", str(tmp_path / "run")])
    wait_for_line(proc, "step 2/50", timeout=600)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == 0, out
    assert "stopping" in out
    nothing_left(out, proc.pid)


# while the procs spawn, and while they set up (the reward proc is ready long before the rest)
@pytest.mark.parametrize("line", ["starting services", "  reward ready"])
def test_sigint_during_start_up_stops_at_once_and_saves_nothing(
    tmp_path: Path, line: str, nothing_left
):
    # Start-up takes a minute on two busy cores; the stop does not wait for it.
    run_dir = tmp_path / "run"
    proc = start(["--recipe", "tiny", "--steps", "50", "--run-dir", str(run_dir)])
    wait_for_line(proc, line, timeout=600)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc, timeout=60)
    took = time.monotonic() - sent
    assert code == 0, out
    assert took < 10, (took, out)
    assert "forgesky: stopping: start-up abandoned, nothing was trained" in out
    assert "checkpoint" not in out and "step 1/50" not in out, out
    assert not list(run_dir.glob("checkpoints/step_*"))
    nothing_left(out, proc.pid)


def test_second_sigint_forces_exit(tmp_path: Path, nothing_left):
    proc = start(["--recipe", "tiny", "--steps", "50", "--run-dir", str(tmp_path / "run")])
    wait_for_line(proc, "step 1/50", timeout=600)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc, timeout=20)
    assert code == 130, out
    time.sleep(0.5)
    nothing_left(out, proc.pid, noise=())  # a forced exit may print what it interrupted


def test_reward_failure_ends_the_run_with_its_root_cause(tmp_path: Path, nothing_left):
    recipe = yaml.safe_load((ROOT / "recipes/catalog/tiny.yaml").read_text())
    recipe["name"] = "tiny-faulty"
    recipe["dataset"]["rewards"] = [{"name": "faulty_rewards:explode"}]
    path = tmp_path / "faulty.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = start(["--recipe", str(path), "--run-dir", str(tmp_path / "run")])
    wait_for_line(proc, "services ready", timeout=600)
    began = time.monotonic()
    code, out = finish(proc, timeout=60)
    assert time.monotonic() - began < 30
    assert code == 1, out
    assert "reward actor failed: ZeroDivisionError: division by zero" in out
    assert "faulty_rewards.py" in out
    nothing_left(out, proc.pid)


def test_a_service_that_stops_answering_ends_the_run_within_its_bound(tmp_path: Path, nothing_left):
    # The reward proc stays alive but its endpoint never returns after two steps' scoring:
    # the watchdog's bound for a score call (at least watchdog.min_s) ends the run, naming the
    # service, the call, the bound and when each service last answered.
    recipe = yaml.safe_load((ROOT / "recipes/catalog/tiny.yaml").read_text())
    recipe["name"] = "tiny-stuck"
    recipe["dataset"]["rewards"] = [{"name": "faulty_rewards:hang"}]
    recipe["eval"]["enabled"] = False
    path = tmp_path / "stuck.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = ["--recipe", str(path), "--run-dir", str(tmp_path / "run")]
    args += ["--set", "watchdog.min_s=15", "--set", "watchdog.factor=5"]
    proc = start(args, env={"FAULTY_REWARD_AFTER": "600"})
    wait_for_line(proc, "services ready", timeout=600)
    began = time.monotonic()
    code, out = finish(proc, timeout=120)
    assert code == 1, out
    assert time.monotonic() - began < 60, out
    line = next(x for x in out.splitlines() if "actor failed" in x)
    assert line.startswith("forgesky: reward actor failed: stopped answering: score gave no ")
    assert "answer within 15 s (5 x the slowest of " in line
    assert "earlier score calls" in line and "at least watchdog.min_s 15 s)" in line
    # every service's last answer, newest first (any order between them)
    answers = line.split("last answers: ", 1)[1]
    assert "trainer " in answers and "generator0 " in answers and "reward score " in answers
    nothing_left(out, proc.pid)


def test_bad_recipe_is_one_line_and_exit_2(tmp_path: Path):
    proc = start(["--recipe", "tiny", "--set", "grpo.group_sise=4", "--run-dir", str(tmp_path)])
    code, out = finish(proc, timeout=120)
    assert code == 2
    assert len(out.strip().splitlines()) == 1, out
    assert "group_sise" in out
    kill_tree(proc)
