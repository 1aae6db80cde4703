"""Resuming a run dir refuses, before anything starts, checkpoints trained otherwise than the
recipe trains: a LoRA adapter's into a full run, a full run's into a LoRA run, and an adapter
of another rank, alpha or targets (one line, exit code 2, nothing written). The resume of a
LoRA run itself is checked bit for bit in test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes import UserError, apply_overrides, load_recipe, plan
from runtime.control import checkpoint
from runtime.control.run import prepare_run_dir, recorded_config, write_recorded
from runtime.entry import parse_config

ADAPTER = "a LoRA adapter (rank 16, alpha 32 on all-linear)"


def run_dir_of(root: Path, recipe_name: str, *overrides: str, record: bool = True) -> Path:
    """A run dir of `recipe_name` as a run leaves it: the recorded config (unless `record` is
    False: one lost), metrics.jsonl and a committed checkpoint of step 2 written by the
    trainer the recipe builds (its model.lora: the adapter and its moments alone)."""
    from runtime.backends import build
    from runtime.backends.titan_trainer import OptimizerConfig, TitanTrainer

    recipe = load_recipe(recipe_name)
    if overrides:
        recipe = apply_overrides(recipe, list(overrides))
    root.mkdir(parents=True)
    if record:
        write_recorded(root, recorded_config(recipe, plan(recipe, 0)))
    (root / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    trainer = TitanTrainer(
        build.model_spec(recipe), OptimizerConfig(lr=1e-3), lora=recipe.model.lora
    )
    partial = checkpoint.begin(root / "checkpoints", 2)
    trainer.save_checkpoint(str(partial))
    trainer.checkpoint_written(wait=True)
    checkpoint.commit(root / "checkpoints", partial, 2)
    return root


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(cwd: Path, argv: list[str]) -> tuple[str, float]:
    """ARGV (a `forgesky` or `python -m runtime` command line) refused: its one stderr line
    and its seconds. A run that gets past the checks is stopped after 30 s, and fails."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"not refused: still running after 30 s\n{err}")
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgesky: error: "), err
    return lines[0], time.monotonic() - start


def forgesky_local(recipe: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "local", recipe, *args]


def python_m_runtime(recipe: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "runtime", "--recipe", recipe, *args]


def check(run_dir: Path, recipe: str, *argv: str) -> None:
    """The runtime's checks of its run dir, in this process (nothing starts)."""
    prepare_run_dir(parse_config(["--recipe", recipe, "--run-dir", str(run_dir), *argv]))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    return run_dir_of(tmp_path_factory.mktemp("lora") / "run", "tiny-lora")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    return run_dir_of(tmp_path_factory.mktemp("full") / "run", "tiny")


def test_an_adapters_checkpoints_do_not_resume_into_a_full_run(lora_run):
    before = contents(lora_run)
    line, seconds = refused(lora_run.parent, forgesky_local("tiny", "--run-dir", "run"))
    assert line == (
        f"forgesky: error: run dir run holds checkpoints of {ADAPTER} and this recipe trains "
        "every parameter: it cannot resume them; use a new --run-dir"
    )
    assert seconds < 10  # (about a second: torch is not loaded)
    assert contents(lora_run) == before


def test_a_full_runs_checkpoints_do_not_resume_into_an_adapter(full_run):
    before = contents(full_run)
    line, _ = refused(full_run.parent, python_m_runtime("tiny-lora", "--run-dir", "run"))
    assert line == (
        "forgesky: error: run dir run holds checkpoints of every parameter and this recipe "
        f"trains {ADAPTER}: it cannot resume them; use a new --run-dir"
    )
    assert contents(full_run) == before


@pytest.mark.parametrize(
    ("change", "trains"),
    [
        ("model.lora.rank=8", "rank 8, alpha 32 on all-linear"),
        ("model.lora.alpha=8", "rank 16, alpha 8 on all-linear"),
        ("model.lora.targets=[q_proj,v_proj]", "rank 16, alpha 32 on q_proj, v_proj"),
    ],
)
def test_an_adapter_of_another_rank_alpha_or_targets_is_refused(lora_run, change, trains):
    line, _ = refused(
        lora_run.parent, python_m_runtime("tiny-lora", "--run-dir", "run", "--set", change)
    )
    assert line == (
        f"forgesky: error: run dir run holds checkpoints of {ADAPTER} and this recipe trains "
        f"one of {trains}: it cannot resume them; use a new --run-dir"
    )


def test_the_same_adapter_resumes(lora_run, full_run):
    check(lora_run, "tiny-lora")
    # alpha left out is 2 x rank: the same adapter as alpha 32 at rank 16
    check(lora_run, "tiny-lora", "--set", "model.lora.alpha=null")
    check(full_run, "tiny")


def test_without_a_recorded_config_the_checkpoint_says_what_it_trained(tmp_path):
    run = run_dir_of(tmp_path / "run", "tiny-lora", record=False)
    before = contents(run)
    line, _ = refused(tmp_path, python_m_runtime("tiny", "--run-dir", "run"))
    # rank and targets are in the checkpoint's shapes; alpha is not
    assert line == (
        "forgesky: error: run dir run holds checkpoints of a LoRA adapter (rank 16 on "
        "all-linear) and this recipe trains every parameter: it cannot resume them; use a new "
        "--run-dir"
    )
    with pytest.raises(UserError, match=r"rank 16 on all-linear\) and this recipe trains one of "):
        check(run, "tiny-lora", "--set", "model.lora.rank=8")
    with pytest.raises(UserError, match=r"rank 16 on all-linear\) .* one of rank 16 on k_proj: it"):
        check(run, "tiny-lora", "--set", "model.lora.targets=[k_proj]")
    check(run, "tiny-lora")
    check(run, "tiny-lora", "--set", "model.lora.alpha=4")  # (what it cannot know it lets by)
    assert contents(run) == before

    full = run_dir_of(tmp_path / "full", "tiny", record=False)
    with pytest.raises(UserError, match="holds checkpoints of every parameter and this recipe "):
        check(full, "tiny-lora")
    check(full, "tiny")
