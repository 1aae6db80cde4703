"""Environment workers on a CPU node beside the run's own (env.cpu_nodes), two nodes on this
machine as tests/test_multinode.py runs them: node 1 is `python -m runtime` as SkyPilot starts
it on the CPU node, node 0 a controller (tests/env_nodes_app.py) that starts the run's
environment hosting over both, so an episode's tool call is answered by a worker process on the
CPU node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import ROOT, finish, free_port, leftover_processes

from runtime.control.metrics import read_metrics

pytestmark = pytest.mark.slow
IPS = ["127.0.0.1", "127.0.0.2"]
SETTINGS = [
    "env.name=tool_envs:ToolsEnv",
    "env.cpu_nodes=1",
    "env.workers_per_node=1",
    "env.cpus_per_episode=0.001",  # a worker on the CPU node too
]


def node_env(rank: int, port: int) -> dict[str, str]:
    tests = str(ROOT / "tests")
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), tests, os.environ.get("PYTHONPATH")])
        ),
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NODE_IPS": "\n".join(IPS) + "\n",
        "FORGESKY_WORKER_PORT": str(port),
    }


def test_a_tool_call_is_answered_by_a_worker_on_the_cpu_node(tmp_path: Path):
    port = free_port(*IPS)
    sets = [a for s in SETTINGS for a in ("--set", s)]
    log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "runtime", "--recipe", "tiny-tools", *sets,
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, env=node_env(1, port), stdout=log, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    controller = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "env_nodes_app.py"), *SETTINGS],
        cwd=ROOT, env=node_env(0, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        # the CPU node's workers, seen from node 1's process while they run
        code, out = finish(controller, timeout=300)
        assert code == 0, out + (tmp_path / "node1.log").read_text()
        line = next(line for line in out.splitlines() if line.startswith("answers "))
        answers = json.loads(line[len("answers ") :])
        assert answers["cpu_nodes"] == ["node 1 (127.0.0.2)"]
        local, remote = set(answers["node0_workers"]), set(answers["cpu_node_workers"][0])
        assert len(local) == 1 and len(remote) == 1 and not local & remote
        answered = {int(t) for t in answers["texts"]}
        # two episodes a hosting (one worker each): both answered, each by its own worker
        assert answered == local | remote, answers
        assert answers["errors"] == [None] * 4 and answers["counters"]["tool_calls"] == 4
        # node 0's worker in the controller's session, the CPU node's in node 1's
        sessions = {int(pid): sid for pid, sid in answers["sessions"].items()}
        assert [sessions[p] for p in local] == [controller.pid]
        assert [sessions[p] for p in remote] == [node1.pid]
        assert node1.wait(60) == 0
        assert leftover_processes(controller.pid) == [] and leftover_processes(node1.pid) == []
    finally:
        for proc in (controller, node1):
            if proc.poll() is None:
                proc.kill()
        log.close()


def test_a_run_steps_its_episodes_on_node_0_and_the_cpu_node(tmp_path: Path):
    """`python -m runtime` on both nodes, as the job group's scripts start it: the controller
    spawns the CPU node's environment host with the services, and the run's episodes call
    their tools on both nodes' workers."""
    port = free_port(*IPS)
    run_dir = tmp_path / "run"
    args = ["-m", "runtime", "--recipe", "tiny-tools", "--set", "env.cpu_nodes=1",
            "--steps", "2", "--run-dir", str(run_dir)]  # fmt: skip
    log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=node_env(1, port), stdout=log,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    node0 = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=node_env(0, port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        code, out = finish(node0, timeout=400)
        assert code == 0, out + (tmp_path / "node1.log").read_text()
        assert "environment workers: 2 on node 0, 1 on node 1 (127.0.0.2)" in out
        assert node1.wait(60) == 0
        records = read_metrics(run_dir / "metrics.jsonl")
        steps = [r for r in records if "episode/tool_calls" in r]
        assert len(steps) == 2 and sum(r["episode/tool_calls"] for r in steps) > 0
        assert all(r["episode/workers_lost"] == 0 for r in steps)
        assert leftover_processes(node0.pid) == [] and leftover_processes(node1.pid) == []
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
        log.close()
