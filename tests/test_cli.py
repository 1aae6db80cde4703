"""The forgesky CLI on the laptop side: catalog commands, their speed-critical imports, and every
mistake a user can make ending as one line on stderr with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import sky
from launcher.cli import main
from recipes import launch_gpus, list_recipes, load_recipe, minimum_gpus

REPO = Path(__file__).resolve().parent.parent
FORGESKY = Path(sys.executable).parent / "forgesky"


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    """Exit 2, exactly one line on stderr in forgesky's format, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("forgesky: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def no_cloud(monkeypatch):
    """Fail the test if any command reaches a SkyPilot cloud call."""
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called")

        return call

    for name in ("launch", "stream_and_get", "get", "status", "down", "cancel", "tail_logs"):
        monkeypatch.setattr(sky, name, refuse(f"sky.{name}"))
    monkeypatch.setattr(sky.jobs, "launch", refuse("sky.jobs.launch"))
    return calls


# --- catalog commands ------------------------------------------------------------------------


def test_recipes_json_lists_every_catalog_recipe(capsys):
    code, out, _ = run_main(capsys, "recipes", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["name"] for r in rows] == list_recipes()
    by_name = {r["name"]: r for r in rows}
    assert by_name["qwen3-8b"]["model"] == "Qwen/Qwen3-8B"
    assert by_name["qwen3-8b"]["min_gpus"] == 5  # a GPU for each service
    assert by_name["qwen3-8b"]["min_gpus_shared"] == minimum_gpus(load_recipe("qwen3-8b")) == 4
    assert by_name["llama3.1-8b"]["gated"] is True
    assert by_name["qwen3-8b"]["gated"] is False
    assert by_name["tiny"]["min_gpus"] == 0
    assert all(isinstance(r["params"], int) and r["params"] > 0 for r in rows)


def test_recipes_table_has_a_row_per_recipe(capsys):
    code, out, _ = run_main(capsys, "recipes")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "MODEL", "PARAMS"]
    for name in list_recipes():
        row = next(line for line in lines if line.startswith(name + " "))
        recipe = load_recipe(name)
        assert recipe.model.hf_id in row
        assert f" {minimum_gpus(recipe)} " in row


def test_show_prints_the_catalog_file_and_the_minimum(capsys):
    code, out, _ = run_main(capsys, "show", "qwen3-8b")
    assert code == 0
    text = (REPO / "recipes/catalog/qwen3-8b.yaml").read_text()
    assert out.startswith(text.rstrip())
    assert "# derived: minimum 5 x H100" in out


