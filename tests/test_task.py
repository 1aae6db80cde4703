"""The SkyPilot task that `forgesky launch` hands to the cloud.

Only the final SDK calls are replaced (sky.launch, sky.jobs.launch and the request waits: see
tests/fake_sky.py); the Task they receive is SkyPilot's real object and is checked field by
field, and the node scripts are run with bash. The cluster commands are in
tests/test_cloud_commands.py.
"""

from __future__ import annotations

import copy
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from fake_sky import FakeSky

import sky
from launcher.cli import main
from launcher.options import PROJECT_DIR, LaunchOptions, resolve_job, secret_values
from launcher.scripts import LOCK_MOUNT, RUNTIME_STACK, TORCHSTORE, run_script, setup_script
from launcher.source import checkout
from launcher.task import build_task

TOKEN = "hf_secret_value_never_printed"
WANDB_KEY = "wandb_secret_value_never_printed"


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)


def launch(monkeypatch, capsys, *argv):
    fake = FakeSky(
        monkeypatch,
        {"request-sky.launch": (1, None), "request-sky.jobs.launch": ([7], None)},
    )
    code = main(["launch", *argv, "--yes"])
    out, err = capsys.readouterr()
    assert TOKEN not in out + err and WANDB_KEY not in out + err
    return code, fake, out, err


def resources(task: sky.Task) -> list[sky.Resources]:
    assert isinstance(task.resources, list), "accelerators must be an ordered preference"
    return task.resources


# --- launch ------------------------------------------------------------------------------------


def test_launch_builds_a_cluster_task(monkeypatch, capsys, env):
    code, fake, out, _ = launch(monkeypatch, capsys, "qwen3-8b", "--gpus", "8")
    assert code == 0
    assert fake.names() == ["sky.launch", "stream_and_get"]
    _, args, kwargs = fake.calls[0]
    assert kwargs["cluster_name"] == "grpo-qwen3-8b"
    task = fake.task()
    assert [r.accelerators for r in resources(task)] == [{"H100": 8}, {"H200": 8}]
    # what an 8B run writes: 4 checkpoints of 12 bytes a parameter, the model twice, software
    assert all(r.disk_size == 500 and not r.use_spot for r in task.resources)
    # node 0's memory: the checkpoint's staging copy (12 bytes a parameter, 98 GB) and an
    # allowance for 8 GPU processes and the rest (80 GB), to 16 GB
    # checkpoint copy 98 + export 7.5 (a file's weights and a group) + processes 80, rounded
    # up to 16 GB
    assert all(r.memory == "192+" for r in task.resources)
    assert all(r.job_recovery is None for r in task.resources)
    assert task.num_nodes == 1
    assert task.workdir == str(PROJECT_DIR)
    assert task.envs == {
        "MODEL": "Qwen/Qwen3-8B",
        "MIN_GPUS": "4",  # with services sharing GPUs (5 with a GPU for each)
        "MAX_STEPS": "",
        "WANDB_MODE": "disabled",
    }
    # Secrets ride as SkyPilot secrets (redacted in its YAML and logs), never as envs.
    assert set(task.secrets) == {"HF_TOKEN", "WANDB_API_KEY"}
    assert task.secrets["HF_TOKEN"].get_secret_value() == TOKEN
    assert TOKEN not in str(task.envs) and TOKEN not in task.run
    assert task.storage_mounts == {}
    assert "GPUS=$(( ${SKYPILOT_NUM_GPUS_PER_NODE:-0} * ${SKYPILOT_NUM_NODES:-1} ))" in task.run
    assert 'if [ "$GPUS" -lt "$MIN_GPUS" ]' in task.run
    assert 'python -m runtime "${ARGS[@]}" &' in task.run
    assert "--recipe qwen3-8b" in task.run
    assert "--run-dir runs/grpo-qwen3-8b" in task.run
    assert "job 1 running on cluster grpo-qwen3-8b" in out


