"""layout.sharing mps: the run's own MPS control daemon, started before the procs of the
services that share a GPU and stopped after them. The control program is NVIDIA's; here a
stand-in on PATH records what the runtime asks of it (this machine has no GPU driver)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from runtime_helpers import run_on_one_gpu

from recipes import UserError
from runtime.procs import mps

# What the stand-in does, as NVIDIA's does: `-d` starts "the daemon" (a process of its own, its
# pid in the pipe folder's pid file, its control socket beside it) and returns; `quit` on stdin
# returns at once and the daemon ends a moment later, removing its pid file (the control file
# stays, as the real one's socket does); with FAKE_MPS_STUCK the daemon ignores quit. Each call
# is a line in $FAKE_MPS_LOG with the pipe folder it got.
STAND_IN = """#!/bin/sh
if [ -n "$FAKE_MPS_FAIL" ]; then echo "cannot start: $FAKE_MPS_FAIL" >&2; exit 1; fi
pid_file="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
if [ "$1" = "-d" ]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
  echo "sees ${CUDA_VISIBLE_DEVICES-all} $CUDA_DEVICE_ORDER" >> "$FAKE_MPS_LOG"
  sleep 600 </dev/null >/dev/null 2>&1 &
  echo $! > "$pid_file"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read command
echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
if [ -z "$FAKE_MPS_STUCK" ]; then
  daemon=$(cat "$pid_file")
  (sleep 0.5; kill "$daemon"; rm -f "$pid_file") </dev/null >/dev/null 2>&1 &
fi
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a child of a stand-in that exited: a zombie until reaped by init, not running
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    program = folder / mps.CONTROL
    program.write_text(STAND_IN)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "mps.log"
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    return log


def test_a_node_without_the_control_program_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError) as err:
        mps.control_binary()
    assert str(err.value) == (
        "layout.sharing mps: nvidia-cuda-mps-control is not on this node's PATH (it comes "
        "with NVIDIA's driver utilities); install them, or set layout.sharing=turns"
    )


