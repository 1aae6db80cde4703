"""What `forgesky local` refuses about its run dir and W&B before anything starts: one line on
stderr, exit code 2, within about a second, nothing written or overwritten."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import free_port

from recipes import UserError, load_recipe, plan
from runtime.control import checkpoint
from runtime.control.metrics import check_wandb_login
from runtime.control.run import prepare_run_dir, recorded_config, write_recorded
from runtime.entry import parse_config

FORGESKY = Path(sys.executable).parent / "forgesky"
HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024}


def forgesky_local(cwd: Path, *argv: str, env: dict[str, str] | None = None):
    """`forgesky local tiny ARGV` in its own session: (exit code, stderr, seconds). A run that
    gets past the checks is stopped (with everything it started) after 20 s."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(FORGESKY), "local", "tiny", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"not refused: still running after 20 s\n{err}")
    return proc.returncode, err, time.monotonic() - start


def assert_refused(result, *fragments: str) -> str:
    code, err, _ = result  # (about 0.2 s; what shows it came first is that nothing was written)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("forgesky: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (to check that nothing was written)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def hand_made_run_dir(root: Path, *overrides: str, metrics: bool = True) -> Path:
    """A run dir of the tiny recipe as a run leaves it: the config.json run.py records, a
    committed checkpoint (its marker as checkpoint.py writes it) and metrics.jsonl."""
    from recipes import apply_overrides

    recipe = load_recipe("tiny")
    if overrides:
        recipe = apply_overrides(recipe, list(overrides))
    root.mkdir(parents=True)
    write_recorded(root, recorded_config(recipe, plan(recipe, 0)))
    partial = checkpoint.begin(root / "checkpoints", 2)
    (partial / "trainer.pt").write_bytes(b"weights")
    checkpoint.commit(root / "checkpoints", partial, 2)
    if metrics:
        (root / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    return root


def check(run_dir: Path, *argv: str) -> None:
    """The runtime's checks of its run dir, in this process (nothing starts)."""
    prepare_run_dir(parse_config(["--recipe", "tiny", "--run-dir", str(run_dir), *argv]))


# --- bug 1: a run dir that is a file, or cannot be created -----------------------------------


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    assert_refused(forgesky_local(tmp_path, "--run-dir", "afile"), "afile", "not a folder")
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize("where", ["/proc/forgesky-run", "afile/run"])
def test_a_run_dir_that_cannot_be_created_is_refused(tmp_path, where):
    (tmp_path / "afile").write_text("mine\n")
    assert_refused(forgesky_local(tmp_path, "--run-dir", where), where, "cannot create")
    assert not Path(where).exists()
    assert contents(tmp_path) == {"afile": b"mine\n"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_run_dir_that_cannot_be_written_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert_refused(forgesky_local(tmp_path, "--run-dir", "locked"), "cannot write")
    finally:
        locked.chmod(0o755)


# --- bug 2: a folder that holds something and is not a run dir -------------------------------


def test_a_model_folder_is_refused_and_left_as_it_was(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(HF_CONFIG, indent=2))
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "tokenizer.json").write_text("{}")
    before = contents(model)
    result = forgesky_local(tmp_path, "--steps", "2", "--run-dir", "model")
    assert_refused(result, "model", "config.json", "not a forgesky run")
    assert contents(model) == before
    assert sorted(p.name for p in model.iterdir()) == sorted(before)


def test_a_folder_of_other_files_is_refused(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine\n")
    result = forgesky_local(tmp_path, "--steps", "2", "--run-dir", "notes")
    assert_refused(result, "notes", "not a forgesky run directory")
    assert contents(other) == {"todo.txt": b"mine\n"}
    # beside a checkpoints/ folder too
    (other / "checkpoints").mkdir()
    with pytest.raises(UserError, match="not a forgesky run directory"):
        check(other)


def test_empty_new_and_run_folders_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    check(empty)
    check(tmp_path / "new" / "run")  # created, parents and all
    assert (tmp_path / "new" / "run").is_dir()
    # a run killed right after its services started: its config.json and an empty metrics.jsonl
    started = tmp_path / "started"
    started.mkdir()
    recipe = load_recipe("tiny")
    write_recorded(started, recorded_config(recipe, plan(recipe, 0)))
    (started / "metrics.jsonl").touch()
    check(started)
    # only metrics.jsonl, or a committed checkpoint beside a config.json cut short
    (tmp_path / "metrics_only").mkdir()
    (tmp_path / "metrics_only" / "metrics.jsonl").touch()
    check(tmp_path / "metrics_only")
    cut = hand_made_run_dir(tmp_path / "cut", metrics=False)
    (cut / "config.json").write_text('{"name": "tiny", "mod')
    check(cut)
    # a new run whose checkpoints/ was made beforehand: a link to a folder on a larger disk
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "big_disk").mkdir()
    (linked / "checkpoints").symlink_to(tmp_path / "big_disk", target_is_directory=True)
    check(linked)
    (tmp_path / "premade" / "checkpoints").mkdir(parents=True)
    check(tmp_path / "premade")
    # and a whole run dir, resumed with other steps and learning rate (documented)
    run = hand_made_run_dir(tmp_path / "run")
    before = contents(run)
    check(run, "--steps", "5", "--set", "grpo.learning_rate=1e-3")
    assert contents(run) == before


def test_an_unreadable_config_json_alone_is_refused(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("not json")
    with pytest.raises(UserError, match="unreadable config.json"):
        check(tmp_path / "odd")


# --- bug 3: W&B online without credentials ----------------------------------------------------


def _no_wandb_credentials(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(home)}  # no ~/.netrc, no ~/.config/wandb


def test_wandb_online_without_credentials_is_refused_before_the_run_dir_exists(tmp_path):
    env = _no_wandb_credentials(tmp_path)
    result = forgesky_local(tmp_path, "--wandb", "online", "--run-dir", "run", env=env)
    assert_refused(result, "WANDB_API_KEY", "--wandb offline")
    assert not (tmp_path / "run").exists()
    # WANDB_MODE=online says the same
    env["WANDB_MODE"] = "online"
    assert_refused(forgesky_local(tmp_path, "--run-dir", "run", env=env), "WANDB_API_KEY")
    assert not (tmp_path / "run").exists()


def test_wandb_online_with_its_server_out_of_reach_is_refused_before_the_run_dir_exists(
    tmp_path,
):
    # (wandb.init retried without end, once every service had started)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**_no_wandb_credentials(tmp_path), "WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": url}
    result = forgesky_local(tmp_path, "--wandb", "online", "--run-dir", "run", env=env)
    assert_refused(result, f"W&B online cannot reach {url}: ", "Connection refused", "offline")
    assert not (tmp_path / "run").exists()


def test_wandb_credentials_from_the_environment_or_a_login_pass(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for mode in ("offline", "disabled"):
        check_wandb_login(mode)
    with pytest.raises(UserError, match="WANDB_API_KEY"):
        check_wandb_login("online")
    # what `wandb login` writes
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n")
    (tmp_path / "netrc").chmod(0o600)
    check_wandb_login("online")
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    check_wandb_login("online")


# --- bug 4: resuming checkpoints of another model ---------------------------------------------


def test_resuming_checkpoints_of_another_model_is_refused(tmp_path):
    run = hand_made_run_dir(tmp_path / "run")
    before = contents(run)
    result = forgesky_local(tmp_path, "--run-dir", "run", "--set", "model.size=tiny-gpu")
    line = assert_refused(result, "qwen3 tiny)", "qwen3 tiny-gpu)", "new --run-dir")
    assert "run dir run" in line
    assert contents(run) == before


def test_a_run_dir_without_a_checkpoint_takes_another_model(tmp_path):
    """Nothing to resume: the run starts from step 0 and records its own recipe."""
    run = hand_made_run_dir(tmp_path / "run")
    for ckpt in checkpoint.committed(run / "checkpoints"):
        (ckpt.path / checkpoint.MARKER).unlink()
    check(run, "--set", "model.size=tiny-gpu")


def test_a_resume_with_fewer_steps_than_its_checkpoint_reached_is_refused(tmp_path):
    run = hand_made_run_dir(tmp_path / "run")  # a checkpoint of step 2
    before = contents(run)
    result = forgesky_local(tmp_path, "--run-dir", "run", "--steps", "1")
    assert_refused(result, "is at step 2 already", "1 steps", "raise --steps")
    assert contents(run) == before
    # at that step exactly (a managed job restarted after its last checkpoint) it is no error
    check(run, "--steps", "2")
    check(run, "--steps", "3")
