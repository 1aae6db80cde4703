"""The recipe's env section (recipes/environment.py): validate finds and checks the environment
class without importing it, bad values are one line and exit 2, plan shows it, --set reaches it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from recipes.loader import catalog_path

QWEN = yaml.safe_load(catalog_path("qwen3-1.7b").read_text())


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


def test_plan_shows_the_environment_in_one_line_and_set_reaches_it(tmp_path, capsys):
    path = project(tmp_path, {"name": "builtin:python"})
    code, out, err = run(capsys, "plan", str(path), "--set", "env.max_turns=6", "--gpus", "1")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("environment ")]
    assert lines == [
        "environment builtin:python: 4 CPU workers a node, up to 6 turns and 2048 tokens an "
        "episode, timeouts 30 s a call, 300 s an episode; sandbox 5 CPU s, 512 MB, 10 s wall"
    ]
    code, out, _ = run(capsys, "plan", str(path), "--json", "--gpus", "1")
    assert json.loads(out)["env"].startswith("environment builtin:python: 4 CPU workers")
    code, out, _ = run(capsys, "plan", "qwen3-1.7b", "--json", "--gpus", "1")
    assert "env" not in json.loads(out)  # a single-turn recipe's plan is as before


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