def test_launch_multi_node_sets_nodes_and_per_node_gpus(monkeypatch, capsys, env):
    code, fake, _, _ = launch(monkeypatch, capsys, "qwen3-8b", "--gpus", "16")
    assert code == 0
    task = fake.task()
    assert task.num_nodes == 2
    assert [r.accelerators for r in task.resources] == [{"H100": 8}, {"H200": 8}]
    # Every node listens on this port; SkyPilot lets a cluster's nodes reach each other, and
    # nothing is opened to the internet.
    assert task.envs["FORGESKY_WORKER_PORT"] == "26600"
    assert all(r.ports is None for r in task.resources)
    code, fake, _, _ = launch(
        monkeypatch, capsys, "qwen3-8b", "--gpus", "8", "--gpus-per-node", "4"
    )
    task = fake.task()
    assert task.num_nodes == 2
    assert [r.accelerators for r in task.resources] == [{"H100": 4}, {"H200": 4}]
    # The node plans from the recipe, so the per-node count travels as an override.
    assert "--set resources.gpus_per_node=4" in task.run


def test_launch_managed_spot_with_bucket(monkeypatch, capsys, env):
    code, fake, out, _ = launch(
        monkeypatch,
        capsys,
        "qwen3-8b",
        "--gpus",
        "8",
        "--managed",
        "--spot",
        "--checkpoint-bucket",
        "s3://my-bucket/forgesky",
        "--max-restarts-on-errors",
        "3",
        "--infra",
        "aws",
        "--name",
        "my-run",
    )
    assert code == 0
    assert fake.names() == ["sky.jobs.launch", "stream_and_get"]
    assert fake.calls[0][2]["name"] == "my-run"
    task = fake.task()
    assert task.name == "my-run"
    for r in task.resources:
        assert r.use_spot
        assert r.job_recovery == {
            "strategy": "EAGER_NEXT_REGION",
            "max_restarts_on_errors": 3,
            "recover_on_exit_codes": [75],
        }
        assert str(r.cloud).lower() == "aws"
    storage = task.storage_mounts["/checkpoints"]
    assert storage.source == "s3://my-bucket/forgesky"
    assert storage.mode == sky.StorageMode.MOUNT_CACHED
    assert "--run-dir /checkpoints/my-run" in task.run
    assert "managed job my-run submitted (id 7)" in out


def test_launch_recovery_failover(monkeypatch, capsys, env):
    code, fake, _, _ = launch(
        monkeypatch, capsys, "qwen3-1.7b", "--managed", "--recovery", "failover"
    )
    assert code == 0
    assert {r.job_recovery["strategy"] for r in fake.task().resources} == {"FAILOVER"}
    assert not any(r.use_spot for r in fake.task().resources)


def test_launch_knobs_become_envs(monkeypatch, capsys, env):
    code, fake, _, _ = launch(
        monkeypatch,
        capsys,
        "qwen3-1.7b",
        "--steps",
        "20",
        "--wandb",
        "online",
        "--set",
        "model.hf_id=Qwen/Qwen3-1.7B-Base",
        "--set",
        "grpo.learning_rate=2e-6",
    )
    assert code == 0
    task = fake.task()
    assert task.envs["MAX_STEPS"] == "20"
    assert task.envs["WANDB_MODE"] == "online"
    assert task.envs["MODEL"] == "Qwen/Qwen3-1.7B-Base"
    assert task.secrets["WANDB_API_KEY"].get_secret_value() == WANDB_KEY
    # The node re-applies overrides; the model id travels as $MODEL instead of a second --set.
    assert "--set grpo.learning_rate=2e-6" in task.run
    assert "model.hf_id=Qwen/Qwen3-1.7B-Base" not in task.run


def test_launch_gated_model_with_token_checks_it_on_the_node(monkeypatch, capsys, env):
    code, fake, _, _ = launch(monkeypatch, capsys, "llama3.2-1b")
    assert code == 0
    task = fake.task()
    assert task.secrets["HF_TOKEN"].get_secret_value() == TOKEN
    assert "is gated on the Hugging Face Hub" in task.run