def test_show_takes_a_file_path(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((REPO / "recipes/catalog/qwen3-1.7b.yaml").read_text())
    code, out, _ = run_main(capsys, "show", str(path))
    assert code == 0
    assert "hf_id: Qwen/Qwen3-1.7B" in out
    assert "# derived: minimum 3 x H100" in out


def test_plan_describes_nodes_and_json_matches(capsys):
    code, out, _ = run_main(capsys, "plan", "qwen3-8b", "--gpus", "16")
    assert code == 0
    assert "2 nodes x 8 GPUs" in out
    code, out, _ = run_main(capsys, "plan", "qwen3-8b", "--gpus", "16", "--json")
    data = json.loads(out)
    assert (data["total_gpus"], data["num_nodes"], data["gpus_per_node"]) == (16, 2, 8)


def test_plan_gpus_per_node_splits_nodes(capsys):
    argv = ["plan", "qwen3-8b", "--gpus", "8", "--gpus-per-node", "4", "--json"]
    code, out, _ = run_main(capsys, *argv)
    assert code == 0
    assert (json.loads(out)["num_nodes"], json.loads(out)["gpus_per_node"]) == (2, 4)


def test_plan_defaults_to_what_launch_asks_for(capsys):
    code, out, _ = run_main(capsys, "plan", "qwen3-1.7b", "--json")
    assert code == 0
    assert json.loads(out)["total_gpus"] == launch_gpus(load_recipe("qwen3-1.7b")) == 4


def test_plan_explain_weighs_every_layout(capsys):
    code, out, _ = run_main(capsys, "plan", "qwen3-8b", "--gpus", "4", "--explain")
    assert code == 0
    assert (
        "qwen3-8b on 4 x H100 (1 node x 4 GPUs; minimum 4 GPUs with services sharing, 5 with" in out
    )
    assert "layout.share all: every service shares every GPU" in out
    weighed = out[out.index("layouts weighed on 4 x H100") :].splitlines()
    rows: dict[str, list[str]] = {}
    for line in weighed[2:-1]:
        rows.setdefault(line.split()[1] if line.startswith("*") else line.split()[0], []).append(
            line
        )
    # a generator replica on each pair of GPUs would not leave the trainer's step room: one
    chosen, refused = rows["all"]
    assert chosen.startswith("*") and "generator0 0-1, reference 3, trainer 0-3" in chosen
    assert "generator0 0-1, generator1 2-3, reference 3, trainer 0-3" in refused
    # GPU 3 the fullest: the reference beside a trainer rank and generator1 (the push to
    # generator1 sends the ipc path's buffer: rank 0 keeps no second one on GPU 0)
    assert "while the trainer steps, node 0 GPU 3 would hold trainer" in refused
    rows = {share: lines[0] for share, lines in rows.items()}
    assert "needs at least 5 GPUs with GPUs of their own" in rows["none"]
    assert "while the trainer steps, node 0 GPU 3 would hold trainer" in rows["trainer_reference"]
    assert weighed[-1] == (
        "speeds from H200 qwen3-8b (measured), scaled to H100 by memory bandwidth and bf16 peak"
    )


def test_a_layout_share_that_does_not_exist_is_one_line(capsys):
    code, _, err = run_main(capsys, "plan", "qwen3-1.7b", "--set", "layout.share=some")
    assert_user_error(code, err, "layout.share")


def test_validate_a_good_file(capsys, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text((REPO / "recipes/catalog/qwen3-4b.yaml").read_text())
    code, out, _ = run_main(capsys, "validate", str(path))
    assert code == 0
    assert out.startswith(f"{path}: ok")


def test_cp_copies_and_refuses_to_overwrite_without_force(capsys, tmp_path):
    dest = tmp_path / "my-run.yaml"
    code, out, _ = run_main(capsys, "cp", "qwen3-8b", str(dest))
    assert code == 0
    assert dest.read_text() == (REPO / "recipes/catalog/qwen3-8b.yaml").read_text()
    dest.write_text(dest.read_text().replace("steps: 500", "steps: 7"))
    code, _, err = run_main(capsys, "cp", "qwen3-8b", str(dest))
    assert_user_error(code, err, str(dest), "--force")
    assert "steps: 7" in dest.read_text()
    code, _, _ = run_main(capsys, "cp", "qwen3-8b", str(dest), "--force")
    assert code == 0
    assert "steps: 7" not in dest.read_text()


def test_cp_to_a_blank_name_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "cp", "tiny", " ")
    assert_user_error(code, err, "blank")
    assert list(tmp_path.iterdir()) == []


def test_render_to_a_file_that_is_not_a_rendered_task_is_refused(capsys, tmp_path):
    recipe = tmp_path / "my.yaml"
    assert main(["cp", "qwen3-1.7b", str(recipe)]) == 0
    before = recipe.read_text()
    capsys.readouterr()
    # the recipe itself, as the rendered file's hint once suggested: refused, untouched
    code, _, err = run_main(capsys, "render", str(recipe), "-o", str(recipe))
    assert_user_error(code, err, "not a task forgesky rendered")
    assert recipe.read_text() == before
    code, _, err = run_main(capsys, "render", str(recipe), "-o", str(tmp_path))
    assert_user_error(code, err, "a folder")
    # a new file, then the same file again for another GPU count: rendering again is allowed
    task = tmp_path / "task.yaml"
    for gpus in ("4", "2"):
        code, _, err = run_main(capsys, "render", str(recipe), "--gpus", gpus, "-o", str(task))
        assert code == 0, err
    assert f"--gpus 2 -o {task}`" in task.read_text()
    assert "-o task.yaml" in task.read_text()  # the hint names a task file, not the recipe


def test_a_recipe_that_is_not_text_or_is_a_folder_gets_one_line(capsys, tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    for command in ("validate", "plan", "show"):
        code, _, err = run_main(capsys, command, str(binary))
        assert_user_error(code, err, "not a YAML text file")
    code, _, err = run_main(capsys, "plan", str(tmp_path) + "/")
    assert_user_error(code, err, "is a folder")


def test_cp_into_a_directory_keeps_the_name(capsys, tmp_path):
    code, _, _ = run_main(capsys, "cp", "tiny", str(tmp_path))
    assert code == 0
    assert load_recipe(str(tmp_path / "tiny.yaml")).name == "tiny"


def test_copied_recipe_runs_through_every_command(capsys, tmp_path):
    dest = tmp_path / "mine.yaml"
    assert main(["cp", "qwen3-1.7b", str(dest)]) == 0
    dest.write_text(dest.read_text().replace("steps: 500", "steps: 30"))
    capsys.readouterr()
    for argv in (["validate", str(dest)], ["plan", str(dest)], ["show", str(dest)]):
        code, out, err = run_main(capsys, *argv)
        assert code == 0, err
    code, out, _ = run_main(capsys, "render", str(dest))
    assert code == 0
    config = yaml.safe_load(out)
    # The edited file reaches the node through a file mount, and the node is told to use it.
    assert config["file_mounts"] == {
        "/forgesky/node-stack.txt": "./launcher/node-stack.txt",  # the lock the nodes sync to
        "/forgesky/recipes/mine.yaml": str(dest.resolve()),
    }
    assert "--recipe /forgesky/recipes/mine.yaml" in config["run"]


def test_catalog_commands_import_neither_skypilot_nor_torch(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from launcher.cli import main
        commands = [
            ["recipes"], ["recipes", "--json"], ["show", "qwen3-8b"],
            ["plan", "qwen3-8b", "--gpus", "8"], ["validate", "recipes/catalog/tiny.yaml"],
            ["cp", "qwen3-8b", {str(tmp_path / "x.yaml")!r}],
            ["plan", "qwen3-8b", "--cheapest", "--budget", "100"], ["prices"],
        ]
        for argv in commands:
            assert main(argv) == 0, argv
            heavy = [m for m in ("sky", "torch") if m in sys.modules]
            assert not heavy, (argv, heavy)
        print("clean")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("clean")


def test_bad_input_is_refused_before_skypilot_or_torch_loads(tmp_path):
    """What a command can tell from its arguments and the disk it says before loading SkyPilot
    or torch (seconds each): render a plan that does not fit, export from a path that is not
    there or into a folder that holds something, run a GPU recipe where there is no GPU."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full/notes.md").write_text("keep")
    script = textwrap.dedent(
        f"""
        import os, sys
        from launcher.cli import main
        os.environ["PATH"] = ""  # no nvidia-smi here
        commands = [
            ["render", "qwen3-8b", "--gpus", "2"],
            ["render", "qwen3-1.7b", "--set", "grpo.lr=1"],
            ["render", "qwen3-1.7b", "--gpus", "64"],
            ["plan", "qwen3-8b", "--cheapest", "--deadline", "1m"],
            ["export", {str(tmp_path / "none")!r}, "--out", {str(tmp_path / "m")!r}],
            ["export", {str(tmp_path)!r}, "--out", {str(tmp_path / "full")!r}],
        ]
        if not os.path.exists("/proc/driver/nvidia/gpus"):
            commands.append(["local", "qwen3-1.7b"])
        for argv in commands:
            assert main(argv) == 2, argv
            heavy = [m for m in ("sky", "torch") if m in sys.modules]
            assert not heavy, (argv, heavy)
        print("clean", len(commands))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("clean")
    assert (tmp_path / "full/notes.md").read_text() == "keep"


def test_version_and_copying_into_a_folder_that_is_not_there(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("forgesky ")
    code, _, err = run_main(capsys, "cp", "qwen3-8b", str(tmp_path / "nowhere") + "/")
    assert_user_error(code, err, "no such directory")
    assert not (tmp_path / "nowhere").exists()


# --- bad input: one line, exit 2, nothing launched ---------------------------------------------


def test_unknown_recipe_suggests_close_names(capsys, no_cloud):
    code, _, err = run_main(capsys, "plan", "qwen3-8")
    assert_user_error(code, err, "unknown recipe 'qwen3-8'", "qwen3-8b")
    code, _, err = run_main(capsys, "launch", "qwen-8b", "--yes")
    assert_user_error(code, err, "qwen3-8b")
    assert no_cloud == []


def test_malformed_yaml_names_file_and_line(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel:\n  hf_id: [unclosed\n  family: qwen3\n")
    code, _, err = run_main(capsys, "validate", str(path))
    assert_user_error(code, err, "broken.yaml:")
    line = err.split("broken.yaml:")[1].split(":")[0]
    assert line.isdigit() and int(line) >= 3


def test_wrong_type_and_unknown_key_name_their_path(capsys, tmp_path):
    base = yaml.safe_load((REPO / "recipes/catalog/qwen3-1.7b.yaml").read_text())
    wrong = {**base, "grpo": {**base["grpo"], "steps": "many"}}
    path = tmp_path / "wrong.yaml"
    path.write_text(yaml.safe_dump(wrong))
    code, _, err = run_main(capsys, "validate", str(path))
    assert_user_error(code, err, "grpo.steps")
    extra = {**base, "layout": {**base["layout"], "generater": {"tp": 1}}}
    path.write_text(yaml.safe_dump(extra))
    code, _, err = run_main(capsys, "plan", str(path))
    assert_user_error(code, err, "layout.generater")


def test_gpus_zero_or_below_minimum(capsys, no_cloud):
    for argv in (
        ["plan", "qwen3-8b", "--gpus", "0"],
        ["render", "qwen3-8b", "--gpus", "3"],
        ["launch", "qwen3-8b", "--gpus", "2", "--yes"],
        ["validate", "recipes/catalog/qwen3-8b.yaml", "--gpus", "1"],
    ):
        code, _, err = run_main(capsys, *argv)
        # both minimums: services sharing GPUs, and a GPU for each
        assert_user_error(code, err, "at least 4 GPUs on an H100 with services sharing them")
        assert "5 GPUs (generator 2 = TP2×1, reference 1, trainer 2 = FSDP2)" in err
    code, _, err = run_main(capsys, "validate", "recipes/catalog/qwen3-8b.yaml", "--gpus", "-1")
    assert_user_error(code, err, "--gpus -1: a GPU count is 0 or more")
    assert no_cloud == []


def test_an_impossible_clip_is_one_line_in_a_file_and_with_set(capsys, tmp_path, no_cloud):
    data = yaml.safe_load((REPO / "recipes/catalog/tiny.yaml").read_text())
    data["grpo"]["clip_low"] = 1.5
    path = tmp_path / "clip.yaml"
    path.write_text(yaml.safe_dump(data))
    code, _, err = run_main(capsys, "validate", str(path))
    assert_user_error(code, err, "clip.yaml: grpo.clip_low: must be in [0, 1], got 1.5")
    for argv in (
        ["validate", "tiny", "--set", "grpo.clip_low=1.5"],
        ["launch", "qwen3-8b", "--set", "grpo.clip_low=1.5", "--yes"],
    ):
        code, _, err = run_main(capsys, *argv)
        assert_user_error(code, err, "grpo.clip_low: must be in [0, 1], got 1.5")
    assert no_cloud == []


def test_an_engine_mode_vllm_has_not_is_one_line(capsys, no_cloud):
    code, _, err = run_main(capsys, "validate", "tiny", "--set", "generator.engine=both")
    assert_user_error(
        code, err, "generator.engine: Input should be 'in-process' or 'separate' (got 'both')"
    )
    assert no_cloud == []


def test_unknown_set_key(capsys, no_cloud):
    code, _, err = run_main(capsys, "render", "qwen3-8b", "--set", "grpo.stepz=3")
    assert_user_error(code, err, "grpo.stepz")
    code, _, err = run_main(capsys, "launch", "qwen3-8b", "--set", "nope=1", "--yes")
    assert_user_error(code, err, "nope")
    assert no_cloud == []


def test_tensor_parallel_that_does_not_divide_the_heads(capsys):
    # Qwen3-8B has 32 query heads and 8 KV heads: TP 3 cannot split them.
    code, _, err = run_main(capsys, "plan", "qwen3-8b", "--set", "layout.generator.tp=3")
    assert_user_error(code, err, "layout.generator.tp")


def test_gated_model_without_hf_token_launches_nothing(capsys, monkeypatch, no_cloud):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    code, _, err = run_main(capsys, "launch", "llama3.1-8b", "--yes")
    assert_user_error(code, err, "meta-llama/Meta-Llama-3.1-8B-Instruct is gated", "HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "")
    code, _, err = run_main(capsys, "launch", "llama3.1-8b", "--managed", "--yes")
    assert_user_error(code, err, "HF_TOKEN")
    assert no_cloud == []


def test_wandb_online_without_a_key_launches_nothing(capsys, monkeypatch, no_cloud):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code, _, err = run_main(capsys, "launch", "qwen3-1.7b", "--wandb", "online", "--yes")
    assert_user_error(code, err, "WANDB_API_KEY")
    assert no_cloud == []


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("my-bucket/ckpt", "not a bucket URL"),
        ("s4://bucket/ckpt", "did you mean s3://"),
        ("s3://", "bucket name"),
        ("gs://bad bucket/x", "bucket"),
        ("https://example.com/ckpt", "Azure"),
    ],
)
def test_bad_bucket_url(capsys, no_cloud, url, fragment):
    code, _, err = run_main(
        capsys, "launch", "qwen3-8b", "--managed", "--checkpoint-bucket", url, "--yes"
    )
    assert_user_error(code, err, "--checkpoint-bucket", fragment)
    assert no_cloud == []


@pytest.mark.parametrize("command", ["plan", "validate", "render", "launch"])
@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://host/model", "not a bucket URL; use s3://, gs://, r2://"),
        ("s4://bucket/model", "did you mean s3://"),
        ("hf://Qwen/Qwen3-1.7B", "or name a Hub model (Qwen/Qwen3-1.7B)"),
        ("s3:///model", "bucket name missing or invalid"),
        ("gs://bucket/model?v=2", "no spaces, '?' or '#'"),
        ("https://example.com/model", "Azure blob container"),
    ],
)
def test_a_bad_bucket_path_for_the_model_is_one_line_at_once(
    capsys, no_cloud, command, url, fragment
):
    argv = [command, "qwen3-1.7b", "--set", f"model.hf_id={url}"]
    started = time.monotonic()
    code, out, err = run_main(capsys, *argv, *(["--yes"] if command == "launch" else []))
    assert time.monotonic() - started < 1.0
    assert_user_error(code, err, f"model.hf_id={url}: model.hf_id: ", fragment)
    assert out == "" and no_cloud == []


def test_local_cannot_read_a_bucket(capsys):
    started = time.monotonic()
    code, out, err = run_main(
        capsys, "local", "tiny", "--set", "model.hf_id=s3://me/ckpt/sft-tiny-sft/model",
        "--set", "model.init=hub",
    )  # fmt: skip
    assert time.monotonic() - started < 1.0
    assert_user_error(
        code,
        err,
        "model.hf_id 's3://me/ckpt/sft-tiny-sft/model': a folder in a bucket, which forgesky "
        "local cannot read",
        "copy it to this machine",
    )
    assert out == ""


def test_a_managed_job_or_down_without_a_bucket_warns_the_model_folder_goes(
    capsys, monkeypatch, no_cloud
):
    code, out, err = run_main(capsys, "launch", "qwen3-1.7b-sft", "--managed", "--dryrun")
    assert code == 0
    assert "warning: no --checkpoint-bucket: the model folder goes with the cluster" in err
    code, out, err = run_main(capsys, "launch", "qwen3-1.7b-sft", "--dryrun")
    assert code == 0 and "warning" not in err
    assert (
        "model folder at the end: runs/sft-qwen3-1.7b-sft/model on node 0 of sft-qwen3-1.7b-sft"
    ) in out


def test_launch_steps_are_the_steps_its_time_and_price_count(capsys, no_cloud):
    import re

    code, out, _ = run_main(
        capsys, "launch", "qwen3-8b", "--gpus", "8", "--steps", "20", "--dryrun"
    )
    assert code == 0 and "run: 20 steps x " in out and "MAX_STEPS: '20'" in out
    short = float(re.search(r"= \$([\d.]+) for the run", out).group(1))
    code, out, _ = run_main(capsys, "launch", "qwen3-8b", "--gpus", "8", "--dryrun")
    assert code == 0 and "run: 500 steps x " in out
    assert float(re.search(r"= \$([\d.]+) for the run", out).group(1)) > 2 * short
    code, out, err = run_main(capsys, "launch", "qwen3-8b", "--steps", "0", "--dryrun")
    assert_user_error(code, err, "--steps must be at least 1 (got 0)")


def test_managed_only_options_need_managed(capsys):
    code, _, err = run_main(capsys, "render", "qwen3-8b", "--recovery", "failover")
    assert_user_error(code, err, "--managed")
    code, _, err = run_main(capsys, "render", "qwen3-8b", "--max-restarts-on-errors", "2")
    assert_user_error(code, err, "--managed")
    code, _, err = run_main(
        capsys, "render", "qwen3-8b", "--managed", "--max-restarts-on-errors", "-1"
    )
    assert_user_error(code, err, "--max-restarts-on-errors")


def test_bad_names_and_steps(capsys):
    code, _, err = run_main(capsys, "render", "qwen3-8b", "--name", "9lives")
    assert_user_error(code, err, "--name")
    code, _, err = run_main(capsys, "render", "qwen3-8b", "--steps", "0")
    assert_user_error(code, err, "--steps")


def test_a_disk_set_too_small_for_the_checkpoints_is_refused(capsys, no_cloud):
    # qwen3-8b: 393 GB of checkpoints kept on a node without a bucket, 197 with one (the one
    # being uploaded and the one being written), beside the model, its export and the software
    code, _, err = run_main(capsys, "plan", "qwen3-8b", "--set", "resources.disk_gb=100")
    assert_user_error(code, err, "resources.disk_gb 100", "even with a checkpoint bucket", "290")
    code, _, err = run_main(capsys, "launch", "qwen3-8b", "--set", "resources.disk_gb=300", "--yes")
    assert_user_error(code, err, "resources.disk_gb 300", "without a checkpoint bucket", "486")
    assert no_cloud == []
    # with a bucket 300 GB holds it, and plan says what it takes without one
    code, out, _ = run_main(capsys, "plan", "qwen3-8b", "--set", "resources.disk_gb=300")
    assert code == 0 and "enough only with --checkpoint-bucket: a node without one fills 486" in out
    code, out, _ = run_main(
        capsys,
        "render",
        "qwen3-8b",
        "--set",
        "resources.disk_gb=300",
        "--checkpoint-bucket",
        "s3://bucket/ckpt",
    )
    assert code == 0 and "disk_size: 300" in out


def test_unknown_infra(capsys, no_cloud):
    code, _, err = run_main(capsys, "launch", "qwen3-8b", "--infra", "awz", "--yes")
    assert_user_error(code, err, "--infra 'awz'", "aws")
    assert no_cloud == []


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["render", "qwen3-8b", "--managed", "--recovery", "sometimes"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "qwen3-8b", "--gpus", "eight"])
    assert exc.value.code == 2


def test_launch_without_a_terminal_needs_yes(capsys, monkeypatch, no_cloud):
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # noqa: SIM115 - closed by pytest
    code, _, err = run_main(capsys, "launch", "qwen3-1.7b")
    assert_user_error(code, err, "--yes")
    assert no_cloud == []


def test_console_script_reports_one_line_and_exit_2(tmp_path):
    broken = tmp_path / "bad.yaml"
    broken.write_text("name: [\n")
    for argv in (["show", "no-such-recipe"], ["validate", str(broken)]):
        result = subprocess.run(
            [str(FORGESKY), *argv], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1
        assert result.stderr.startswith("forgesky: error: ")
        assert result.stdout == ""


# --- local -------------------------------------------------------------------------------------


def test_local_forwards_to_the_runtime_entry(capsys):
    # The runtime's own argument checks answer, under forgesky's name: the forwarding is real.
    code, _, err = run_main(capsys, "local", "tiny", "--steps", "0")
    assert code == 2
    assert err.strip() == "forgesky: error: --steps must be at least 1 (got 0)"
    code, _, err = run_main(capsys, "local", "tiny", "--gpus", "2")
    assert code == 2
    assert "takes 0 GPUs" in err
    code, _, err = run_main(capsys, "local", "no-such")
    assert code == 2
    assert "unknown recipe 'no-such'" in err


LORA_ON_TINY = ("--set", "model.lora.rank=8", "--set", "layout.reference.device=trainer")


@pytest.mark.parametrize("command", ["plan", "validate"])
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("model.lora.rank=0", "model.lora.rank: a LoRA rank is at least 1"),
        ("model.lora.dropout=0.1", "model.lora.dropout: 0.1 is not supported"),
        ("model.lora.targets=[q]", "model.lora.targets: 'q' is not a qwen3 projection"),
        ("layout.reference.device=gpu", "set layout.reference.device=trainer"),
    ],
)
def test_a_bad_lora_setting_is_one_line_at_once(capsys, command, setting, expected):
    started = time.monotonic()
    code, out, err = run_main(capsys, command, "tiny-lora", "--set", setting)
    assert time.monotonic() - started < 1.0
    assert_user_error(code, err, expected)
    assert out == ""


def test_lora_is_set_on_a_recipe_without_it(capsys):
    code, out, err = run_main(capsys, "plan", "tiny", *LORA_ON_TINY)
    assert code == 0 and err == ""
    assert (
        "LoRA rank 8, alpha 16 (2 x rank) on all-linear (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
        in out
    )
    code, out, _ = run_main(capsys, "plan", "qwen3-1.7b", "--set", "model.lora.rank=16",
                            "--set", "layout.reference.device=trainer", "--json")  # fmt: skip
    assert code == 0
    assert json.loads(out)["settings"]["generator"]["max_lora_rank"] == 16


def test_lora_on_a_model_vllm_cannot_serve_it_for_is_refused(capsys):
    # vLLM's LoRA warm-up fails for a vocabulary smaller than the hidden size (tiny-gpu: 14
    # tokens, 256 wide; seen on an H200): refused in one line, the HF generator named instead
    code, _, err = run_main(capsys, "plan", "tiny-gpu", "--set", "model.lora.rank=16")
    assert_user_error(
        code,
        err,
        "tiny-gpu with model.lora.rank=16: model.lora: vLLM serves LoRA only for a vocabulary at "
        "least the hidden size (the qwen3 tiny-gpu model has 14 tokens, hidden size 256); set "
        "generator.backend=hf",
    )
    code, _, _ = run_main(
        capsys, "plan", "tiny-gpu", "--set", "model.lora.rank=16", "--set", "generator.backend=hf"
    )
    assert code == 0


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_a_count_clouds_do_not_sell_is_planned_with_a_line_saying_so(capsys, command):
    code, out, err = run_main(capsys, command, "qwen3-8b", "--gpus", "5")
    assert code == 0
    assert err.strip() == (
        "forgesky: note: 5 GPUs a node: VM clouds sell 1, 2, 4 or 8, so only a Kubernetes "
        "cluster may grant this"
    )
    assert "5 x H100" in out
    code, _, err = run_main(capsys, command, "qwen3-8b")  # the default: a count clouds sell
    assert code == 0 and err == ""


def test_local_without_a_recipe_asks_for_the_recipe_alone(capsys):
    with pytest.raises(SystemExit) as done:
        main(["local"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2
    assert err.startswith("forgesky local: error: the following arguments are required: NAME ")
    assert "OPTIONS" not in err and len(err.splitlines()) == 1


def test_local_refuses_a_second_recipe(capsys):
    code, _, err = run_main(capsys, "local", "tiny", "--recipe", "qwen3-8b")
    assert_user_error(code, err, "NAME")


@pytest.mark.parametrize(
    ("absent", "command", "extra"),
    [
        ("sky", ["render", "qwen3-1.7b", "--gpus", "4"], "launch"),
        ("psutil", ["local", "tiny"], "runtime"),
    ],
)
def test_a_command_whose_extra_is_not_installed_says_which_in_one_line(absent, command, extra):
    # `pip install forgesky` without an extra: the package cannot be imported (None in
    # sys.modules makes every import of it fail as if it were not installed)
    code = (
        f"import sys; sys.modules[{absent!r}] = None\n"
        "from launcher.cli import main\n"
        f"sys.exit(main({command!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"forgesky: error: `forgesky {command[0]}` needs the {absent} package, which this "
        f"install lacks: pip install 'forgesky[{extra}]'"
    ], done.stderr


def test_local_without_the_runtime_extra_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import sys; sys.modules['monarch'] = None\n"
        "from launcher.cli import main\n"
        f"sys.exit(main(['local', 'tiny', '--run-dir', {str(run_dir)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "forgesky: error: `forgesky local` needs the monarch package, which this install lacks: "
        "pip install 'forgesky[runtime]'"
    ], done.stderr
    assert not run_dir.exists()


def test_the_runtimes_own_argument_mistakes_are_one_line(capsys):
    # through forgesky local (its usage names NAME, not the --recipe it passes) and alone
    with pytest.raises(SystemExit) as done:
        main(["local", "tiny", "--bogus"])
    assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "forgesky local: error: unrecognized arguments: --bogus (see forgesky local --help)"
    ]
    result = subprocess.run(
        [sys.executable, "-m", "runtime", "--steps", "3"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "python -m runtime: error: the following arguments are required: --recipe "
        "(see python -m runtime --help)"
    ]
    with pytest.raises(SystemExit):
        main(["local", "tiny", "--help"])
    assert capsys.readouterr().out.startswith("usage: forgesky local NAME [options]")


def test_render_of_a_gated_recipe_without_a_token_says_where_it_is_needed(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    code, _, err = run_main(capsys, "render", "llama3.1-8b", "-o", str(tmp_path / "t.yaml"))
    assert code == 0 and (tmp_path / "t.yaml").exists()
    assert err.splitlines()[0].startswith("note: meta-llama/Meta-Llama-3.1-8B-Instruct is gated")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    code, _, err = run_main(capsys, "render", "llama3.1-8b", "-o", str(tmp_path / "t.yaml"))
    assert code == 0 and "note:" not in err


def test_two_settings_after_one_set_are_refused_with_the_form_that_works(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "qwen3-1.7b", "--set", "grpo.steps=10", "dataset.prompt_tokens_mean=207"])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "forgesky: error: unrecognized arguments: dataset.prompt_tokens_mean=207; each KEY=VALUE "
        "takes a --set of its own (--set dataset.prompt_tokens_mean=207) (see forgesky --help)"
    ]