def test_the_daemon_runs_in_a_folder_of_its_own_and_quits(stand_in, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    daemon = mps.start_daemon()
    pipe, logs = daemon.env["CUDA_MPS_PIPE_DIRECTORY"], daemon.env["CUDA_MPS_LOG_DIRECTORY"]
    assert Path(pipe).parent == daemon.folder and Path(logs).parent == daemon.folder
    pid = daemon.pid()
    assert pid is not None and alive(pid)
    daemon.stop()
    # stop returned because the daemon's process ended, not because its socket went
    assert not alive(pid)
    # it sees every GPU (the run was given them all), numbered as nvidia-smi numbers them
    said = [f"start {pipe} {logs}", "sees all PCI_BUS_ID", f"quit {pipe}"]
    assert stand_in.read_text().splitlines() == said
    assert not daemon.folder.exists()
    daemon.stop()  # twice: nothing more asked of the daemon
    assert len(stand_in.read_text().splitlines()) == 3


def test_a_daemon_that_does_not_quit_is_named_and_its_folder_goes(stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_STUCK", "1")
    monkeypatch.setattr(mps, "QUIT_TIMEOUT_S", 0.5)
    daemon = mps.start_daemon()
    pid = daemon.pid()
    assert pid is not None
    try:
        with pytest.raises(RuntimeError) as err:
            daemon.stop()
        assert str(err.value) == (
            f"the MPS control daemon (pid {pid}) is still running 0.5 s after quit; "
            f"`kill {pid}` ends it"
        )
        assert not daemon.folder.exists()
    finally:
        os.kill(pid, 9)


def test_a_daemon_a_killed_run_left_is_stopped_by_the_next_and_live_runs_keep_theirs(
    stand_in, tmp_path, monkeypatch
):
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    left = mps.start_daemon()
    ours = mps.start_daemon()  # a run still going: its controller (this process) is alive
    gone = subprocess.Popen(["true"])
    gone.wait()
    (left.folder / mps.OWNER_FILE).write_text(f"{gone.pid} 1\n")
    creating = tmp_path / "tmp" / f"{mps.PREFIX}creating"  # a folder without its owner yet
    creating.mkdir()
    left_pid, ours_pid = left.pid(), ours.pid()
    assert left_pid is not None and ours_pid is not None
    try:
        said = mps.reap_left_daemons()
        assert said == [
            f"stopped an NVIDIA MPS daemon an earlier run left running (pid {left_pid}, its "
            f"controller {gone.pid} gone; {left.folder})"
        ]
        assert not alive(left_pid) and not left.folder.exists()
        assert alive(ours_pid) and ours.folder.exists() and creating.exists()
        assert mps.reap_left_daemons() == []
    finally:
        ours.stop()


def test_a_daemon_that_does_not_start_names_what_the_program_said(stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "no GPU")
    with pytest.raises(RuntimeError) as err:
        mps.start_daemon()
    assert str(err.value) == "nvidia-cuda-mps-control (-d) exited 1: cannot start: no GPU"


def test_only_a_plan_whose_services_share_a_gpu_uses_mps():
    from recipes import apply_overrides, load_recipe, plan

    recipe = apply_overrides(load_recipe("qwen3-1.7b"), ["layout.sharing=mps"])
    assert mps.uses_mps(plan(recipe, 1, accelerator="H200"))  # every service on the one GPU
    own = apply_overrides(recipe, ["layout.share=none"])
    assert not mps.uses_mps(plan(own, 3, accelerator="H200"))  # a GPU each: no client
    turns = apply_overrides(recipe, ["layout.sharing=turns"])
    assert not mps.uses_mps(plan(turns, 1, accelerator="H200"))


def test_a_share_of_the_sms_is_planned_shown_and_refused_where_it_would_do_nothing():
    from recipes import apply_overrides, load_recipe, plan

    recipe = load_recipe("qwen3-1.7b")
    held = ["layout.sharing=mps", "layout.mps_sm_percent.trainer=40"]
    one = plan(apply_overrides(recipe, held), 1, accelerator="H200")
    assert one.mps_sm_percent == (("trainer", 40),)
    assert (
        "their calls at once under NVIDIA MPS (layout.sharing mps; SMs: trainer 40 % "
        "(layout.mps_sm_percent); the predicted step counts turns)" in one.describe()
    )
    # with turns each call has the whole GPU: a share would do nothing
    with pytest.raises(UserError) as err:
        apply_overrides(recipe, ["layout.mps_sm_percent.trainer=40"])
    assert str(err.value).endswith(
        "layout.mps_sm_percent.trainer: a share of the SMs applies under layout.sharing mps "
        "(services calling a GPU at once); with turns each call has the whole GPU"
    )
    # two GPUs one step off-policy: the generator on a GPU of its own is no MPS client
    own = apply_overrides(recipe, ["layout.sharing=mps", "layout.mps_sm_percent.generator=60"])
    with pytest.raises(UserError) as err:
        plan(own, 2, accelerator="H200")
    assert str(err.value) == (
        "layout.mps_sm_percent.generator: the generator has GPUs of its own in this plan "
        "(layout.share trainer_reference); only services that share a GPU run under MPS"
    )


@pytest.mark.slow
def test_a_run_with_services_on_one_gpu_starts_and_stops_its_daemon(
    tmp_path, stand_in, monkeypatch
):
    """Real procs: `tiny` with generator, reference and trainer placed on GPU index 0 (on this
    CPU host the index only sets CUDA_VISIBLE_DEVICES), layout.sharing mps, the run given the
    host's GPU 1 (a run beside another on a shared host)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    run_dir = tmp_path / "run"
    out = run_on_one_gpu(
        run_dir,
        [
            "grpo.steps=3",
            "grpo.checkpoint_interval=0",
            "layout.sharing=mps",
            "layout.mps_sm_percent.trainer=50",
            "layout.mps_sm_percent.reference=30",
        ],
    )
    started = next(x for x in out.splitlines() if x.startswith("NVIDIA MPS daemon started"))
    folder = started.split("(")[1].rstrip(")")
    assert out.index(started) < out.index("services ready")
    assert (
        "services sharing a GPU call it at once under NVIDIA MPS (layout.sharing mps): "
        "generator0 + reference + trainer (node 0 GPU 0)" in out
    )
    # each proc says what it found in its environment as it started
    assert (
        "SMs each service may use under NVIDIA MPS (layout.mps_sm_percent): trainer 50 %, "
        "generator0 100 %, reference 30 %" in out
    )
    pipe = f"{folder}/pipe"
    # the daemon sees the run's GPU (its clients see it as 0: tests/test_mesh.py)
    said = [f"start {pipe} {folder}/log", "sees 1 PCI_BUS_ID", f"quit {pipe}"]
    assert stand_in.read_text().splitlines() == said
    assert not Path(folder).exists()
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3 and "gpu/turns" not in rows[-1]
