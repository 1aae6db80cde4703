"""Local files a recipe names (data, held-out data, a model or tokenizer folder) reach the nodes.

The rendered task is parsed by SkyPilot; its run script is run with bash (a `python` that
records its arguments), and those arguments are read by the runtime's own parser; the data is
then loaded by the runtime's own loader from where the task mounts it. The node's root is a
folder of the test (the mount folders are moved under it); copying each mount there is what
SkyPilot's rsync does. Only the final SkyPilot calls that would reach a cloud are replaced.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import tempfile
import urllib.parse
from pathlib import Path

import pytest
import torch
import yaml

import sky
from launcher import files, options
from launcher.cli import main
from recipes import UserError, apply_overrides, load_recipe
from recipes.loader import catalog_path

TINY = yaml.safe_load(catalog_path("tiny").read_text())
ROWS = [{"question": f"{i} + {i} =", "answer": str(2 * i)} for i in range(12)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_recipe(path: Path, **sections: dict) -> Path:
    """The tiny recipe with `sections` merged in, as a file at `path`."""
    recipe = copy.deepcopy(TINY)
    recipe["name"] = "tiny-mine"
    for name, values in sections.items():
        recipe[name] = {**recipe[name], **values}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture
def laptop(tmp_path, monkeypatch):
    """A recipe in one folder, its training data in another, held-out data next to the recipe,
    and a current directory that is neither."""
    data = write_jsonl(tmp_path / "datasets" / "train.jsonl", ROWS[:8])
    write_jsonl(tmp_path / "project" / "held-out.jsonl", ROWS[8:])
    recipe = write_recipe(
        tmp_path / "project" / "mine.yaml",
        dataset={"path": str(data), "prompt_template": "{question}"},
        eval={"path": "held-out.jsonl", "split": "test"},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return recipe


@pytest.fixture
def node_root(tmp_path, monkeypatch):
    """The node's filesystem root as a folder of this test: forgesky's mount folders under it."""
    root = tmp_path / "node"
    monkeypatch.setattr(files, "FILES_MOUNT_DIR", f"{root}{files.FILES_MOUNT_DIR}")
    monkeypatch.setattr(options, "RECIPE_MOUNT_DIR", f"{root}{options.RECIPE_MOUNT_DIR}")
    return root


def render(capsys, *argv: str) -> tuple[dict, sky.Task]:
    """The YAML `forgesky render` prints, and the task SkyPilot parses from it."""
    assert main(["render", *argv]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    return config, sky.Task.from_yaml_config(copy.deepcopy(config))


def sync_to(root: Path, task: sky.Task) -> None:
    """What SkyPilot does at launch for the mounts under the node's root: copy each there."""
    for remote, local in task.file_mounts.items():
        if remote.startswith(str(root)):
            Path(remote).parent.mkdir(parents=True, exist_ok=True)
            if Path(local).is_dir():
                shutil.copytree(local, remote)
            else:
                shutil.copy(local, remote)


