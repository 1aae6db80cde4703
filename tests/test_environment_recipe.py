"""The recipe's env section (recipes/environment.py): validate finds and checks the environment
class without importing it, bad values are one line and exit 2, plan shows it, --set reaches it."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from recipes.loader import catalog_path

QWEN = yaml.safe_load(catalog_path("qwen3-1.7b").read_text())
# episode calls a generator replica runs at once, where a recipe leaves env.batches_in_flight
LANES = 2


def project(tmp_path: Path, env: dict) -> Path:
    """A recipe with an env section next to a package holding environments: one an OpenEnv
    MCPEnvironment through a base class of its own, and one that is not an environment."""
    pkg = tmp_path / "mine" / "myenvs"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lookup.py").write_text(
        textwrap.dedent(
            """
            import a_library_this_machine_lacks
            from openenv.core.env_server.mcp_environment import MCPEnvironment

            class Base(MCPEnvironment):
                pass

            class Lookup(Base):
                pass

            class Table(dict):
                pass
            """
        )
    )
    # QWEN's evaluation names a dataset reward (math); an env recipe's is the environment's
    recipe = {**QWEN, "name": "qwen-tools", "env": env, "eval": {"enabled": False}}
    path = tmp_path / "mine" / "qwen-tools.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_finds_the_environment_class_without_importing_it(tmp_path, capsys):
    path = project(tmp_path, {"name": "myenvs.lookup:Lookup", "max_turns": 3})
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    assert "ok (recipe qwen-tools" in out


def fewest_vcpus(accelerator: str, count: int) -> float:
    """The fewest vCPUs of a node of `count` `accelerator`s, read from the committed rows of
    SkyPilot's catalog (every cloud whose rows name the GPU beside the instance type)."""
    got = []
    for path in Path("recipes/price_catalog/catalogs/v8").glob("*/vms.csv"):
        for row in csv.DictReader(path.open()):
            name = (row.get("AcceleratorName") or "").removesuffix("-SXM")
            sold = name == accelerator and row["AcceleratorCount"] and row["InstanceType"]
            if sold and float(row["AcceleratorCount"]) == count:
                got.append(float(row["vCPUs"]))
    return min(got)


def test_plan_shows_the_environment_in_one_line_and_set_reaches_it(tmp_path, capsys):
    path = project(tmp_path, {"name": "builtin:python"})
    code, out, err = run(capsys, "plan", str(path), "--set", "env.max_turns=6", "--gpus", "1")
    assert code == 0, err
    # one H100: one generator replica, its LANES calls each every prompt of the step x
    # group_size episodes; node 0's own processes: the controller's 2 cores, 2 for its GPU, 1 a
    # reward proc
    g = QWEN["grpo"]
    episodes = LANES * g["prompts_per_step"] * g.get("steps_per_call", 1) * g["group_size"]
    vcpus = fewest_vcpus("H100", 1)
    own = 2 + 2 + QWEN.get("layout", {}).get("reward", {}).get("procs", 1)
    workers = min(episodes, int(vcpus) - own)
    lines = [line for line in out.splitlines() if line.startswith("environment ")]
    assert lines[0] == (
        f"environment builtin:python: {workers} CPU workers on node 0, up to 6 turns and 2048 "
        "tokens an episode, timeouts 30 s a call, 300 s an episode; sandbox 5 CPU s, 512 MB, "
        "10 s wall"
    )
    assert lines[1].startswith(
        f"environment cores: {episodes} episodes in flight x 1 core = {episodes} cores; node 0 "
        f"has {vcpus:g} vCPUs (the fewest of 1 H100 a node: "
    )
    short = episodes - (vcpus - own)
    nodes = math.ceil(short / 31)  # CPU nodes of 32 vCPUs, a core of each for its runtime
    assert lines[1].endswith(
        f"{own} for its own processes: {workers} workers on node 0, {short:g} cores short (the "
        "tools' calls wait for cores; --set env.cpu_nodes=auto puts the rest on "
        f"{nodes} CPU nodes of 32+ vCPUs, a managed job group)"
    )
    code, out, err = run(capsys, "plan", str(path), "--gpus", "1", "--set", "env.cpu_nodes=auto")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("environment cores"))
    assert line.endswith(
        f"{short:g} cores short: {nodes} CPU nodes of 32+ vCPUs beside the run's with "
        f"{math.ceil(short / nodes)} workers each (a managed job group, --managed; their price "
        "is not in the cost below)"
    )
    code, out, _ = run(capsys, "plan", str(path), "--json", "--gpus", "1")
    plan = json.loads(out)
    assert plan["env"].startswith(f"environment builtin:python: {workers} CPU workers")
    assert {k: plan["environment"][k] for k in ("episodes", "cores_needed", "node_vcpus")} == {
        "episodes": episodes,
        "cores_needed": episodes,
        "node_vcpus": vcpus,
    }
    assert plan["environment"]["workers_from"] == "auto"
    assert (plan["environment"]["cpu_nodes"], plan["environment"]["cpu_nodes_auto"]) == (0, nodes)
    code, out, _ = run(capsys, "plan", "qwen3-1.7b", "--json", "--gpus", "1")
    assert "env" not in json.loads(out)  # a single-turn recipe's plan is as before
    assert "environment" not in json.loads(out)


