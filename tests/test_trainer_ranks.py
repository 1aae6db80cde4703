"""The trainer service on several procs: one FSDP rank per trainer GPU, every endpoint called on
all ranks. On CPU `--set trainer.ranks=2` runs two gloo ranks through the real runtime."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import NOISE, finish, leftover_processes, metrics, start

from recipes import UserError, apply_overrides, architecture, load_recipe, plan
from runtime.backends import OptimizerConfig, TitanTrainer, checkpoint_read, trainer_state
from runtime.backends.fsdp_trainer import WORLD_ENV
from runtime.control import checkpoint
from runtime.control.startup import group_env, trainer_ranks
from runtime.models import ModelSpec


def test_one_trainer_proc_per_gpu_and_cpu_ranks_as_planned():
    assert trainer_ranks((), 1) == [()]  # CPU: one proc, as before
    assert trainer_ranks((), 2) == [(), ()]  # CPU: gloo ranks
    assert trainer_ranks((4, 5, 6, 7), 4) == [(4,), (5,), (6,), (7,)]
    cpu = load_recipe("tiny")
    assert plan(apply_overrides(cpu, ["trainer.ranks=2"]), 0).settings.trainer.ranks == 2
    gpu = apply_overrides(load_recipe("qwen3-8b"), ["layout.share=none"])
    assert plan(gpu, 5).settings.trainer.ranks == 2  # one per trainer GPU
    with pytest.raises(
        UserError, match=r"trainer.ranks: 3 must be auto or layout.trainer.gpus \(2\)"
    ):
        apply_overrides(gpu, ["trainer.ranks=3"])


def test_several_ranks_meet_on_a_free_local_port():
    assert group_env(1) == {}  # one proc starts exactly as before
    env = group_env(4)
    assert env[WORLD_ENV] == "4" and env["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(env["MASTER_PORT"]) < 65536


@pytest.mark.slow
def test_tiny_run_on_two_trainer_ranks_checkpoints_and_resumes(tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--checkpoint-every", "2", "--run-dir", str(run_dir)]
    args += ["--set", "trainer.ranks=2"]
    proc = start([*args, "--steps", "4"])
    code, out = finish(proc, timeout=300)
    assert code == 0, out
    assert (
        "trainer: FSDPTrainer on 2 ranks, 8192 tokens per micro-batch, "
        "activation checkpointing off" in out
    )
    for word in NOISE:
        assert word not in out, f"{word!r} in output:\n{out}"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward/mean", "loss", "grad_norm", "policy_version", "time/publish_s"):
        assert key in rows[0], key
    # each rank wrote its own shards (DCP), which together are the whole model; a rank's
    # files are written by trainer_state.WRITE_THREADS threads at once
    step_dir = run_dir / "checkpoints/step_000004"
    files = sorted(p.name for p in (step_dir / "trainer").glob("*.distcp"))
    assert {f.split("_")[2] for f in files} == {"0", "1"}, files
    assert 2 < len(files) <= 2 * trainer_state.WRITE_THREADS, files
    saved = trainer_state.read_all(step_dir)
    spec = ModelSpec.from_arch(architecture("qwen3", "tiny"))
    fresh = dict(TitanTrainer(spec, OptimizerConfig()).model.named_parameters())
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in fresh.items()}
    assert saved["step"] == 4

    # the resumed run also publishes through rank 0's direct push path
    again = start([*args, "--steps", "6", "--set", "weight_sync.transport=push"])
    code, out = finish(again, timeout=300)
    assert code == 0, out
    assert "resumed from step 4" in out
    assert "weights reach the generators by: push" in out
    # each service says when it is up, between `starting services` and `services ready`
    started, ready = out.index("starting services"), out.index("services ready")
    for service in ("trainer", "generator0", "reward"):
        line = re.search(rf"^  {service} ready \((\d+\.\d) s\)$", out, re.M)
        assert line and started < line.start() < ready, service
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["policy_version"] == 6
    # the model the two ranks exported at the end, a gathered group at a time, holds the last
    # checkpoint's weights
    from transformers import AutoModelForCausalLM

    from runtime.models.hf import to_hf

    want = to_hf(checkpoint_read.model_weights(run_dir / "checkpoints/step_000006", spec), spec)
    got = AutoModelForCausalLM.from_pretrained(run_dir / "model").state_dict()
    compared = [k for k in want if k in got]
    assert len(compared) >= len(want) - 1
    assert all(torch.equal(got[k], want[k]) for k in compared)
    time.sleep(0.5)
    assert leftover_processes(again.pid) == []


@pytest.mark.slow
def test_a_reference_sharded_over_two_ranks_scores_like_the_policy(tmp_path: Path):
    """reference.ranks=2: two procs, the frozen model sharded over them (FSDP2, gloo), each
    scoring its share of every batch's rows; put back in order, the first step's KL between
    the policy and its own initial weights is 0."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--run-dir", str(run_dir), "--steps", "2"]
    proc = start([*args, "--set", "reference.ranks=2", "--set", "grpo.kl_beta=0.1"])
    code, out = finish(proc, timeout=300)
    assert code == 0, out
    assert "reference   ranks 2," in out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["kl"]) < 1e-5, rows[0]["kl"]
    assert rows[1]["kl"] > 0  # after a step the policy has moved away from the reference