def test_launch_optional_secrets_missing_are_empty(monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code, fake, _, _ = launch(monkeypatch, capsys, "qwen3-0.6b")
    assert code == 0
    secrets = fake.task().secrets
    assert {k: v.get_secret_value() for k, v in secrets.items()} == {
        "HF_TOKEN": "",
        "WANDB_API_KEY": "",
    }


def test_launch_cpu_recipe_asks_for_cpus(monkeypatch, capsys, env):
    code, fake, _, _ = launch(monkeypatch, capsys, "tiny")
    assert code == 0
    (r,) = fake.task().resources
    assert r.accelerators is None
    assert r.cpus == "8+"
    assert '--gpus "$GPUS"' in fake.task().run


def test_launch_dryrun_calls_no_cloud_and_prints_no_secret(monkeypatch, capsys, env):
    code, fake, out, err = launch(monkeypatch, capsys, "llama3.1-8b", "--dryrun")
    assert code == 0
    assert fake.calls == []
    assert "nothing launched" in err
    rendered = yaml.safe_load(out[out.index("# forgesky recipe") :])
    assert rendered["secrets"] == {"HF_TOKEN": None, "WANDB_API_KEY": ""}


def test_launch_down_is_for_clusters(monkeypatch, capsys, env):
    code, fake, _, _ = launch(monkeypatch, capsys, "qwen3-1.7b", "--down")
    assert code == 0
    assert fake.calls[0][2]["down"] is True
    code, fake, _, err = launch(monkeypatch, capsys, "qwen3-1.7b", "--down", "--managed")
    assert code == 2 and fake.calls == []
    assert err.startswith("forgesky: error: --down")


# --- render: the same task, secrets as placeholders ----------------------------------------------


def test_render_shows_secret_keys_without_values(capsys, env):
    assert main(["render", "llama3.1-8b", "--wandb", "online"]) == 0
    out = capsys.readouterr().out
    assert TOKEN not in out and WANDB_KEY not in out
    config = yaml.safe_load(out)
    # Needed secrets are references SkyPilot refuses to launch without; others empty slots.
    assert config["secrets"] == {"HF_TOKEN": None, "WANDB_API_KEY": None}
    assert main(["render", "qwen3-8b"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["secrets"] == {
        "HF_TOKEN": "",
        "WANDB_API_KEY": "",
    }


def test_render_parses_back_into_the_same_task(capsys):
    argv = ["render", "qwen3-8b", "--gpus", "16", "--managed", "--spot"]
    argv += ["--checkpoint-bucket", "gs://b/ckpt", "--recovery", "failover"]
    assert main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    parsed = sky.Task.from_yaml_config(copy.deepcopy(config))
    job = resolve_job(
        "qwen3-8b",
        LaunchOptions(
            gpus=16, managed=True, spot=True, checkpoint_bucket="gs://b/ckpt", recovery="failover"
        ),
    )
    built = build_task(job, secret_values(job, None), checkout("."))
    assert parsed.num_nodes == built.num_nodes == 2
    assert [r.accelerators for r in parsed.resources] == [r.accelerators for r in built.resources]
    assert [r.job_recovery for r in parsed.resources] == [r.job_recovery for r in built.resources]
    assert parsed.envs == built.envs
    assert parsed.run == built.run and parsed.setup == built.setup
    assert parsed.storage_mounts["/checkpoints"].mode == sky.StorageMode.MOUNT_CACHED
    # SkyPilot re-derives what the render leaves out (its underscore keys).
    assert all(r.requires_fuse for r in parsed.resources)


# --- the node scripts --------------------------------------------------------------------------


def test_setup_installs_exactly_the_locked_stack_with_uv():
    script = setup_script()
    lock = (PROJECT_DIR / "launcher" / "node-stack.txt").read_text()
    for pin in RUNTIME_STACK:  # the GPU stack's pins are in the lock the nodes sync to
        assert f"\n{pin}\n" in lock
    assert "torch==2.11.0" in RUNTIME_STACK and "vllm==0.24.0" in RUNTIME_STACK
    syncs = [line for line in script.splitlines() if "uv pip sync" in line]
    assert syncs == [
        'python3 -m uv pip sync --python "$HOME/forgesky-venv/bin/python" --only-binary :all: '
        f"{LOCK_MOUNT}"
    ]
    # then forgesky and torchstore, neither pulling anything in
    installs = [line for line in script.splitlines() if "uv pip install" in line]
    assert len(installs) == 2 and all("--no-deps" in line for line in installs)
    assert installs[0].endswith("-e '.[runtime]'")
    assert installs[1].endswith(f"--only-binary :all: {TORCHSTORE}")
    assert "uv venv --python 3.12" in script
    commands = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert "git clone" not in commands and "git+" not in commands
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


@pytest.fixture
def node(tmp_path):
    """A HOME with a venv whose `python` records its arguments instead of training."""
    home = tmp_path / "home"
    bindir = home / "forgesky-venv" / "bin"
    bindir.mkdir(parents=True)
    stub = bindir / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$HOME/args"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)

    def run(script: str, **envs: str) -> tuple[int, list[str], str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(home), **envs}
        result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
        args_file = home / "args"
        args = args_file.read_text().splitlines() if args_file.exists() else []
        if args_file.exists():
            args_file.unlink()
        return result.returncode, args, result.stderr

    return run


def _script(gated=False, overrides=()):
    return run_script(
        recipe_name="qwen3-8b",
        recipe_ref="qwen3-8b",
        gated=gated,
        run_dir="/checkpoints/grpo-qwen3-8b",
        overrides=overrides,
    )


BASE_ENV = {"MODEL": "Qwen/Qwen3-8B", "MIN_GPUS": "5", "MAX_STEPS": "", "WANDB_MODE": "disabled"}


def test_run_refuses_fewer_gpus_than_the_minimum(node):
    code, args, err = node(
        _script(), **BASE_ENV, SKYPILOT_NUM_GPUS_PER_NODE="4", SKYPILOT_NUM_NODES="1"
    )
    assert code == 2
    assert args == []
    assert "forgesky: error: recipe qwen3-8b needs at least 5 GPUs" in err
    assert "this cluster has 4 (1 node(s) x 4)" in err


def test_run_starts_the_runtime_with_the_gpus_it_got(node):
    code, args, _ = node(
        _script(overrides=("grpo.kl_beta=0.05",)),
        **{**BASE_ENV, "MAX_STEPS": "20", "WANDB_MODE": "offline"},
        SKYPILOT_NUM_GPUS_PER_NODE="8",
        SKYPILOT_NUM_NODES="2",
    )
    assert code == 0
    assert args[:2] == ["-m", "runtime"]
    flags = args[2:]
    assert flags[flags.index("--recipe") + 1] == "qwen3-8b"
    assert flags[flags.index("--gpus") + 1] == "16"
    assert flags[flags.index("--wandb") + 1] == "offline"
    assert flags[flags.index("--steps") + 1] == "20"
    assert flags[flags.index("--run-dir") + 1] == "/checkpoints/grpo-qwen3-8b"
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    assert sets == ["model.hf_id=Qwen/Qwen3-8B", "grpo.kl_beta=0.05"]


def test_run_without_max_steps_keeps_the_recipe_steps(node):
    code, args, _ = node(_script(), **BASE_ENV, SKYPILOT_NUM_GPUS_PER_NODE="5")
    assert code == 0
    assert "--steps" not in args


def test_run_gated_model_needs_a_token_on_the_node(node):
    code, args, err = node(
        _script(gated=True), **BASE_ENV, SKYPILOT_NUM_GPUS_PER_NODE="8", HF_TOKEN=""
    )
    assert code == 2 and args == []
    assert "is gated" in err and "--secret HF_TOKEN" in err
    code, args, _ = node(
        _script(gated=True), **BASE_ENV, SKYPILOT_NUM_GPUS_PER_NODE="8", HF_TOKEN="t"
    )
    assert code == 0 and args


def test_project_dir_is_the_repository():
    assert (PROJECT_DIR / "pyproject.toml").is_file()
    assert Path(PROJECT_DIR / "launcher" / "task.py").is_file()


def test_bucket_schemes_are_the_stores_skypilot_mounts():
    from sky.data import storage

    from recipes.buckets import BUCKET_SCHEMES

    prefixes = set()
    for store in storage.StoreType:
        if store is not storage.StoreType.VOLUME:
            prefixes.add(store.store_prefix().split("://")[0])
    # Hugging Face buckets are left out: a checkpoint mount needs a writable object store.
    assert prefixes - set(BUCKET_SCHEMES) == {"hf"}
    assert set(BUCKET_SCHEMES) <= prefixes
    # and a model folder in any of them is a file mount SkyPilot knows how to copy
    from sky import cloud_stores

    for scheme in BUCKET_SCHEMES:
        host = "acct.blob.core.windows.net/container" if scheme == "https" else "bucket"
        assert cloud_stores.get_storage_from_path(f"{scheme}://{host}/model") is not None


def test_one_node_tasks_have_no_worker_port(monkeypatch, capsys, env):
    code, fake, _, _ = launch(monkeypatch, capsys, "qwen3-8b", "--gpus", "8")
    assert code == 0
    assert "FORGESKY_WORKER_PORT" not in fake.task().envs


def test_node_plans_exactly_what_the_launcher_planned(node, monkeypatch):
    """The run script's arguments, read by the runtime's own parser, give the launcher's plan."""
    from runtime.entry import parse_config
    from runtime.procs.cluster import check_plan_fits

    options = LaunchOptions(
        gpus=8, gpus_per_node=4, overrides=("grpo.kl_beta=0.05",), steps=20, wandb="offline"
    )
    job = resolve_job("qwen3-8b", options)
    task = build_task(job, secret_values(job, None), checkout("."))
    code, args, err = node(
        task.run, **task.envs, SKYPILOT_NUM_GPUS_PER_NODE="4", SKYPILOT_NUM_NODES="2"
    )
    assert code == 0, err
    config = parse_config(args[2:])
    assert config.plan == job.plan
    assert (config.plan.num_nodes, config.plan.gpus_per_node) == (2, 4)
    assert config.recipe.grpo.steps == 20
    assert config.recipe.grpo.kl_beta == 0.05
    assert config.wandb_mode == "offline"
    assert str(config.run_dir) == "runs/grpo-qwen3-8b"
    # What SkyPilot adds on each of the two nodes: the plan fits, and every node has the port.
    monkeypatch.setenv("SKYPILOT_NODE_IPS", "10.0.0.5\n10.0.0.6\n")
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "1")
    monkeypatch.setenv("FORGESKY_WORKER_PORT", task.envs["FORGESKY_WORKER_PORT"])
    config = parse_config(args[2:])
    check_plan_fits(config.plan, config.cluster)
    assert (config.cluster.rank, config.cluster.port) == (1, 26600)


def test_launch_without_gpus_asks_for_a_count_clouds_sell(monkeypatch, capsys, env):
    code, fake, _, err = launch(monkeypatch, capsys, "qwen3-1.7b")
    assert code == 0
    assert [r.accelerators for r in resources(fake.task())] == [{"H100": 4}, {"H200": 4}]
    # the node refuses fewer GPUs than any layout fits: 1 with every service sharing it
    assert fake.task().envs["MIN_GPUS"] == "1" and "note:" not in err
    code, fake, _, err = launch(monkeypatch, capsys, "qwen3-1.7b", "--gpus", "3")
    assert code == 0
    assert [r.accelerators for r in resources(fake.task())] == [{"H100": 3}, {"H200": 3}]
    assert "note: 3 GPUs a node: VM clouds sell 1, 2, 4 or 8" in err
