"""How often a run checkpoints, what a crash while rewriting a checkpoint leaves behind, and a
finished run started again.

The checkpoints' contents and the resume itself are checked on real runs in test_faults.py.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from runtime_helpers import finish, start, tiny_run_dir

from launcher.cli import main as forgesky
from recipes import UserError, load_recipe
from runtime.control import checkpoint
from runtime.control.run import finished_already
from runtime.entry import parse_config


def test_checkpoint_every_sets_the_recipes_interval():
    recipe_value = load_recipe("tiny").grpo.checkpoint_interval
    assert parse_config(["--recipe", "tiny"]).recipe.grpo.checkpoint_interval == recipe_value
    assert recipe_value != 3
    config = parse_config(["--recipe", "tiny", "--checkpoint-every", "3"])
    assert config.recipe.grpo.checkpoint_interval == 3
    # 0: only at the end and on a stop
    assert (
        parse_config(
            ["--recipe", "tiny", "--checkpoint-every", "0"]
        ).recipe.grpo.checkpoint_interval
        == 0
    )
    with pytest.raises(UserError, match="--checkpoint-every must be >= 0"):
        parse_config(["--recipe", "tiny", "--checkpoint-every", "-1"])


def test_forgesky_local_passes_checkpoint_every_to_the_runtime(capsys):
    # a bad value is refused by the runtime's own parser, before anything starts
    assert forgesky(["local", "tiny", "--checkpoint-every", "-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["forgesky: error: --checkpoint-every must be >= 0 (got -2)"]


def _write(root, step, payload=b"weights"):
    d = checkpoint.begin(root, step)
    (d / "trainer.pt").write_bytes(payload)
    (d / "controller.pt").write_bytes(b"state")
    return checkpoint.commit(root, d, step)


def test_a_crash_while_replacing_a_checkpoint_falls_back_to_the_one_before(tmp_path, monkeypatch):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    partial = checkpoint.begin(tmp_path, 4)
    (partial / "trainer.pt").write_bytes(b"newer weights")

    def crash_mid_delete(path, *args, **kwargs):
        # the process dies after removing the old step_000004's weights
        (path / "trainer.pt").unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", crash_mid_delete)
    with pytest.raises(SystemExit):
        checkpoint.commit(tmp_path, partial, 4)
    monkeypatch.undo()
    # step 4 lost its marker before anything else: not trusted, and not a damaged-checkpoint
    # error that would stop every restart
    assert checkpoint.latest(tmp_path).step == 2


def test_the_last_three_are_kept_by_default(tmp_path):
    for step in range(1, 7):
        _write(tmp_path, step)
    assert [c.step for c in checkpoint.committed(tmp_path)] == [4, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000004",
        "step_000005",
        "step_000006",
    ]


def test_a_newest_checkpoint_missing_a_file_is_skipped_for_the_one_before(tmp_path, capsys):
    # A bucket mounted with MOUNT_CACHED uploads in the background: a node that went away may
    # leave a marker whose files did not all arrive. Resuming from the one before beats stopping.
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    (newest.path / "trainer.pt").unlink()
    assert checkpoint.latest(tmp_path).step == 2
    err = capsys.readouterr().err
    assert "warning: skipping checkpoint step_000004" in err and "trainer.pt" in err
    (tmp_path / "step_000002" / "controller.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"step_000004/trainer.pt: checkpoint file is cut short"):
        checkpoint.latest(tmp_path)


def test_a_finished_run_started_again_says_so_and_starts_nothing(tmp_path):
    # (every service started, 54 s on two cores, to train nothing)
    (tmp_path / "run").mkdir()
    run_dir = tiny_run_dir(tmp_path / "run", steps=(3, 7))
    args = ["--recipe", "tiny", "--steps", "7", "--run-dir", str(run_dir)]
    done = f"forgesky: run dir {run_dir} is at step 7 of 7 already: nothing to train"
    # ended before writing its model: written from the checkpoint, still without the services
    code, out = finish(start(args), timeout=300)
    assert code == 0, out
    assert out.splitlines() == [
        f"{done}, no service started; writing its model from that checkpoint (~0.3 MB of "
        "float32 safetensors) ...",
        f"model -> {run_dir / 'model'} (Hugging Face format: transformers, vLLM)",
    ], out
    assert json.loads((run_dir / "model/forgesky.json").read_text())["step"] == 7
    # with its model: one line, at once
    began = time.monotonic()
    code, out = finish(start(args), timeout=60)
    assert code == 0, out
    assert out.splitlines() == [
        f"{done}, nothing started; its model is {run_dir / 'model'} (`forgesky eval {run_dir}` "
        f"evaluates it, `forgesky export {run_dir} --out DIR` writes it elsewhere); raise "
        "--steps to train on"
    ], out
    assert time.monotonic() - began < 10
    # with more steps the run goes on
    assert not finished_already(parse_config([*args[:3], "8", *args[4:]]))
