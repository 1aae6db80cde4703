"""A run whose environment workers take CPU nodes (env.cpu_nodes) as SkyPilot runs it: a managed
job group of two tasks, parsed by SkyPilot's own parser; the scripts that join the two tasks'
nodes into one cluster for `python -m runtime`; without --managed, one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from sky.utils import dag_utils

from launcher.cli import main
from launcher.scripts import joined_nodes
from runtime.procs.cluster import cluster_from_env

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["--set", "env.name=builtin:python", "--set", "eval.enabled=false"]


def test_the_cpu_nodes_are_a_job_group_skypilot_parses(tmp_path, capsys):
    out = tmp_path / "task.yaml"
    args = ["render", "qwen3-1.7b", "--gpus", "1", "--managed", *TOOLS]
    assert main([*args, "--set", "env.cpu_nodes=2", "-o", str(out)]) == 0
    capsys.readouterr()
    dag = dag_utils.load_dag_from_yaml_str(out.read_text())
    assert dag.is_job_group() and dag.name == "grpo-qwen3-1-7b"
    assert dag.primary_tasks == ["train"]
    train, envs = dag.tasks
    assert (train.name, train.num_nodes, envs.name, envs.num_nodes) == ("train", 1, "envs", 2)
    assert [dict(r.accelerators) for r in train.resources] == [{"H100": 1}, {"H200": 1}]
    (cpu,) = envs.resources
    assert (cpu.cpus, cpu.accelerators) == ("32+", None)
    assert "GPUS=1\n" in envs.run and "SKYPILOT_NODE_RANK + 1" in envs.run
    assert "envs-$i.$SKYPILOT_JOBGROUP_NAME" in train.run and "MIN_GPUS" in train.run
    # the auto count: the cores the plan finds short, on nodes of 32 vCPUs
    auto = ["--set", "env.cpu_nodes=auto"]
    assert main(["plan", "qwen3-1.7b", "--gpus", "1", *TOOLS, *auto]) == 0
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.startswith("environment cores")
    )
    assert main([*args, *auto, "-o", str(out)]) == 0
    nodes = dag_utils.load_dag_from_yaml_str(out.read_text()).tasks[1].num_nodes
    assert f": {nodes} CPU nodes of 32+ vCPUs beside the run's" in line and "--managed" in line


def test_without_managed_it_is_one_line_before_skypilot_is_imported(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        from launcher.cli import main
        rc = main(["render", "qwen3-1.7b", "--gpus", "1", "--set", "env.name=builtin:python",
                   "--set", "eval.enabled=false", "--set", "env.cpu_nodes=1"])
        print(rc, "sky" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr == (
        "forgesky: error: qwen3-1.7b: its environment workers take 1 CPU node beside the GPU "
        "nodes, which SkyPilot starts together only as a managed job group: add --managed (or "
        "set env.cpu_nodes=0)\n"
    )


def test_each_task_joins_the_other_tasks_nodes_into_one_cluster(tmp_path):
    """The scripts under bash, SkyPilot's /etc/hosts names answered by a getent of the test's:
    2 GPU nodes (train) then 3 CPU nodes (envs), the same cluster seen from either task."""
    hosts = {f"train-{i}.grp": f"10.0.0.{i + 1}" for i in range(2)}
    hosts |= {f"envs-{i}.grp": f"10.0.1.{i + 1}" for i in range(3)}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    getent = bin_dir / "getent"
    table = "\n".join(f"  {name}) echo '{ip}  {name}';;" for name, ip in hosts.items())
    getent.write_text(f'#!/bin/bash\ncase "$2" in\n{table}\n  *) exit 2;;\nesac\n')
    getent.chmod(0o755)
    show = 'printf "%s|%s" "$SKYPILOT_NODE_RANK" "$SKYPILOT_NODE_IPS"'

    def cluster(task_ips: list[str], rank: int, cpu_node: bool):
        script = "\n".join(["set -euo pipefail", *joined_nodes(2, 3, cpu_node), show])
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "SKYPILOT_JOBGROUP_NAME": "grp",
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "\n".join(task_ips) + "\n",
        }
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        got_rank, ips = out.stdout.split("|", 1)
        return cluster_from_env({"SKYPILOT_NODE_RANK": got_rank, "SKYPILOT_NODE_IPS": ips})

    train_ips, env_ips = list(hosts.values())[:2], list(hosts.values())[2:]
    whole = (*train_ips, *env_ips)
    assert cluster(train_ips, 0, cpu_node=False).ips == whole
    assert cluster(train_ips, 1, cpu_node=False).rank == 1
    seen = cluster(env_ips, 2, cpu_node=True)
    assert (seen.rank, seen.ips) == (4, whole)  # the third CPU node: node 4 of the run
    # a CPU node SkyPilot has no name for: one line, the script stops
    del hosts["envs-2.grp"]
    script = "\n".join(["set -euo pipefail", *joined_nodes(2, 3, False)])
    getent.write_text(
        '#!/bin/bash\ncase "$2" in\n'
        + "\n".join(f"  {n}) echo '{ip}  {n}';;" for n, ip in hosts.items())
        + "\n  *) exit 2;;\nesac\n"
    )
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SKYPILOT_JOBGROUP_NAME": "grp",
             "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n"},
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr == "forgesky: error: node envs-2.grp of the job group has no address\n"


def test_launch_submits_the_job_group_as_one_managed_job(monkeypatch, capsys):
    """Only SkyPilot's SDK call is replaced (tests/fake_sky.py): it gets the real Dag."""
    from fake_sky import FakeSky

    import sky

    fake = FakeSky(monkeypatch, {"request-sky.jobs.launch": ([7], None)})
    argv = ["launch", "qwen3-1.7b", "--gpus", "1", "--managed", *TOOLS, "--yes"]
    assert main([*argv, "--set", "env.cpu_nodes=3"]) == 0
    out = capsys.readouterr().out
    assert "managed job group (train, envs) grpo-qwen3-1-7b;" in out
    launched = [c for c in fake.calls if c[0] == "sky.jobs.launch"]
    ((_, args, kwargs),) = launched
    dag = args[0]
    assert isinstance(dag, sky.Dag) and dag.is_job_group() and kwargs["name"] == dag.name
    assert [(t.name, t.num_nodes) for t in dag.tasks] == [("train", 1), ("envs", 3)]
    assert [t.envs["FORGESKY_WORKER_PORT"] for t in dag.tasks] == ["26600", "26600"]


def test_the_runtime_takes_the_cpu_nodes_its_cluster_has(tmp_path, monkeypatch):
    """env.cpu_nodes auto on the nodes: the nodes the cluster has beyond the run's own (the job
    group's envs task), none on one machine, where node 0's cores serve (forgesky local)."""
    from runtime.entry import parse_config

    args = ["--recipe", "qwen3-1.7b", "--gpus", "1", "--run-dir", str(tmp_path / "run"),
            "--set", "env.name=builtin:python", "--set", "eval.enabled=false",
            "--set", "env.cpu_nodes=auto"]  # fmt: skip
    for var in ("SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    alone = parse_config(args)
    assert alone.plan.env_nodes == 0 and alone.plan.environment.short > 0
    monkeypatch.setenv("SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.1.1\n10.0.1.2\n")
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "2")
    grouped = parse_config(args)
    assert (grouped.plan.num_nodes, grouped.plan.env_nodes) == (1, 2)
    assert grouped.cluster.rank == 2
