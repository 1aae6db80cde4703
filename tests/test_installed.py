"""forgesky installed from a wheel, not run from a clone: what `render` and `launch` send.

The wheel is built from this checkout and installed with pip into a fresh venv; its
dependencies (SkyPilot, pydantic, torch, Monarch, ...) come from the test environment's
site-packages through a `.pth` line, which adds that folder to the path without running its own
`.pth` hooks (the editable install of this checkout stays out). Only `sky.launch` and the wait on
its request are replaced. A second fresh venv plays the node: it installs the wheel the task
mounts, by the requirement the set-up names, and runs the tiny recipe from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from launcher.options import PROJECT_DIR
from launcher.scripts import LOCK_MOUNT
from launcher.source import (
    WHEEL_MOUNT_DIR,
    installed_source,
    is_checkout,
    project_source,
)
from recipes import UserError

# From pyproject.toml: the wheel built here carries this version (this checkout need not be
# installed for the module to be collected, e.g. on the GPU machine).
VERSION = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]["version"]
WHEEL_NAME = f"forgesky-{VERSION}-py3-none-any.whl"


def clean_env() -> dict[str, str]:
    """The environment without anything that would find this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(cmd: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600, **kwargs
    )
    assert result.returncode == 0, f"{cmd}: {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def fresh_venv(path: Path) -> Path:
    """A venv whose own site-packages is empty, borrowing this environment's packages."""
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    python = path / "bin" / "python"
    site = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=path.parent,
    ).stdout.strip()
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def pip_install(python: Path, requirement: str, cwd: Path) -> None:
    run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", requirement],
        cwd=cwd,
    )


# What a wheel is built from (setuptools writes build/ and *.egg-info beside the sources, so
# the build runs on a copy and leaves the checkout as it was).
SOURCES = ("pyproject.toml", "README.md", "recipes", "launcher", "runtime")


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = PROJECT_DIR / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy(path, src / name)
    dist = tmp_path_factory.mktemp("dist")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(src),
        ],
        cwd=dist,
    )
    wheel = dist / WHEEL_NAME
    assert wheel.is_file(), list(dist.iterdir())
    return wheel


# Runs inside the installed venv: launch with only the final SkyPilot call replaced, and dump
# what SkyPilot was handed.
LAUNCH = """
import json, sys
import sky, launcher
from launcher.cli import main
from launcher.render import task_config

handed = []
sky.launch = lambda task, **kw: handed.append((task, kw)) or "request-1"
sky.stream_and_get = lambda request: (3, None)
code = main([*sys.argv[1:], "--yes"])
task, kw = handed[0]
print(json.dumps({"code": code, "launcher": launcher.__file__, "cluster": kw["cluster_name"],
                  "task": task_config(task)}))
"""


