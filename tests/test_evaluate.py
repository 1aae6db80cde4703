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
from runtime.backends import build, trainer_state
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
    weights = trainer_state.model_weights(run_dir / "checkpoints/step_000007", spec)
    hf_config(spec).save_pretrained(folder)
    save_file(
        {k: v.contiguous() for k, v in to_hf(weights, spec).items()},
        folder / "model.safetensors",
    )
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
        ("hf", ["{tmp}/hf"], "a model folder needs --recipe"),
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

    from runtime.evaluate import _first

    try:
        raise EOFError("Ran out of input")
    except EOFError as cut:
        failed = CheckpointException("read_data", {0: _wrap_exception(cut)})
    assert _first(failed) == "Ran out of input"
    assert _first(ValueError("shape mismatch. more words")) == "shape mismatch"
