"""SFT on the trainer actor's ranks (real Monarch procs, two gloo ranks of FSDPTrainer): the
losses and weights of the one-process run, and a run resumed from its checkpoint is the
unbroken one."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from runtime_helpers import NOISE, finish, metrics, start, wait_for_line

from recipes import apply_overrides, load_recipe

# 4 steps, a checkpoint at step 2 and at the end; a held-out loss at the start and the end
OVERRIDES = ["sft.warmup_steps=1", "sft.steps=4", "sft.checkpoint_interval=2"]
KEYS = ("loss", "grad_norm", "lr", "tokens", "trained_tokens", "rows", "eval/loss")
# Two ranks sum the loss in another order, and FSDP reduce-scatters the gradients (fp32):
# the weights after 4 steps differ by about 1e-6 (seen: 1.3e-6), the losses by about 1e-7.
TOLERANCE = 1e-5


def _on_two_ranks(run_dir: Path, gather_once: bool = False) -> str:
    args = ["--recipe", "tiny-sft", "--run-dir", str(run_dir), "--set", "trainer.ranks=2"]
    args += ["--set", f"trainer.gather_once={str(gather_once).lower()}"]
    args += ["--set", "trainer.profile_step=2"]  # each rank profiles itself
    for o in OVERRIDES:
        args += ["--set", o]
    code, out = finish(start(args), timeout=600)
    assert code == 0, out
    for word in NOISE:
        assert word not in out, f"{word!r} in output:\n{out}"
    once = ", the weights gathered once a step" if gather_once else ""
    assert f"trainer: FSDPTrainer on 2 ranks (cpu){once}\n" in out, out
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("gather_once", [False, True], ids=["reshard", "gather_once"])
def test_two_trainer_ranks_train_as_one_process_and_resume(tmp_path: Path, gather_once: bool):
    """Either way the ranks run a step's micro-batches (trainer.gather_once: the weights
    gathered and the gradients reduced once a step)."""
    from runtime.sft.run import run

    ranks, one, resumed = tmp_path / "ranks", tmp_path / "one", tmp_path / "resumed"
    _on_two_ranks(ranks, gather_once)
    run(apply_overrides(load_recipe("tiny-sft"), OVERRIDES), one, log=lambda _: None)
    a, b = metrics(ranks), metrics(one)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(5))
    for got, want in zip(a, b, strict=True):
        for key in KEYS:
            if isinstance(want.get(key), float):
                assert abs(got[key] - want[key]) <= TOLERANCE, (got["step"], key)
            else:
                assert got.get(key) == want.get(key), (got["step"], key)
    wa, wb = _weights(ranks), _weights(one)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=TOLERANCE)
    assert json.loads((ranks / "model" / "forgesky.json").read_text())["step"] == 4
    profiles = sorted(p.name for p in (ranks / "profile").iterdir())
    assert profiles == ["step_2_rank_0.json", "step_2_rank_1.json"]
    assert json.loads((ranks / "profile" / profiles[1]).read_text())["rank"] == 1
    # each step's record counts what the trainer compiled during it: nothing, uncompiled
    assert [r.get("compile/graphs") for r in a if r["step"] > 0] == [0.0] * 4
    assert [r.get("compile/ranks_max/graphs") for r in a if r["step"] > 0] == [0.0] * 4
    # and where a step's time went: the wait for the rows, the ranks' own step
    for r in (r for r in a if r["step"] > 0):
        assert 0 <= r["time/data_s"] < r["time/step_s"] and 0 < r["time/train_s"] < r["time/step_s"]

    # what a preempted run leaves after its checkpoint of step 2, resumed on two ranks
    resumed.mkdir()
    shutil.copy(ranks / "config.json", resumed / "config.json")
    step2 = Path("checkpoints") / "step_000002"
    shutil.copytree(ranks / step2, resumed / step2)
    kept = [line for line in (ranks / "metrics.jsonl").read_text().splitlines()]
    kept = [line for line in kept if json.loads(line)["step"] <= 2]
    (resumed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    out = _on_two_ranks(resumed, gather_once)
    assert "resuming from the checkpoint of step 2" in out, out
    c = metrics(resumed)
    assert [r["step"] for r in c] == list(range(5))
    assert [[r.get(k) for k in KEYS] for r in c] == [[r.get(k) for k in KEYS] for r in a]
    wc = _weights(resumed)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def test_bad_data_on_trainer_ranks_is_one_line_before_any_proc_starts(tmp_path: Path):
    args = ["--recipe", "tiny-sft", "--run-dir", str(tmp_path / "run")]
    args += ["--set", "trainer.ranks=2", "--set", "dataset.messages_field=chat"]
    code, out = finish(start(args), timeout=120)
    assert code == 2, out
    assert out.strip().splitlines() == [
        f"forgesky: error: dataset '{load_recipe('tiny-sft').dataset.path}': "
        "dataset.messages_field "
        "'chat' is not a field of the data (format messages); its fields: messages"
    ], out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 1], ids=["trainer-ranks", "one-process"])
def test_a_stopped_sft_run_checkpoints_its_last_step_and_exits_zero(
    tmp_path: Path, nothing_left, ranks: int
):
    """SIGTERM mid-run (what a preempted node or `kill` sends): the run ends at its step
    boundary, writes the checkpoint of its last step (none was due: no periodic ones) and
    exits 0 with no model folder, as a GRPO run does; on the trainer actor's ranks and in the
    one process alike."""
    from runtime.control import checkpoint

    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-sft", "--run-dir", str(run_dir), "--set", f"trainer.ranks={ranks}"]
    args += ["--set", "sft.steps=500", "--set", "sft.checkpoint_interval=0"]
    proc = start(args)
    wait_for_line(proc, "step 3/500", timeout=300)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, timeout=120)
    assert code == 0, out
    assert "forgesky: stopping: finishing" in out, out
    stopped_at = metrics(run_dir)[-1]["step"]
    assert 3 <= stopped_at < 500, out
    assert f"checkpoint step {stopped_at} -> " in out, out
    assert f"stopped at step {stopped_at}; outputs in {run_dir}" in out, out
    last = checkpoint.latest(run_dir / "checkpoints")
    assert last is not None and last.step == stopped_at
    assert json.loads((last.path / "sft_state.json").read_text())["step"] == stopped_at
    assert not (run_dir / "model").exists()
    nothing_left(out, proc.pid)
