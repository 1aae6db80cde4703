"""The GPU suite in groups (scripts/gpu/suite.py) that each fit one remote command of 10 minutes
and run side by side on one host: every gpu-marked test in exactly one group, the groups'
GPUs and time, what `device_run.sh suite` starts where, and that a test's check for segments
left in /dev/shm does not count a run beside it."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from runtime_helpers import ROOT, left_in_shm

sys.path.insert(0, str(ROOT / "scripts/gpu"))
import suite  # noqa: E402

# Collects the gpu-marked tests of the files given without running them: node id and whether
# a skipif marker (fewer than two GPUs) may skip it.
COLLECT = """
import json, sys, pytest

class Record:
    def __init__(self):
        self.items = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.items[item.nodeid] = any(True for _ in item.iter_markers("skipif"))

record = Record()
code = pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *sys.argv[2:]],
                   plugins=[record])
open(sys.argv[1], "w").write(json.dumps({"code": int(code), "items": record.items}))
"""


@pytest.fixture(scope="module")
def gpu_tests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bool]:
    """Every gpu-marked test (node id -> whether it skips on fewer than two GPUs), collected
    from the test files that mark any."""
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "mark.gpu" in p.read_text()
    )
    out = tmp_path_factory.mktemp("collect") / "tests.json"
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT, str(out), *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"},
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["code"] == 0 and found["items"], proc.stdout[-3000:]
    return found["items"]


def test_every_gpu_test_is_in_exactly_one_group(gpu_tests: dict[str, bool]):
    homes = {
        node: [
            name for name, g in suite.GROUPS.items() if any(suite.covers(e, node) for e in g.tests)
        ]
        for node in gpu_tests
    }
    assert not [n for n, h in homes.items() if not h], "in no group"
    assert not {n: h for n, h in homes.items() if len(h) > 1}, "in several groups"
    # and no group names a test that is not there (renamed, removed)
    stale = [
        (name, entry)
        for name, group in suite.GROUPS.items()
        for entry in group.tests
        if not any(suite.covers(entry, node) for node in gpu_tests)
    ]
    assert not stale, stale


def test_each_group_fits_a_call_on_the_gpus_it_names(gpu_tests: dict[str, bool]):
    for name, group in suite.GROUPS.items():
        assert group.gpus in (1, 2), name
        assert 0 < group.minutes <= suite.BOUND_MINUTES, name
        if group.gpus == 1:
            # on one GPU a test that needs two would skip: a skip hiding it from the suite
            two = [
                n
                for n, skips in gpu_tests.items()
                if skips and any(suite.covers(e, n) for e in group.tests)
            ]
            assert not two, (name, two)


def test_the_table_answers_device_run():
    def answer(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ROOT / "scripts/gpu/suite.py"), *args],
            capture_output=True,
            text=True,
        )

    tests = answer("tests", "oom-nccl")
    assert tests.returncode == 0
    assert tests.stdout.split() == list(suite.GROUPS["oom-nccl"].tests)
    assert answer("gpus", "memory").stdout.strip() == "1"
    wrong = answer("gpus", "faults")
    assert wrong.returncode == 2 and wrong.stderr.startswith(
        "no GPU test group 'faults': one of ranks"
    )
    listed = answer("list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == list(suite.GROUPS)


def dry_run(
    *groups: str, gpus: str = "0,1,2,3", commit: str = "4f2c1e9", out: Path
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "COMMIT": commit, "SUITE_GPUS": gpus}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        ["bash", str(ROOT / "scripts/gpu/device_run.sh"), "suite", "--dry-run", *groups],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_suite_shares_out_the_gpus_and_names_the_commit(tmp_path: Path):
    run = dry_run("ranks", "kills-1gpu", "memory", "push", out=tmp_path)
    assert run.returncode == 0, run.stderr
    starts = [line for line in run.stdout.splitlines() if line.startswith("suite: ")]
    # a pair, then one GPU each, then (a wave later: the four GPUs are taken) a pair again
    assert starts == [
        "suite: ranks on GPUs 0,1, log gpu_suite_ranks.log",
        "suite: kills-1gpu on GPUs 2, log gpu_suite_kills-1gpu.log",
        "suite: memory on GPUs 3, log gpu_suite_memory.log",
        "suite: push on GPUs 0,1, log gpu_suite_push.log",
    ]
    assert run.stdout.count("  commit: 4f2c1e9") == 4
    commands = [line for line in run.stdout.splitlines() if "python3 -m pytest" in line]
    assert commands[0].startswith("  CUDA_VISIBLE_DEVICES=0,1 timeout -s INT")
    assert "--basetemp=/tmp/gpu_suite_ranks" in commands[0]
    assert commands[2].endswith(" ".join(suite.GROUPS["memory"].tests))
    assert "-m gpu" in commands[3] and "--durations=0" in commands[3]
    # nothing ran: no log
    assert not list(tmp_path.iterdir())


def test_suite_refuses_a_group_the_gpus_cannot_hold(tmp_path: Path):
    run = dry_run("vllm", "oom-step", gpus="3", out=tmp_path)
    assert run.returncode == 2
    assert "suite: oom-step needs 2 GPUs, and 1 are given (3)" in run.stderr
    unknown = dry_run("faults", out=tmp_path)
    assert unknown.returncode == 2 and "no GPU test group 'faults'" in unknown.stderr


def test_a_segment_a_run_beside_this_one_holds_is_not_counted_as_left(tmp_path: Path):
    before = {p.name for p in Path("/dev/shm").iterdir()}
    tag = uuid.uuid4().hex[:8]
    held, left = f"forgesky-test-held-{tag}", f"forgesky-test-left-{tag}"
    # another session (a run on other GPUs of the host) maps a segment of its own
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, os, sys, time\n"
            f"fd = os.open('/dev/shm/{held}', os.O_CREAT | os.O_RDWR)\n"
            "os.ftruncate(fd, 4096)\n"
            "m = mmap.mmap(fd, 4096)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # and this session (the run under test) left one behind
        with open(f"/dev/shm/{left}", "wb") as f:
            f.write(b"\0" * 4096)
        # (other users of this host may make and leave segments meanwhile: only these two
        # are looked at)
        began = time.monotonic()
        found = left_in_shm(before, os.getsid(0), settle=2.0)
        assert left in found and held not in found, found
        assert time.monotonic() - began >= 2.0  # it was given the time to go
        # what this session holds is its own, whoever else there is
        with open(f"/dev/shm/{left}", "r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert left in left_in_shm(before, os.getsid(0), settle=0.0)
        os.unlink(f"/dev/shm/{left}")
        assert left not in left_in_shm(before, os.getsid(0), settle=0.0)
    finally:
        holder.kill()
        holder.wait()
        for name in (held, left):
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_a_calls_packer_lets_a_pipe_from_device_run_close_when_the_mode_ends(tmp_path: Path):
    """`PACK_BY=... device_run.sh check | tail` returns when the check does: the packer waiting
    for PACK_BY holds none of the call's output (it used to hold the pipe until PACK_BY, and the
    next command of the call started only then), and the logs are still packed at the end."""
    env = {**os.environ, "OUT": str(tmp_path), "TAG": "_p", "PACK_BY": str(int(time.time()) + 300)}
    # the pipe's reader sees its end only when every writer is gone; a held pipe runs to the
    # timeout (300 s ahead), a released one ends with the mode
    run = subprocess.run(
        "bash scripts/gpu/device_run.sh groups | cat",
        shell=True, cwd=ROOT, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert [line.split()[0] for line in run.stdout.splitlines()] == list(suite.GROUPS)
    assert (tmp_path / "logs_p.tgz").is_file()
