"""`forgesky eval`: a run directory, one of its checkpoints or a Hugging Face model folder,
evaluated on the recipe's held-out data; bad sources are one line and exit code 2.

The evaluation of a trained policy agreeing with the run's own final evaluation is checked end to
end in tests/test_runtime_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import tiny_run_dir
from safetensors.torch import save_file

from launcher.cli import main
from recipes import load_recipe
from runtime.backends import build, checkpoint_read
from runtime.control import checkpoint
from runtime.models import hf_config
from runtime.models.hf import to_hf


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny run directory: its recorded recipe and one committed checkpoint (step 7)."""
    return tiny_run_dir(tmp_path_factory.mktemp("run"), steps=(7,))


@pytest.fixture(scope="module")
def hf_folder(run_dir, tmp_path_factory) -> Path:
    """The same weights as a Hugging Face model folder."""
    folder = tmp_path_factory.mktemp("hf")
    spec = build.model_spec(load_recipe("tiny"))
    weights = checkpoint_read.model_weights(run_dir / "checkpoints/step_000007", spec)
    hf_config(spec).save_pretrained(folder)
    save_file(
        {k: v.contiguous() for k, v in to_hf(weights, spec).items()},
        folder / "model.safetensors",
    )
    return folder


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    """The run's newest checkpoint as `forgesky export` writes it: a model folder whose
    forgesky.json records where it came from and the recipe."""
    folder = tmp_path_factory.mktemp("exported") / "model"
    assert main(["export", str(run_dir), "--out", str(folder)]) == 0
    return folder


def with_record(model: Path, folder: Path, record: object) -> Path:
    """`folder`: the files of the model folder `model` with another forgesky.json."""
    folder.mkdir()
    for file in model.iterdir():
        if file.name != "forgesky.json":
            (folder / file.name).symlink_to(file)
    text = record if isinstance(record, str) else json.dumps(record)
    (folder / "forgesky.json").write_text(text)
    return folder


ARITH = ("--set", "dataset.path=builtin:arith", "--set", "model.tokenizer=builtin:arith")


def evaluate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["eval", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_dir_a_checkpoint_and_a_model_folder_give_the_same_numbers(
    run_dir, hf_folder, tmp_path, capsys
):
    results = []
    for i, args in enumerate(
        [
            [str(run_dir)],
            [str(run_dir / "checkpoints/step_000007")],
            [str(hf_folder), "--recipe", "tiny"],
        ]
    ):
        out_file = tmp_path / f"{i}.json"
        code, out, err = evaluate(capsys, *args, "--out", str(out_file))
        assert code == 0, err
        assert "with recipe tiny: up to 10 prompts of builtin:tiny test" in out
        result = json.loads(out_file.read_text())
        assert result["eval/prompts"] == 10 and result["split"] == "test"
        assert set(result) >= {"eval/pass@1", "eval/pass@4", "eval/mean@4", "eval/reward_mean"}
        results.append(
            {k: v for k, v in result.items() if k.startswith("eval/") and k != "eval/seconds"}
        )
    assert results[0] == results[1] == results[2]
    assert json.loads((tmp_path / "0.json").read_text())["step"] == 7


def test_a_model_folder_forgesky_wrote_is_evaluated_with_the_recipe_it_records(
    run_dir, exported, tmp_path, capsys
):
    record = json.loads((exported / "forgesky.json").read_text())
    assert (record["recipe"], record["step"]) == ("tiny", 7)
    assert record["recipe_config"] == load_recipe("tiny").model_dump(mode="json")
    code, out, err = evaluate(capsys, str(exported), "--out", str(tmp_path / "model.json"))
    assert code == 0, err
    assert f"evaluating {exported} (step 7) with recipe tiny: up to 10 prompts" in out
    code, _, err = evaluate(capsys, str(run_dir), "--out", str(tmp_path / "run.json"))
    assert code == 0, err
    model, run = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("model", "run"))
    assert (model["recipe"], model["step"], model["eval/prompts"]) == ("tiny", 7, 10)
    # the folder answers as the checkpoint it was written from
    assert model["eval/pass@1"] == run["eval/pass@1"]
    assert model["eval/reward_mean"] == run["eval/reward_mean"]


def test_the_recorded_recipe_is_the_one_evaluated_and_an_explicit_recipe_wins(
    exported, tmp_path, capsys
):
    # a run of a copy of `tiny` with its own eval settings: the copy keeps the name
    changed = load_recipe("tiny").model_dump(mode="json")
    changed["eval"]["prompts"] = 3
    folder = with_record(exported, tmp_path / "m", {"recipe": "tiny", "recipe_config": changed})
    results = []
    for i, extra in enumerate([[], ["--recipe", "tiny"]]):
        code, out, err = evaluate(capsys, str(folder), *extra, "--out", str(tmp_path / f"{i}"))
        assert code == 0, err
        results.append(json.loads((tmp_path / f"{i}").read_text())["eval/prompts"])
    assert results == [3, 10]
    # an export that named its recipe only: the catalog recipe of that name
    older = with_record(exported, tmp_path / "older", {"recipe": "tiny", "step": 7})
    code, out, err = evaluate(capsys, str(older), "--set", "eval.prompts=2")
    assert code == 0, err
    assert f"evaluating {older} (step 7) with recipe tiny: up to 2 prompts" in out


