"""A recipe's own code: a loss or a reward named module:function is checked at validate time
without being imported, travels to the nodes with the task, and imports in every proc of a run
without a hand-set PYTHONPATH."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from runtime_helpers import ROOT, finish, metrics

import sky
from launcher.cli import main
from recipes.loader import catalog_path

TINY = yaml.safe_load(catalog_path("tiny").read_text())


def project(tmp_path: Path, *, loss: str, reward: str, losses_py: str | None = None) -> Path:
    """A user's folder: a package with a loss and a reward (importing a library this machine
    lacks, which validate must not need), and a recipe next to it naming them."""
    pkg = tmp_path / "myproject" / "mycode"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text(
        losses_py
        or textwrap.dedent(
            """
            def reinforce(inputs, config):
                # plain REINFORCE: -A * log p per token
                return -inputs.advantages[:, None] * inputs.logprobs, {}
            """
        )
    )
    (pkg / "rewards.py").write_text(
        textwrap.dedent(
            """
            from mycode.scoring import prefix_credit

            def exact(prompt, completion, answer):
                return prefix_credit(completion.strip(), answer)
            """
        )
    )
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            def prefix_credit(got, want):
                n = 0
                for a, b in zip(got, want):
                    if a != b:
                        break
                    n += 1
                return n / max(len(want), len(got), 1)
            """
        )
    )
    recipe = copy.deepcopy(TINY)
    recipe["name"] = "tiny-mine"
    recipe["grpo"]["loss"] = loss
    recipe["dataset"]["rewards"] = [{"name": reward}]
    path = tmp_path / "myproject" / "tiny-mine.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_finds_the_code_next_to_the_recipe_without_importing_it(tmp_path, capsys):
    heavy = "import a_library_this_machine_lacks\n\ndef reinforce(inputs, config):\n    pass\n"
    path = project(
        tmp_path, loss="mycode.losses:reinforce", reward="mycode.rewards:exact", losses_py=heavy
    )
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    assert "ok (recipe tiny-mine" in out


def test_a_folder_without_init_py_is_a_package_as_python_imports_it(tmp_path, capsys):
    path = project(tmp_path, loss="mycode.losses:reinforce", reward="mycode.rewards:exact")
    (path.parent / "mycode" / "__init__.py").unlink()
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    folder = path.parent
    imported = subprocess.run(
        [sys.executable, "-c", "import mycode.rewards as r; print(r.exact('a', 'ab', 'ab'))"],
        cwd=folder, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(folder)},
    )  # fmt: skip
    assert imported.returncode == 0 and imported.stdout.strip() == "1.0", imported.stderr


@pytest.mark.parametrize(
    "loss, reward, message",
    [
        ("mycode.los:reinforce", "mycode.rewards:exact", "grpo.loss 'mycode.los:reinforce': "
         "module 'mycode.los' not found"),
        ("mycode.losses:reinforc", "mycode.rewards:exact", "grpo.loss 'mycode.losses:reinforc': "
         "losses.py has no function 'reinforc'"),
        ("mycode.rewards:exact", "mycode.rewards:exact", "grpo.loss 'mycode.rewards:exact': exact "
         "must take (inputs, config), it takes (prompt, completion, answer)"),
        ("grpo", "mycode.losses:reinforce", "dataset.rewards.0.name 'mycode.losses:reinforce': "
         "reinforce must take (prompt, completion, answer), it takes (inputs, config)"),
    ],
)  # fmt: skip
def test_bad_references_are_one_line_at_validate(tmp_path, capsys, loss, reward, message):
    path = project(tmp_path, loss=loss, reward=reward)
    for command in ("validate", "plan"):
        code, _, err = run(capsys, command, str(path))
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_task_brings_the_code_to_every_node(tmp_path, capsys, monkeypatch):
    path = project(tmp_path, loss="mycode.losses:reinforce", reward="mycode.rewards:exact")
    monkeypatch.chdir(tmp_path)  # the recipe's folder, not the current one, holds the code
    code, out, err = run(capsys, "render", str(path))
    assert code == 0, err
    config = yaml.safe_load(out)
    package = str(tmp_path / "myproject" / "mycode")
    assert config["file_mounts"]["/forgesky/code/mycode"] == package
    assert 'export PYTHONPATH="/forgesky/code${PYTHONPATH:+:$PYTHONPATH}"' in config["run"]
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # SkyPilot's own parser takes it
    assert task.file_mounts["/forgesky/code/mycode"] == package


@pytest.mark.slow
def test_a_run_imports_the_code_in_every_proc_without_pythonpath(tmp_path):
    path = project(tmp_path, loss="mycode.losses:reinforce", reward="mycode.rewards:exact")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the project itself (a checkout), nothing of the user's
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "--recipe", str(path), "--steps", "4"]
        + ["--run-dir", str(run_dir)],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "reward/mycode.rewards:exact" in rows[0]  # the reward procs scored with it