def test_the_planned_workers_follow_the_cores_an_episode_takes(tmp_path, capsys):
    """Few cores an episode: a worker per core needed; workers set by hand stay as set; 8 GPUs
    (4 generator replicas here) share the step's prompts between their calls."""
    path = project(tmp_path, {"name": "builtin:python", "cpus_per_episode": 0.02})
    code, out, err = run(capsys, "plan", str(path), "--json", "--gpus", "1")
    assert code == 0, err
    e = json.loads(out)["environment"]
    assert e["cores_per_episode"] == 0.02 and e["short"] == 0
    assert e["workers"] == math.ceil(e["episodes"] * 0.02) and e["workers_from"] == "auto"
    code, out, err = run(
        capsys, "plan", str(path), "--json", "--gpus", "1", "--set", "env.workers_per_node=3"
    )
    assert code == 0, err
    e = json.loads(out)["environment"]
    assert (e["workers"], e["workers_from"]) == (3, "env.workers_per_node"), err
    code, out, err = run(capsys, "plan", str(path), "--json", "--gpus", "8",
                         "--set", "layout.generator.replicas=4", "--set", "layout.share=none",
                         "--set", "grpo.prompts_per_step=6")  # fmt: skip
    assert code == 0, err
    e = json.loads(out)["environment"]
    g = QWEN["grpo"]
    # 4 replicas of LANES calls of 2 prompts each (6 / 4 rounded up), group_size episodes a
    # prompt; one call a replica where set so
    assert e["episodes"] == 4 * LANES * 2 * g["group_size"]
    code, out, err = run(capsys, "plan", str(path), "--json", "--gpus", "8",
                         "--set", "layout.generator.replicas=4", "--set", "layout.share=none",
                         "--set", "grpo.prompts_per_step=6",
                         "--set", "env.batches_in_flight=1")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["environment"]["episodes"] == 4 * 2 * g["group_size"]
    assert e["node_vcpus"] == fewest_vcpus("H100", 8)


def test_the_tiny_tools_recipe_plans_its_cores_on_its_cpu_node(capsys):
    code, out, err = run(capsys, "plan", "tiny-tools", "--json")
    assert code == 0, err
    e = json.loads(out)["environment"]
    recipe = yaml.safe_load(catalog_path("tiny-tools").read_text())
    g = recipe["grpo"]
    lanes = recipe["env"].get("batches_in_flight", LANES)
    assert e["episodes"] == lanes * g["prompts_per_step"] * g["group_size"]
    assert (e["cores_per_episode"], e["node_vcpus"]) == (0.005, 8)
    assert (e["workers"], e["workers_from"]) == (2, "env.workers_per_node")


def test_set_adds_an_env_section_to_a_recipe_without_one(capsys):
    code, out, err = run(
        capsys, "plan", "qwen3-1.7b", "--gpus", "1", "--set", "env.name=builtin:python",
        "--set", "env.sandbox.isolation=rlimits", "--set", "eval.enabled=false",
    )  # fmt: skip
    assert code == 0, err
    assert "s wall, rlimits only" in out