def test_export_refuses_a_model_folder_whatever_its_forgesky_json_holds(
    hf_folder, tmp_path, capsys
):
    folder = with_record(hf_folder, tmp_path / "garbled", "{not json")
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("garbled is a model folder already; give a run directory"), err


def test_settings_of_the_evaluation_can_be_overridden(run_dir, tmp_path, capsys):
    out_file = tmp_path / "e.json"
    code, out, err = evaluate(
        capsys,
        str(run_dir),
        *("--set", "eval.prompts=3", "--set", "eval.k=1", "--set", "eval.samples=4"),
        *("--out", str(out_file)),
    )
    assert code == 0, err
    result = json.loads(out_file.read_text())
    assert result["eval/prompts"] == 3 and "eval/pass@4" not in result and "eval/mean@4" in result


@pytest.mark.parametrize(
    ("make", "args", "expected"),
    [
        (None, ["  "], "SOURCE is blank"),
        (None, ["{tmp}/nothing"], "no such file or directory"),
        ("file", ["{tmp}/file"], "is a file; give a run directory or a model folder"),
        ("empty", ["{tmp}/empty"], "is neither a run directory"),
        ("partial", ["{tmp}/run/checkpoints/step_000003"], "was never committed"),
        ("no-ckpt", ["{tmp}/run"], "has no committed checkpoint"),
        (
            "damaged",
            ["{tmp}/run/checkpoints/step_000003", "--recipe", "tiny"],
            "unreadable checkpoint marker",
        ),
        ("hf", ["{tmp}/hf"], "has no forgesky.json naming its recipe (forgesky did not write"),
        ("named", ["{tmp}/named"], "names recipe 'mine', which is not in the catalog; pass"),
        ("garbled", ["{tmp}/garbled"], "garbled/forgesky.json ("),
        ("hf", ["{tmp}/hf", "--recipe", "qwen3-0.6b", *ARITH], "config.json has vocab_size"),
        (None, ["{run}", "--recipe", "tiny", "--set", "eval.samples=2"], "eval.k: pass@4 needs"),
        (None, ["{run}", "--set", "eval.split=dev"], "has no split 'dev'"),
        (None, ["{run}", "--out", "{tmp}/missing/x.json"], "does not exist"),
        (None, ["{run}", "--recipe", "tiny-gpu"], "(qwen3 tiny-gpu): its weights do not fit"),
        ("file", ["{run}", "--out", "{tmp}/file"], "is not metrics an eval wrote"),
        ("empty", ["{run}", "--out", "{tmp}/empty"], "is a folder"),
    ],
)
def test_bad_sources_are_one_line_and_exit_2(
    tmp_path, run_dir, hf_folder, capsys, make, args, expected
):
    if make == "file":
        (tmp_path / "file").write_text("x")
    elif make == "empty":
        (tmp_path / "empty").mkdir()
    elif make in ("partial", "damaged"):
        step = tmp_path / "run/checkpoints/step_000003"
        step.mkdir(parents=True)
        (step / "trainer.pt").write_bytes(b"not a checkpoint")
        if make == "damaged":
            (step / checkpoint.MARKER).write_text("{}")
    elif make == "no-ckpt":
        (tmp_path / "run/checkpoints").mkdir(parents=True)
    elif make == "hf":
        (tmp_path / "hf").symlink_to(hf_folder)
    elif make == "named":
        with_record(hf_folder, tmp_path / "named", {"recipe": "mine", "step": 3})
    elif make == "garbled":
        with_record(hf_folder, tmp_path / "garbled", "{not json")
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    code, out, err = evaluate(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgesky: error: ") and expected in lines[0], (
        err
    )
    if "--out" in args or "tiny-gpu" in args:
        assert out == ""  # refused before the evaluation started, not after it
    if make == "file":
        assert (tmp_path / "file").read_text() == "x"  # nothing overwritten


def test_a_dcp_read_that_fails_is_named_by_the_error_under_it():
    """DCP's CheckpointException keeps each rank's error as (error, traceback): the one line
    names the error (here a file cut short), not that pair."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from runtime.eval_weights import _first

    try:
        raise EOFError("Ran out of input")
    except EOFError as cut:
        failed = CheckpointException("read_data", {0: _wrap_exception(cut)})
    assert _first(failed) == "Ran out of input"
    assert _first(ValueError("shape mismatch. more words")) == "shape mismatch"
