"""sky/*.yaml: generated from the catalog, current, and accepted by SkyPilot's own parser."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

import sky
from launcher import write_sky
from launcher.cli import main
from recipes import launch_gpus, list_recipes, load_recipe, minimum_gpus, plan
from recipes.memory import disk_plan

REPO = Path(__file__).resolve().parent.parent
SKY_DIR = REPO / "sky"
FILES = sorted(p.name for p in SKY_DIR.glob("*.yaml"))


def test_sky_dir_is_current():
    """Fails when a recipe or the launcher changed without `python -m launcher.write_sky`."""
    expected = write_sky.generate()
    assert sorted(expected) == FILES
    stale = [name for name, text in expected.items() if (SKY_DIR / name).read_text() != text]
    assert not stale, f"regenerate with `python -m launcher.write_sky`: {stale}"


def test_catalog_index_is_current():
    """`forgesky recipes` lists recipes/catalog/index.json: it must say what the recipes say."""
    from launcher import catalog

    assert catalog.INDEX.read_text() == catalog.index_text(), (
        "regenerate with `python -m launcher.write_sky`"
    )


def test_every_recipe_has_a_cluster_and_a_spot_file():
    assert sorted(f"{n}{suffix}.yaml" for n in list_recipes() for suffix in ("", "-spot")) == FILES


def test_write_sky_writes_and_prunes(tmp_path):
    (tmp_path / "gone.yaml").write_text("name: old\n")
    written = write_sky.write(tmp_path)
    assert sorted(p.name for p in written) == FILES
    assert not (tmp_path / "gone.yaml").exists()
    assert (tmp_path / "qwen3-8b.yaml").read_text() == (SKY_DIR / "qwen3-8b.yaml").read_text()


def test_cli_render_writes_the_same_file(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sky").mkdir()
    assert main(["render", "qwen3-8b", "--managed", "--spot", "-o", "sky/qwen3-8b-spot.yaml"]) == 0
    written = (tmp_path / "sky" / "qwen3-8b-spot.yaml").read_text()
    assert written == (SKY_DIR / "qwen3-8b-spot.yaml").read_text()


@pytest.mark.parametrize("file_name", FILES)
def test_skypilot_parses_the_file(file_name):
    text = (SKY_DIR / file_name).read_text()
    config = yaml.safe_load(text)
    # from_yaml_config empties the dict it gets.
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    spot = file_name.endswith("-spot.yaml")
    recipe = load_recipe(file_name.removesuffix(".yaml").removesuffix("-spot"))
    need = minimum_gpus(recipe)
    launched = launch_gpus(recipe)
    expected_plan = plan(recipe, launched)

    assert task.name == f"{recipe.kind}-{recipe.name}"
    assert task.num_nodes == expected_plan.num_nodes
    assert task.workdir == "."
    if recipe.cpu:
        assert [r.accelerators for r in task.resources] == [None]
    else:
        per_node = expected_plan.gpus_per_node
        wanted = [recipe.resources.accelerator, *recipe.resources.alternatives]
        assert [r.accelerators for r in task.resources] == [{a: per_node} for a in wanted]
        assert per_node * task.num_nodes == launched
        assert per_node in (1, 2, 4, 8)  # what VM clouds sell
    assert task.envs["MIN_GPUS"] == str(need)
    assert task.envs["MODEL"] == recipe.model.hf_id
    multi_node = {"FORGESKY_WORKER_PORT"} if expected_plan.num_nodes > 1 else set()
    assert set(task.envs) == {"MODEL", "MIN_GPUS", "MAX_STEPS", "WANDB_MODE"} | multi_node
    # Nothing is opened to the internet: the nodes reach each other inside the cluster.
    assert all(r.ports is None for r in task.resources)
    # No secret values in a committed file: empty slots, or references for needed ones.
    assert all(v.get_secret_value() == "" for v in task.secrets.values())
    refs = {ref.name for ref in task.managed_secret_refs}
    assert refs == ({"HF_TOKEN"} if recipe.model.gated else set())
    assert set(task.secrets) | refs == {"HF_TOKEN", "WANDB_API_KEY"}
    assert f"--recipe {recipe.name} " in task.run
    assert "python -m runtime" in task.run

    for r in task.resources:
        # what the run writes: with a checkpoint bucket only the checkpoints in flight stay local
        assert r.disk_size == disk_plan(recipe, bucket=bool(task.storage_mounts))["total"]
        assert bool(r.use_spot) is spot
        if spot:
            strategy = r.job_recovery["strategy"]
            # SkyPilot checks names only on its server; its registry is the same check.
            assert sky.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(strategy) is not None
            assert strategy == "EAGER_NEXT_REGION"
        else:
            assert r.job_recovery is None


@pytest.mark.parametrize("file_name", FILES)
def test_header_gives_the_commands(file_name):
    text = (SKY_DIR / file_name).read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    name = file_name.removesuffix(".yaml").removesuffix("-spot")
    secret = " --secret HF_TOKEN" if load_recipe(name).model.gated else ""
    if file_name.endswith("-spot.yaml"):
        commands = [
            f"#   sky jobs launch -n {load_recipe(name).kind}-{name} sky/{file_name}{secret}",
            f"#   sky jobs logs -n {load_recipe(name).kind}-{name}",
            f"#   sky jobs cancel -n {load_recipe(name).kind}-{name}",
        ]
    else:
        commands = [
            f"#   sky launch -c {load_recipe(name).kind}-{name} sky/{file_name}{secret}",
            f"#   sky logs {load_recipe(name).kind}-{name}",
            f"#   sky down {load_recipe(name).kind}-{name}",
        ]
    for command in commands:
        assert command in header
    assert f"-o sky/{file_name}`" in header[2]


def test_bucket_and_recovery_render_as_skypilot_reads_them(capsys):
    argv = ["render", "qwen3-1.7b", "--managed", "--spot", "--recovery", "failover"]
    argv += ["--max-restarts-on-errors", "2", "--checkpoint-bucket", "r2://ckpt/run1"]
    assert main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["file_mounts"]["/checkpoints"]["mode"] == "MOUNT_CACHED"
    assert config["resources"]["job_recovery"] == {
        "strategy": "FAILOVER",
        "max_restarts_on_errors": 2,
        "recover_on_exit_codes": [75],
    }
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert task.storage_mounts["/checkpoints"].source == "r2://ckpt/run1"
    for r in task.resources:
        assert sky.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(r.job_recovery["strategy"]) is not None


@pytest.mark.parametrize(
    "url",
    [
        "s3://me/ckpt/sft-qwen3-1.7b-sft/model",
        "gs://me/sft/model",
        "r2://me/sft/model",
        "cos://us-east/me/sft/model",
        "oci://me/sft/model",
        "nebius://me/sft/model",
        "cw://me/sft/model",
        "vastdata://me/sft/model",
        "https://acct.blob.core.windows.net/me/sft/model",
    ],
)
def test_a_model_in_a_bucket_renders_as_a_copy_skypilot_reads(capsys, url):
    """Every store forgesky takes a model from: a plain file mount from the URL (SkyPilot's
    COPY), beside the checkpoint bucket's mount in a managed job."""
    from recipes.buckets import BUCKET_SCHEMES

    assert url.split("://")[0] in BUCKET_SCHEMES
    argv = ["render", "qwen3-1.7b", "--set", f"model.hf_id={url}", "--managed", "--spot"]
    assert main([*argv, "--checkpoint-bucket", "s3://ckpt/runs"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert task.file_mounts["/forgesky/files/model.hf_id/model"] == url
    assert task.envs["MODEL"] == "/forgesky/files/model.hf_id/model"
    assert list(task.storage_mounts) == ["/checkpoints"]


@pytest.mark.parametrize("url", ["s3://me/sft/model", "gs://me/sft/model", "cw://me/sft/model"])
def test_skypilot_copies_a_bucket_model_to_its_node_path(capsys, url):
    """The command SkyPilot runs on each node for the rendered mount (its own code builds it;
    stores whose command needs credentials to build are left to the parse above)."""
    from sky import cloud_stores

    assert main(["render", "qwen3-1.7b", "--set", f"model.hf_id={url}"]) == 0
    task = sky.Task.from_yaml_config(yaml.safe_load(capsys.readouterr().out))
    [(node, source)] = [(k, v) for k, v in task.file_mounts.items() if "://" in v]
    command = cloud_stores.get_storage_from_path(source).make_sync_dir_command(source, node)
    assert command.endswith(f"me/sft/model {node}") or f"me/sft/model {node} " in command
    assert node == "/forgesky/files/model.hf_id/model" == task.envs["MODEL"]