@pytest.mark.slow
def test_one_rank_raising_ends_the_run_while_the_other_waits_in_a_collective(tmp_path: Path):
    """Rank 0 raises in its loss; rank 1 is then in the backward's reduce-scatter, waiting for
    rank 0 forever. The run must not wait for rank 1's answer: it ends on rank 0's error, at
    once, naming it, and leaves nothing running."""
    args = ["--recipe", "tiny", "--run-dir", str(tmp_path / "run"), "--steps", "4"]
    args += ["--set", "trainer.ranks=2", "--set", "grpo.loss=failing_losses:rank_0_raises"]
    proc = start(args)
    began = time.monotonic()
    code, out = finish(proc, timeout=240)
    took = time.monotonic() - began
    assert code not in (0, None), out
    assert "rank 0 fails on purpose" in out, out[-3000:]
    failure = next(line for line in out.splitlines() if "rank 0 fails on purpose" in line)
    assert "trainer" in failure, failure
    # start-up (the procs, the tiny model) takes ~20 s on 2 cores; a wait for rank 1 would
    # last until the watchdog's first-call bound (1800 s) or gloo's timeout
    assert took < 120, f"{took:.0f} s:\n{out[-3000:]}"
    time.sleep(0.5)
    assert leftover_processes(proc.pid) == []


@pytest.mark.slow
@pytest.mark.parametrize("first", ["after", "before"])
def test_the_rank_out_of_memory_is_named_when_its_peer_fails_in_a_collective(
    tmp_path: Path, first: str
):
    """Rank 1 runs out of memory in its step and leaves the collective rank 0 waits for it in;
    rank 0's collective fails (`Connection closed by peer`) 1.5 s before rank 1's error
    reaches the controller, or after it (tests/failing_losses.py). Either way the run ends on
    rank 1's out-of-memory error, naming its proc, as soon as it comes: not on rank 0's
    error after the wait for a lost peer's own failure (15 s) that the run once ended with."""
    from fault_runs import RuntimeRun

    from runtime.control.services import RANK_CAUSE_GRACE_S

    loss = f"failing_losses:rank_1_out_of_memory_{first}_its_peer_fails"
    args = ["--recipe", "tiny", "--run-dir", str(tmp_path / "run"), "--steps", "4"]
    args += ["--set", "trainer.ranks=2", "--set", f"grpo.loss={loss}"]
    log = tmp_path / "run.log"
    run = RuntimeRun(args, log=log)
    try:
        code = run.finish(timeout=240)
    finally:
        if run.proc.poll() is None:
            run.kill()
    out = run.output
    assert code == 1, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("forgesky:") and "failed" in x]
    assert lines and lines[0].startswith(
        "forgesky: trainer actor failed: OutOfMemoryError: CUDA out of memory."
    ), out[-3000:]
    assert "(proc 1/2)" in lines[0], lines[0]
    # the line came within the ranks' grace of rank 1's error (the log's seconds since start)
    at = {}
    for entry in log.read_text().splitlines():
        for key in ("failing_losses: rank 1 out of memory", "forgesky: trainer actor failed"):
            if key in entry:
                at.setdefault(key, float(entry[1:8]))
    assert len(at) == 2, log.read_text()[-3000:]
    named = at["forgesky: trainer actor failed"] - at["failing_losses: rank 1 out of memory"]
    assert named < RANK_CAUSE_GRACE_S, (named, log.read_text()[-3000:])
    time.sleep(0.5)
    assert leftover_processes(run.proc.pid) == []


@pytest.mark.slow
def test_nan_gradients_stop_the_run_before_the_weights_change(tmp_path: Path):
    """A backward that gives NaN while its loss is finite (tests/failing_losses.py, a step or
    two in, two ranks): every rank refuses the optimizer step, the run ends on one line naming
    the step, and the checkpoints hold only finite weights of the steps before it, the step
    before's included (its write, under way when the step failed, is finished first)."""
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny", "--run-dir", str(run_dir), "--steps", "6"]
    args += ["--checkpoint-every", "1", "--set", "trainer.ranks=2"]
    proc = start([*args, "--set", "grpo.loss=failing_losses:nan_gradients"])
    began = time.monotonic()
    code, out = finish(proc, timeout=300)
    took = time.monotonic() - began
    assert code not in (0, None), out
    lines = [line for line in out.splitlines() if "the gradient norm is nan" in line]
    assert lines, out[-3000:]
    found = re.search(r"training step (\d+): the gradient norm is nan; the optimizer", lines[0])
    assert found, lines[0]
    failed = int(found.group(1))
    assert "trainer" in lines[0], lines[0]
    # no step at or past the failing one was recorded, checkpointed or published
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, failed)), (failed, rows)
    # the step before's checkpoint, still on its way to disk when the step failed, was
    # finished and committed before the run ended (grpo.checkpoint_finish_s)
    committed = checkpoint.committed(run_dir / "checkpoints")
    assert committed and max(c.step for c in committed) == failed - 1, (failed, committed)
    assert f"the checkpoint of step {failed - 1} was still in flight" in out, out[-3000:]
    for ckpt in committed:
        saved = trainer_state.read_all(ckpt.path)
        assert all(torch.isfinite(t).all() for t in saved["model"].values()), ckpt
    assert took < 120, f"{took:.0f} s:\n{out[-3000:]}"
    time.sleep(0.5)
    assert leftover_processes(proc.pid) == []


def test_a_nan_gradient_norm_under_an_mps_share_names_the_share(monkeypatch):
    from runtime.backends.base import NonFiniteGradients, finite_grad_norm

    assert finite_grad_norm(torch.tensor(2.5), 3) == 2.5
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    with pytest.raises(NonFiniteGradients) as plain:
        finite_grad_norm(float("inf"), 4)
    assert "training step 4: the gradient norm is inf" in str(plain.value)
    assert "MPS" not in str(plain.value)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "70")
    with pytest.raises(NonFiniteGradients) as held:
        finite_grad_norm(torch.tensor(float("nan")), 1)
    text = str(held.value)
    assert "the weights stay step 0's" in text
    assert "under MPS at 70 % of the GPU's SMs (layout.mps_sm_percent.trainer)" in text
    assert "\n" not in text