def node_arguments(task: sky.Task, home: Path) -> list[str]:
    """The arguments the task's run script gives `python` on a node (one CPU node here)."""
    bindir = home / "forgesky-venv" / "bin"
    bindir.mkdir(parents=True)
    stub = bindir / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$HOME/args"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **task.envs}
    result = subprocess.run(["bash", "-c", task.run], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    args = (home / "args").read_text().splitlines()
    assert args[:2] == ["-m", "runtime"]
    return args[2:]


def sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_local_data_reaches_the_node_and_the_runtime_loads_it_there(
    laptop, node_root, tmp_path, capsys
):
    from runtime.entry import parse_config
    from runtime.tasks.data import build_prompt_source

    config, task = render(capsys, str(laptop))
    train = f"{node_root}/forgesky/files/dataset.path/train.jsonl"
    held_out = f"{node_root}/forgesky/files/eval.path/held-out.jsonl"
    # the data elsewhere on disk, and the held-out file next to the recipe
    assert config["file_mounts"][train] == str(tmp_path / "datasets" / "train.jsonl")
    assert config["file_mounts"][held_out] == str(tmp_path / "project" / "held-out.jsonl")
    assert task.file_mounts[train] == str(tmp_path / "datasets" / "train.jsonl")
    sync_to(node_root, task)
    shutil.rmtree(tmp_path / "datasets")  # the node reads its own copy, not the laptop's
    (tmp_path / "project" / "held-out.jsonl").unlink()

    args = node_arguments(task, tmp_path / "home")
    assert sets(args)[-2:] == [f"dataset.path={train}", f"eval.path={held_out}"]
    run = parse_config(args)
    assert (run.recipe.dataset.path, run.recipe.eval.path) == (train, held_out)
    source = build_prompt_source(run.recipe.dataset, shuffle=False)
    assert [p.answer for p in source.take(8)] == [r["answer"] for r in ROWS[:8]]
    held = build_prompt_source(
        run.recipe.dataset, split=run.recipe.eval.split, path=run.recipe.eval.path, shuffle=False
    )
    assert len(held) == 4 and held.prompt(0).text == ROWS[8]["question"]


def test_the_header_says_where_the_node_reads_each_file(laptop, capsys, tmp_path):
    assert main(["render", str(laptop)]) == 0
    header = capsys.readouterr().out.split("\n\n")[0]
    assert (
        f"#   dataset.path {tmp_path}/datasets/train.jsonl -> "
        "/forgesky/files/dataset.path/train.jsonl"
    ) in header


def test_launch_lists_the_files_and_hands_skypilot_their_mounts(
    laptop, monkeypatch, capsys, tmp_path
):
    handed = []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: handed.append(task) or "r")
    monkeypatch.setattr(sky, "stream_and_get", lambda request: ([3], None))
    argv = ["launch", str(laptop), "--managed", "--checkpoint-bucket", "s3://b/ckpt", "--yes"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    size = (tmp_path / "datasets" / "train.jsonl").stat().st_size
    assert f"to every node: dataset.path {tmp_path}/datasets/train.jsonl ({size} B) -> " in out
    (task,) = handed
    # a managed job too: SkyPilot uploads local file mounts to its jobs bucket itself, so the
    # data is a file mount beside the checkpoint bucket's storage mount
    assert "/forgesky/files/dataset.path/train.jsonl" in task.file_mounts
    assert list(task.storage_mounts) == ["/checkpoints"]


def test_a_relative_path_is_next_to_the_recipe_then_in_the_current_directory(
    tmp_path, monkeypatch, capsys
):
    write_jsonl(tmp_path / "project" / "data" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "cwd" / "other.jsonl", ROWS[:3])
    recipe = write_recipe(
        tmp_path / "project" / "mine.yaml",
        dataset={"path": "data/train.jsonl"},
        eval={"enabled": False},
    )
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_recipe(recipe).dataset.path == str(tmp_path / "project" / "data" / "train.jsonl")
    # a --set value is typed here: relative to the current directory
    config, _ = render(capsys, str(recipe), "--set", "dataset.path=other.jsonl")
    mounts = config["file_mounts"]
    assert mounts["/forgesky/files/dataset.path/other.jsonl"] == str(
        tmp_path / "cwd" / "other.jsonl"
    )
    assert not any(local.endswith("train.jsonl") for local in mounts.values())
    # the user's own --set is replaced by the node path, not passed on beside it
    assert "dataset.path=other.jsonl" not in config["run"]
    assert "--set dataset.path=/forgesky/files/dataset.path/other.jsonl" in config["run"]


def test_a_home_path_and_a_local_model_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write_jsonl(tmp_path / "home" / "data" / "train.jsonl", ROWS)
    model = tmp_path / "models" / "Qwen3-1.7B"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    recipe = yaml.safe_load(catalog_path("qwen3-1.7b").read_text())
    recipe["model"]["hf_id"] = str(model)
    recipe["dataset"]["path"] = "~/data/train.jsonl"
    recipe["eval"]["enabled"] = False
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config, task = render(capsys, str(path), "--gpus", "4")
    node_model = "/forgesky/files/model.hf_id/Qwen3-1.7B"
    assert task.file_mounts[node_model] == str(model)
    assert task.file_mounts["/forgesky/files/dataset.path/train.jsonl"] == str(
        tmp_path / "home" / "data" / "train.jsonl"
    )
    # the model travels as $MODEL, the task's knob for it
    assert task.envs["MODEL"] == node_model
    assert config["run"].count("model.hf_id=") == 1 and '"model.hf_id=$MODEL"' in config["run"]


def test_one_file_named_twice_is_one_mount(tmp_path, monkeypatch, capsys):
    import datasets

    saved = tmp_path / "gsm"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(saved))
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "mine.yaml", dataset={"path": "gsm"}, eval={"path": f"{saved}/", "split": "test"}
    )
    config, _ = render(capsys, str(recipe))
    mounted = {k: v for k, v in config["file_mounts"].items() if k.startswith("/forgesky/files")}
    assert mounted == {"/forgesky/files/dataset.path/gsm": str(saved)}
    assert "--set eval.path=/forgesky/files/dataset.path/gsm" in config["run"]