@pytest.mark.slow
def test_an_installed_wheel_reaches_the_nodes_as_that_wheel(built_wheel, tmp_path):
    laptop = fresh_venv(tmp_path / "laptop")
    pip_install(laptop, str(built_wheel), tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()

    launched = run([str(laptop), "-c", LAUNCH, "launch", "qwen3-1.7b", "--gpus", "4"], cwd=work)
    out = json.loads(launched.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    # The laptop ran the installed package, not this checkout.
    assert str(tmp_path / "laptop") in out["launcher"]
    assert "the wheel" in launched.stdout and str(built_wheel) in launched.stdout
    task = out["task"]
    remote = f"{WHEEL_MOUNT_DIR}/{WHEEL_NAME}"
    assert "workdir" not in task, "site-packages must never be synced"
    # the wheel, and the node-stack lock from the installed package (the nodes sync to it)
    lock = Path(out["launcher"]).parent / "node-stack.txt"
    assert task["file_mounts"] == {LOCK_MOUNT: str(lock), remote: str(built_wheel)}
    assert lock.read_text() == (PROJECT_DIR / "launcher" / "node-stack.txt").read_text()
    assert f"'forgesky[runtime] @ file://{remote}'" in task["setup"]
    assert "-e '.[runtime]'" not in task["setup"]
    assert task["resources"]["ordered"][0]["accelerators"] == {"H100": 4}

    # `forgesky render` from the console script: the same task, a header that says so, and a
    # file SkyPilot parses.
    rendered = work / "task.yaml"
    result = run(
        [str(laptop.parent / "forgesky"), "render", "qwen3-1.7b", "-o", str(rendered)], cwd=work
    )
    assert "wrote" in result.stderr
    text = rendered.read_text()
    assert "Run from any folder; forgesky reaches the nodes as the wheel" in text
    config = yaml.safe_load(text)
    assert "workdir" not in config
    assert config["file_mounts"] == {LOCK_MOUNT: str(lock), remote: str(built_wheel)}
    parsed = run(
        [
            str(laptop),
            "-c",
            "import sky, sys; t = sky.Task.from_yaml(sys.argv[1]); "
            "print(t.workdir, sorted(t.file_mounts))",
            str(rendered),
        ],
        cwd=work,
    )
    assert parsed.stdout.split() == ["None", f"['{remote}',", f"'{LOCK_MOUNT}']"]

    # The node: the mounted file at its remote name, installed by the set-up's requirement
    # (with the mount's path under this test's folder), then the tiny recipe from there.
    node_mount = tmp_path / "node" / WHEEL_MOUNT_DIR.lstrip("/")
    node_mount.mkdir(parents=True)
    shutil.copy(task["file_mounts"][remote], node_mount / WHEEL_NAME)
    node = fresh_venv(tmp_path / "node" / "venv")
    requirement = f"forgesky[runtime] @ file://{node_mount / WHEEL_NAME}"
    pip_install(node, requirement, tmp_path)
    home = tmp_path / "node" / "home"
    home.mkdir()
    trained = run(
        [str(node), "-m", "runtime", "--recipe", "tiny", "--steps", "2", "--run-dir", "run"],
        cwd=home,
    )
    assert (home / "run" / "model" / "config.json").is_file(), trained.stdout[-2000:]
    metrics = [json.loads(line) for line in (home / "run" / "metrics.jsonl").open()]
    assert max(m.get("step", 0) for m in metrics) == 2


@pytest.mark.slow
def test_an_installed_wheel_brings_a_local_data_file_to_the_nodes(built_wheel, tmp_path):
    laptop = fresh_venv(tmp_path / "laptop")
    pip_install(laptop, str(built_wheel), tmp_path)
    data = tmp_path / "somewhere" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"question": f"{i} + {i} =", "answer": str(2 * i)})
                            + "\n" for i in range(8)))  # fmt: skip
    recipe = yaml.safe_load((PROJECT_DIR / "recipes" / "catalog" / "tiny.yaml").read_text())
    recipe["name"] = "tiny-mine"
    # relative to the recipe file, which is neither beside the data nor the current directory
    recipe["dataset"]["path"] = "../somewhere/train.jsonl"
    recipe["eval"]["enabled"] = False
    mine = tmp_path / "recipes" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text(yaml.safe_dump(recipe))
    work = tmp_path / "elsewhere"
    work.mkdir()

    launched = run([str(laptop), "-c", LAUNCH, "launch", str(mine)], cwd=work)
    out = json.loads(launched.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and str(tmp_path / "laptop") in out["launcher"]
    remote = "/forgesky/files/dataset.path/train.jsonl"
    assert f"to every node: dataset.path {data} (" in launched.stdout
    task = out["task"]
    assert task["file_mounts"][remote] == str(data)
    assert task["file_mounts"]["/forgesky/recipes/mine.yaml"] == str(mine)
    assert f"--set dataset.path={remote}" in task["run"]

    rendered = work / "task.yaml"
    run([str(laptop.parent / "forgesky"), "render", str(mine), "-o", str(rendered)], cwd=work)
    parsed = run(
        [
            str(laptop),
            "-c",
            "import json, sky, sys; t = sky.Task.from_yaml(sys.argv[1]); "
            "print(json.dumps({'mounts': t.file_mounts, 'run': t.run}))",
            str(rendered),
        ],
        cwd=work,
    )
    task = json.loads(parsed.stdout.strip().splitlines()[-1])
    assert task["mounts"][remote] == str(data)
    assert f"--set dataset.path={remote}" in task["run"]


def write_dist_info(site: Path, direct_url: dict | None) -> metadata.Distribution:
    """An installed forgesky's metadata folder as pip leaves it, in a folder of its own."""
    info = site / f"forgesky-{VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: forgesky\nVersion: {VERSION}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return metadata.PathDistribution(info)


def test_an_install_from_an_index_installs_the_same_release(tmp_path):
    source = installed_source(write_dist_info(tmp_path, None))
    assert source.kind == "release" and source.workdir is None
    assert list(source.mounts) == [LOCK_MOUNT]  # the lock alone
    assert source.requirement == f"'forgesky[runtime]=={VERSION}'"


def test_a_vcs_install_also_takes_the_release(tmp_path):
    url = {"url": "https://github.com/x/forgesky.git", "vcs_info": {"vcs": "git"}}
    assert installed_source(write_dist_info(tmp_path, url)).kind == "release"


def test_a_wheel_that_is_gone_is_one_clear_error(tmp_path):
    gone = tmp_path / "dist" / WHEEL_NAME
    url = {"url": gone.as_uri(), "archive_info": {}}
    with pytest.raises(UserError, match="which is gone"):
        installed_source(write_dist_info(tmp_path / "site", url))
    gone.parent.mkdir()
    gone.write_bytes(b"")
    source = installed_source(write_dist_info(tmp_path / "site2", url))
    assert source.kind == "wheel"
    assert source.mounts[f"{WHEEL_MOUNT_DIR}/{WHEEL_NAME}"] == str(gone)


def test_a_folder_install_syncs_that_checkout_if_it_still_is_one(tmp_path):
    url = {"url": PROJECT_DIR.as_uri(), "dir_info": {}}
    source = installed_source(write_dist_info(tmp_path / "a", url))
    assert source.kind == "checkout" and source.workdir == str(PROJECT_DIR)
    url = {"url": tmp_path.as_uri(), "dir_info": {}}
    with pytest.raises(UserError, match="no longer a forgesky source tree"):
        installed_source(write_dist_info(tmp_path / "b", url))


def test_this_checkout_is_a_checkout_and_site_packages_is_not():
    assert is_checkout(PROJECT_DIR)
    assert project_source(PROJECT_DIR).workdir == str(PROJECT_DIR)
    assert not is_checkout(Path(sysconfig.get_paths()["purelib"]))
