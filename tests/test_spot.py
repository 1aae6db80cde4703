"""Managed spot jobs recover from a stop: the node script's exit code and SkyPilot's reading of it.

The runtime answers SIGTERM with a checkpoint and exit 0; on a managed job that would end the job
as a success. The node's run script reports such a stop as STOPPED_EXIT_CODE, and the task lists
that code in `job_recovery.recover_on_exit_codes`; SkyPilot's own strategy executor, built from
the rendered YAML, decides. Only the cloud is missing here.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import stat
import subprocess
import time

import pytest
import yaml

import sky
from launcher.cli import main
from launcher.scripts import STOPPED_EXIT_CODE, run_script

# A `python` that runs until SIGTERM, then exits with $STUB_CODE, like the runtime after it has
# checkpointed; with STUB_NOW set it exits with that code at once, unsignalled.
STUB = """#!/bin/sh
if [ -n "${STUB_NOW:-}" ]; then exit "$STUB_NOW"; fi
trap 'stop=1' TERM
echo started > "$HOME/started"
while [ -z "${stop:-}" ]; do sleep 0.05; done
exit "${STUB_CODE:-0}"
"""


@pytest.fixture
def node(tmp_path):
    """Start the run script under bash in its own session, with the stub as the runtime."""
    home = tmp_path / "home"
    bindir = home / "forgesky-venv" / "bin"
    bindir.mkdir(parents=True)
    stub = bindir / "python"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    script = run_script(recipe_name="tiny", recipe_ref="tiny", gated=False, run_dir="/ckpt/x")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "MODEL": "builtin:tiny",
        "MIN_GPUS": "0",
        "MAX_STEPS": "",
        "WANDB_MODE": "disabled",
    }

    def start(**extra: str) -> subprocess.Popen:
        (home / "started").unlink(missing_ok=True)
        proc = subprocess.Popen(
            ["bash", "-c", script], env={**env, **extra}, start_new_session=True, text=True
        )
        if "STUB_NOW" not in extra:
            deadline = time.monotonic() + 30
            while not (home / "started").exists():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
        return proc

    return start


@pytest.mark.parametrize("to", ["script", "session"])
@pytest.mark.parametrize("code", [0, 1, 2])
def test_a_stop_by_sigterm_exits_with_the_recovery_code(node, to, code):
    # SkyPilot's cancel signals the job's process group; a node shutting down signals them all;
    # signalling only the script's shell must still reach the runtime. Whatever the runtime
    # then exits with, the job recovers (a user error fails again, unstopped, on the rerun).
    proc = node(STUB_CODE=str(code))
    if to == "script":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == STOPPED_EXIT_CODE


@pytest.mark.parametrize("code", [0, 1, 2])
def test_a_run_that_ends_by_itself_keeps_its_exit_code(node, code):
    assert node(STUB_NOW=str(code)).wait(timeout=30) == code


def test_skypilot_recovers_a_managed_job_on_the_stop_code_only(capsys):
    from sky.jobs.recovery_strategy import StrategyExecutor

    from sky import backends

    argv = ["render", "qwen3-1.7b", "--managed", "--spot", "--checkpoint-bucket", "s3://b/ck"]
    assert main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["resources"]["job_recovery"]["recover_on_exit_codes"] == [STOPPED_EXIT_CODE]
    mount = config["file_mounts"]["/checkpoints"]
    assert (mount["source"], mount["mode"]) == ("s3://b/ck", "MOUNT_CACHED")
    assert "--run-dir /checkpoints/grpo-qwen3-1.7b" in config["run"]

    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    executor = StrategyExecutor.make(
        "grpo-qwen3-1.7b",
        backends.CloudVmRayBackend(),
        task,
        1,
        0,
        None,
        set(),
        asyncio.Lock(),
        asyncio.Condition(),
    )
    assert executor.max_restarts_on_errors == 0
    # a stop always recovers; an actor failure (1) or a user error (2) only within
    # --max-restarts-on-errors, which is 0 here
    assert executor.should_restart_on_failure([STOPPED_EXIT_CODE])
    assert not executor.should_restart_on_failure([1])
    assert not executor.should_restart_on_failure([2])