def test_remote_data_and_models_stay_as_they_are(tmp_path, capsys):
    for data in ("openai/gsm8k", "hf://datasets/org/x/train.jsonl", "s3://bucket/train.jsonl"):
        config, _ = render(
            capsys, "qwen3-1.7b", "--set", f"dataset.path={data}", "--set", "eval.enabled=false"
        )
        assert not any(k.startswith("/forgesky/files") for k in config["file_mounts"])
        assert f"--set dataset.path={data}" in config["run"]
        assert config["envs"]["MODEL"] == "Qwen/Qwen3-1.7B"


@pytest.mark.parametrize(
    "make, setting, message",
    [
        (lambda d: d / "missing.jsonl", "dataset.path", "no such file or folder ("),
        (lambda d: os.mkfifo(d / "fifo.jsonl") or d / "fifo.jsonl", "dataset.path",
         "not a regular file or folder"),
        (lambda d: (d / "notes.txt").write_text("x") and d / "notes.txt", "dataset.path",
         "unsupported file type; use .jsonl, .json, .csv, .parquet"),
        (lambda d: write_jsonl(d / "m" / "w.jsonl", ROWS) and d / "m" / "w.jsonl",
         "model.hf_id", "a file; name the model's folder"),
        (lambda d: (d / "m").mkdir() or (d / "m" / "config.json").symlink_to(d) or d / "m",
         "model.hf_id", "is a link, which reaches the nodes as a link"),
        (lambda d: (d / "m").mkdir() or os.mkfifo(d / "m" / "p") or d / "m",
         "model.tokenizer", "m/p is not a regular file or folder"),
    ],
)  # fmt: skip
def test_what_cannot_reach_the_nodes_is_refused_before_launch(
    tmp_path, monkeypatch, capsys, make, setting, message
):
    bad = make(tmp_path)
    monkeypatch.setattr(sky, "launch", lambda *a, **k: pytest.fail("launched"))
    overrides = [f"{setting}={bad}", "eval.enabled=false"]
    overrides += ["model.init=hub"] if setting == "model.hf_id" else []
    for command in (["render"], ["launch", "--yes"], ["validate"]):
        argv = [command[0], "tiny", *command[1:]]
        if command[0] == "validate":
            argv[1] = str(write_recipe(tmp_path / "r.yaml"))
        argv += [item for o in overrides for item in ("--set", o)]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"forgesky: error: {setting} ") and message in err, err


def unreadable_error(path: Path) -> str:
    """local_files' refusal of a recipe naming `path`, checked by a user the file denies (root
    reads anything: a forked child drops to nobody first)."""
    recipe = apply_overrides(load_recipe("tiny"), [f"dataset.path={path}", "eval.enabled=false"])
    if os.geteuid() != 0:
        with pytest.raises(UserError) as caught:
            files.local_files(recipe)
        return str(caught.value)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            files.local_files(recipe)
            os.write(write, b"accepted")
        except UserError as e:
            os.write(write, str(e).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read) as pipe:
        return pipe.read()


def test_an_unreadable_file_or_folder_is_refused():
    # a folder others may enter (the child runs as nobody), holding what nobody may read
    base = Path(tempfile.mkdtemp(prefix="forgesky-unreadable-"))
    try:
        base.chmod(0o755)
        secret = write_jsonl(base / "secret.jsonl", ROWS)
        secret.chmod(0)
        said = unreadable_error(secret)
        assert f"{secret} cannot be read (Permission denied)" in said, said
        closed = base / "closed"
        write_jsonl(closed / "train.jsonl", ROWS).chmod(0o644)
        closed.chmod(0)
        said = unreadable_error(closed)
        assert f"the folder {closed} cannot be read (Permission denied)" in said, said
    finally:
        for path in (base, base / "closed"):
            if path.exists():
                path.chmod(0o755)
        shutil.rmtree(base)