@pytest.mark.parametrize(
    "env, message",
    [
        ({"name": "myenvs.lookup:Lookup", "max_turns": 0}, "env.max_turns: Input should be greater than 0"),
        ({"name": "builtin:python", "max_episode_tokens": -1}, "env.max_episode_tokens: Input should be greater than 0"),
        ({"name": "builtin:python", "call_timeout_s": 0}, "env.call_timeout_s: Input should be greater than 0"),
        ({"name": "builtin:python", "episode_timeout_s": 0}, "env.episode_timeout_s: Input should be greater than 0"),
        ({"name": "builtin:python", "workers_per_node": 0}, "env.workers_per_node: Input should be greater than 0"),
        ({"name": "builtin:python", "workers_per_node": "many"}, "env.workers_per_node: "),
        ({"name": "builtin:python", "cpus_per_episode": 0}, "env.cpus_per_episode: Input should be greater than 0"),
        ({"name": "builtin:python", "cpus_per_episode": -1}, "env.cpus_per_episode: Input should be greater than 0"),
        ({"name": "builtin:python", "cpu_nodes": -1}, "env.cpu_nodes: Input should be 0 or more, or auto"),
        ({"name": "builtin:python", "cpu_nodes": 17}, "env.cpu_nodes: Input should be at most 16, or auto"),
        ({"name": "builtin:python", "cpus_per_episode": 40, "cpu_nodes": "auto"}, "qwen-tools: 256 episodes in flight x 40 cores need 10240 cores, "),
        ({"name": "builtin:python", "cpus_per_episode": 40, "cpu_nodes": 17}, "env.cpu_nodes: Input should be at most 16"),
        ({"name": "builtin:python", "sandbox": {"cpu_seconds": 0}}, "env.sandbox.cpu_seconds: Input should be greater than 0"),
        ({"name": "builtin:python", "sandbox": {"memory_mb": 0}}, "env.sandbox.memory_mb: Input should be greater than 0"),
        ({"name": "builtin:python", "sandbox": {"isolation": "none"}}, "env.sandbox.isolation: "),
        ({"name": "builtin:python", "max_episode_tokens": 100000}, "env.max_episode_tokens: 100000 exceeds the qwen3 1.7b context of 40960 tokens"),
        ({"name": "builtin:search"}, "env.name: no shipped environment named 'search' (shipped: python, tiny-tools)"),
        ({"name": "lookup"}, "env.name: 'lookup' is neither builtin:<name> (python, tiny-tools) nor module:Class"),
        ({"name": "myenvs.lookup:Missing"}, "env.name 'myenvs.lookup:Missing': lookup.py has no class 'Missing'"),
        ({"name": "myenvs.nowhere:Lookup"}, "env.name 'myenvs.nowhere:Lookup': module 'myenvs.nowhere' not found"),
        ({"name": "myenvs.lookup:Table"}, "env.name 'myenvs.lookup:Table': Table is not an OpenEnv Environment (its bases: dict)"),
        ({"name": "builtin:python", "turns": 3}, "env.turns: unknown key; did you mean max_turns?"),
        ({"name": "builtin:python", "max_episode_tokens": 4096}, "env.max_episode_tokens: 4096 exceeds grpo.max_prompt_tokens + grpo.max_response_tokens (2048)"),
        ({"name": "builtin:python", "max_turn_tokens": 0}, "env.max_turn_tokens: Input should be greater than 0"),
        ({"name": "builtin:python", "max_turn_tokens": 2000}, "env.max_turn_tokens: 2000 exceeds the episode's grpo.max_response_tokens 1024"),
    ],
)  # fmt: skip
def test_bad_env_sections_are_one_line_exit_2(tmp_path, capsys, env, message):
    path = project(tmp_path, env)
    for command in ("validate", "plan"):
        code, _, err = run(capsys, command, str(path))
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_too_many_cpu_nodes_is_said_as_such_on_any_gpu_count(tmp_path, capsys):
    path = project(
        tmp_path, {"name": "builtin:python", "cpus_per_episode": 40, "cpu_nodes": "auto"}
    )
    for gpus in ("1", "2", "8"):
        code, _, err = run(capsys, "plan", str(path), "--gpus", gpus)
        assert code == 2 and err.count("\n") == 1, err
        assert "CPU nodes of 32 vCPUs, more than 16; lower env.cpus_per_episode" in err


def test_validate_imports_neither_the_environment_nor_openenv(tmp_path):
    path = project(tmp_path, {"name": "myenvs.lookup:Lookup"})
    code = (
        "import sys\nfrom launcher.cli import main\nrc = main(['validate', sys.argv[1]])\n"
        "print(rc, sorted(m for m in ('openenv', 'myenvs', 'torch', 'sky') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert out.stdout.splitlines()[-1] == "0 []"


def test_a_node_starts_the_workers_its_own_cores_allow(tmp_path):
    """At run time auto counts this node's cores (its affinity mask), not the catalog's."""
    from recipes.loader import load_recipe
    from recipes.planner import plan
    from runtime.environments.start import node_workers

    path = project(tmp_path, {"name": "builtin:python"})
    recipe = load_recipe(path)
    run_plan = plan(recipe, 1)
    g = QWEN["grpo"]
    episodes = g["prompts_per_step"] * g["group_size"]
    own = 2 + 2 + QWEN["layout"]["reward"]["procs"]
    cores = len(os.sched_getaffinity(0))
    assert node_workers(recipe, run_plan) == min(episodes, max(1, cores - own))
    fixed = load_recipe(project(tmp_path / "b", {"name": "builtin:python", "workers_per_node": 5}))
    assert node_workers(fixed, run_plan) == 5