def test_an_eval_file_spelt_otherwise_is_still_the_training_file(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml", dataset={"path": "train.jsonl"}, eval={"path": "./train.jsonl"}
    )
    with pytest.raises(UserError, match="one data file, the one the run trains on"):
        load_recipe(recipe)


def test_two_packages_of_one_name_are_refused(tmp_path, monkeypatch, capsys):
    for root in ("project", "cwd"):
        package = tmp_path / root / "mycode"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    (tmp_path / "project" / "mycode" / "losses.py").write_text("def mine(inputs, config): ...\n")
    (tmp_path / "cwd" / "mycode" / "rewards.py").write_text("def exact(p, c, a): ...\n")
    recipe = write_recipe(
        tmp_path / "project" / "r.yaml",
        grpo={"loss": "mycode.losses:mine"},
        dataset={"rewards": [{"name": "mycode.rewards:exact"}]},
    )
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["render", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the nodes can import only one" in err, err


# --- folders in a bucket -------------------------------------------------------------------------


def copy_from_buckets(root: Path, task: sky.Task, buckets: Path) -> None:
    """What SkyPilot's COPY of a bucket source does at launch, for the mounts under the node's
    root: the bucket's folder (here buckets/<bucket>/<path>) copied there."""
    for remote, source in task.file_mounts.items():
        if remote.startswith(str(root)) and "://" in source:
            parts = urllib.parse.urlsplit(source)
            shutil.copytree(buckets / parts.netloc / parts.path.lstrip("/"), remote)


def test_sft_into_a_bucket_then_grpo_from_it(node_root, tmp_path, capsys):
    """The two commands: an SFT launch with --checkpoint-bucket says where its model folder
    lands; a GRPO recipe naming that URL gets a file mount SkyPilot copies from the bucket, and
    the runtime on the node starts from the SFT run's weights at the mount's node path."""
    from safetensors.torch import load_file

    from runtime.backends.build import initial_weights, model_spec
    from runtime.entry import parse_config
    from runtime.models import to_hf
    from runtime.sft.run import run as run_sft

    assert main(["launch", "tiny-sft", "--checkpoint-bucket", "s3://me/ckpt/", "--dryrun"]) == 0
    out = capsys.readouterr().out
    url = "s3://me/ckpt/sft-tiny-sft/model"
    assert f"model folder at the end: {url}; GRPO from it: --set model.hf_id={url}" in out
    assert "--run-dir /checkpoints/sft-tiny-sft" in out  # the bucket is mounted at /checkpoints
    buckets = tmp_path / "buckets"  # s3://me/ckpt is buckets/me/ckpt here
    run_sft(load_recipe("tiny-sft"), buckets / "me/ckpt/sft-tiny-sft", steps=2, log=lambda _: 0)
    capsys.readouterr()  # the run's progress lines

    # a trailing slash as a user may type it: SkyPilot refuses one on a mount's source
    config, task = render(capsys, "tiny", "--set", f"model.hf_id={url}/", "--set", "model.init=hub")
    node_model = f"{node_root}/forgesky/files/model.hf_id/model"
    assert config["file_mounts"][node_model] == url
    assert task.file_mounts[node_model] == url and task.envs["MODEL"] == node_model
    args = node_arguments(task, tmp_path / "home")
    # launched before the SFT run ended: SkyPilot's copy of a prefix holding nothing yet is no
    # folder or an empty one, refused before anything starts
    with pytest.raises(UserError, match="no such folder"):
        parse_config(args)
    Path(node_model).mkdir(parents=True)
    with pytest.raises(UserError, match="no config.json or \\*.safetensors in the folder"):
        parse_config(args)
    Path(node_model).rmdir()
    copy_from_buckets(node_root, task, buckets)
    recipe = parse_config(args).recipe
    assert recipe.model.hf_id == node_model
    spec = model_spec(recipe)
    start = to_hf(initial_weights(recipe, spec).state_dict(), spec)
    trained = load_file(buckets / "me/ckpt/sft-tiny-sft/model/model.safetensors")
    assert trained and all(torch.equal(start[k].float(), trained[k].float()) for k in trained)


def test_a_bucket_model_beside_a_checkpoint_bucket_in_a_managed_job(monkeypatch, capsys):
    handed = []
    monkeypatch.setattr(sky.jobs, "launch", lambda task, **kw: handed.append(task) or "r")
    monkeypatch.setattr(sky, "stream_and_get", lambda request: ([3], None))
    url = "gs://team/sft/qwen3-1.7b/model"
    argv = ["launch", "qwen3-1.7b", "--set", f"model.hf_id={url}", "--managed", "--spot",
            "--checkpoint-bucket", "s3://b/ckpt", "--yes"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    node_model = "/forgesky/files/model.hf_id/model"
    assert f"to every node: model.hf_id {url} (copied from the bucket) -> {node_model}" in out
    assert "model folder at the end: s3://b/ckpt/grpo-qwen3-1.7b/model\n" in out
    (task,) = handed
    assert task.file_mounts[node_model] == url and task.envs["MODEL"] == node_model
    assert list(task.storage_mounts) == ["/checkpoints"]
    # what SkyPilot makes of it again from the YAML it stores for the job
    again = sky.Task.from_yaml_config(task.to_yaml_config())
    assert again.file_mounts[node_model] == url


def test_a_tokenizer_in_a_bucket_and_the_header(capsys):
    model, tokenizer = "r2://models/qwen3/sft", "r2://models/qwen3/tokenizer"
    shared = ["--set", f"model.hf_id={model}", "--set", f"model.tokenizer={model}"]
    config, task = render(capsys, "qwen3-1.7b", *shared)
    mounted = {k: v for k, v in task.file_mounts.items() if k.startswith("/forgesky/files")}
    assert mounted == {"/forgesky/files/model.hf_id/sft": model}  # one folder, one mount
    assert "--set model.tokenizer=/forgesky/files/model.hf_id/sft" in config["run"]
    apart = ["--set", f"model.hf_id={model}", "--set", f"model.tokenizer={tokenizer}"]
    config, task = render(capsys, "qwen3-1.7b", *apart)
    assert task.file_mounts["/forgesky/files/model.tokenizer/tokenizer"] == tokenizer
    assert main(["render", "qwen3-1.7b", *apart]) == 0
    header = capsys.readouterr().out.split("\n\n")[0]
    assert "# Folders in a bucket are copied to every node as file_mounts" in header
    assert f"#   model.tokenizer {tokenizer} (copied from the bucket) -> " in header


def test_plan_says_the_model_comes_from_its_bucket_and_reads_nothing(capsys, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "socket", lambda *a, **k: pytest.fail("network used"))
    url = "s3://me/ckpt/sft-qwen3-1.7b-sft/model"
    assert main(["plan", "qwen3-1.7b", "--set", f"model.hf_id={url}"]) == 0
    assert (
        f"model.hf_id: {url}, a folder in a bucket: launch copies it to every node (not read now)"
    ) in capsys.readouterr().out
    assert main(["validate", "qwen3-1.7b", "--set", f"model.hf_id={url}"]) == 0
    assert f"ok (recipe qwen3-1.7b, {url}," in capsys.readouterr().out


@pytest.mark.parametrize(
    "url, leaf",
    [
        ("s3://me/ckpt/sft-x/model/", "model"),
        ("S3://me/ckpt/sft-x/Model", "Model"),
        ("gs://only-a-bucket", "only-a-bucket"),
        ("cos://us-east/bucket/m", "m"),
        ("https://acct.blob.core.windows.net/container/runs/m", "m"),
    ],
)
def test_a_bucket_folder_keeps_its_name_on_the_nodes(url, leaf):
    recipe = apply_overrides(load_recipe("qwen3-1.7b"), [f"model.hf_id={url}"])
    [shipped] = files.bucket_files(recipe)
    assert shipped.remote == f"{files.FILES_MOUNT_DIR}/model.hf_id/{leaf}"
    assert not shipped.source.endswith("/") and shipped.source.startswith(url.split(":")[0].lower())
