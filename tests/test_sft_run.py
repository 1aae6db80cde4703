"""SFT runs of tiny-sft on the CPU: the held-out loss halves within the recipe's steps, a
resumed run is the unbroken one step for step, and the run's model folder is a Hugging Face
folder that `forgesky eval` scores by its held-out loss."""

import json

import pytest
import torch

from recipes import UserError, apply_overrides, load_recipe
from runtime.control.metrics import read_metrics


def run_tiny_sft(run_dir, *overrides, steps=None):
    from runtime.sft.run import run

    recipe = apply_overrides(load_recipe("tiny-sft"), list(overrides))
    return run(recipe, run_dir, steps=steps, log=lambda _: None)


def test_tiny_sft_halves_its_held_out_loss(tmp_path):
    run_tiny_sft(tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    held_out = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert held_out[0][0] == 0 and held_out[-1][0] == 60
    assert held_out[-1][1] <= 0.5 * held_out[0][1], held_out
    last = records[-1]
    assert last["tokens"] <= 512 and last["trained_tokens"] > 0 and last["tokens_per_s"] > 0
    assert last["data/rows_dropped"] == 0 and "mfu" in last
    model = tmp_path / "run" / "model"
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert json.loads((model / "forgesky.json").read_text())["step"] == 60
    # `forgesky eval` samples it too (tiny-sft names a reward): the random init's greedy count
    # scores about 0.03 a digit (docs/sft.md), this model's most of its answers' digits
    from runtime.evaluate import run as evaluate

    out = tmp_path / "eval.json"
    assert evaluate(str(model), None, [], str(out)) == 0
    result = json.loads(out.read_text())
    assert result["eval/prompts"] == 64 and result["eval/reward_mean"] >= 0.5, result
    assert 0 < result["eval/pass@1"] <= result["eval/pass@4"] <= 1, result
    assert result["eval/mean@4"] <= result["eval/pass@4"], result


def test_a_resumed_sft_run_is_the_unbroken_run_step_for_step(tmp_path):
    """A run stopped after its checkpoint of step 20 (what a preempted one leaves: the
    checkpoints up to it, the metrics of its steps) and resumed gives steps 21-30 and the model
    of the unbroken run, bit for bit."""
    import shutil

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_tiny_sft(whole, "sft.checkpoint_interval=10", steps=30)
    parts.mkdir()
    shutil.copy(whole / "config.json", parts / "config.json")
    shutil.copytree(whole / "checkpoints" / "step_000020", parts / "checkpoints" / "step_000020")
    lines = (whole / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] <= 20]
    (parts / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    run_tiny_sft(parts, "sft.checkpoint_interval=10", steps=30)
    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(parts / "metrics.jsonl")
    keys = ("loss", "grad_norm", "lr", "tokens", "trained_tokens", "rows", "eval/loss")
    assert [r["step"] for r in b] == list(range(31))
    assert [[r.get(k) for k in keys] for r in b] == [[r.get(k) for k in keys] for r in a]
    from safetensors.torch import load_file

    wa = load_file(whole / "model" / "model.safetensors")
    wb = load_file(parts / "model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_run_stopped_between_checkpoints_resumes_where_its_trained_rows_end(tmp_path):
    """Each step's rows are taken while the step before trains, so a stop finds the stream one
    step ahead: the checkpoint of the last trained step keeps where its rows end, not where the
    stream stands, and the resumed run is the unbroken one."""
    from runtime.sft.run import run

    recipe = apply_overrides(load_recipe("tiny-sft"), ["sft.checkpoint_interval=0"])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(recipe, whole, steps=12, log=lambda _: None)
    metrics = parts / "metrics.jsonl"

    def after_step_7() -> bool:  # its lines: the held-out loss at step 0, then a line a step
        return metrics.exists() and len(metrics.read_text().splitlines()) > 7

    run(recipe, parts, steps=12, log=lambda _: None, stopping=after_step_7)
    stopped = read_metrics(metrics)
    assert stopped[-1]["step"] == 7 and (parts / "checkpoints" / "step_000007").is_dir()
    state = json.loads((parts / "checkpoints" / "step_000007" / "sft_state.json").read_text())
    rows = sum(r["rows"] for r in stopped if r["step"] > 0)
    assert state["data"]["epoch"] == 0 and state["data"]["index"] == rows
    run(recipe, parts, steps=12, log=lambda _: None)
    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(parts / "metrics.jsonl")
    keys = ("loss", "grad_norm", "tokens", "rows")
    assert [[r.get(k) for k in keys] for r in b] == [[r.get(k) for k in keys] for r in a]


def test_forgesky_eval_reports_the_held_out_loss(tmp_path, capsys):
    from runtime.evaluate import run as evaluate
    from runtime.sft.run import run

    recipe = load_recipe("tiny-sft")
    loss_only = recipe.eval.model_copy(update={"reward": None, "k": 1})
    run(recipe.model_copy(update={"eval": loss_only}), tmp_path / "run", steps=10, log=print)
    out = tmp_path / "eval.json"
    assert evaluate(str(tmp_path / "run" / "model"), None, [], str(out)) == 0
    result = json.loads(out.read_text())
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["eval/loss"]
    assert result["eval/loss"] == pytest.approx(logged, rel=1e-5)
    assert "loss" in capsys.readouterr().out
    assert "eval/pass@1" not in result  # no reward named: the loss alone


def test_held_out_chats_prompt_with_the_turns_before_the_last_answer(tmp_path):
    from runtime.sft.sampled import held_out_prompts

    chat = [
        {"role": "user", "content": "12"},
        {"role": "assistant", "content": "34"},
        {"role": "user", "content": "56"},
        {"role": "assistant", "content": "78"},
    ]
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    recipe = apply_overrides(load_recipe("tiny-sft"), [f"eval.path={data}"])
    [prompt], [turns] = held_out_prompts(recipe)
    assert (prompt.text, prompt.answer) == ("56", "78") and turns == chat[:3]


def test_sft_data_without_its_fields_stops_the_run_before_training(tmp_path, capsys):
    from launcher.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"conversation": [], "id": 1}) + "\n")
    with pytest.raises(UserError, match="its fields: conversation, id"):
        run_tiny_sft(tmp_path / "run", f"dataset.path={data}")
    run_dir = tmp_path / "cli"
    argv = ["local", "tiny-sft", "--set", f"dataset.path={data}", "--run-dir", str(run_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its fields: conversation, id" in err
    assert not (tmp_path / "run").exists() and not run_dir.exists()


def test_data_with_no_row_that_fits_max_tokens_stops_before_training(tmp_path, capsys):
    """Rows longer than dataset.max_tokens are dropped or cut (and counted); where none is left
    to train on, the run says so in one line as it starts, before its trainer."""
    from launcher.cli import main

    long = {"role": "user", "content": "1234567890" * 4}  # 41 tokens before the answer
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": [long, {"role": "assistant", "content": "1"}]}) + "\n")
    with pytest.raises(UserError, match="no row fits dataset.max_tokens 32 after the chat templ"):
        run_tiny_sft(tmp_path / "run", f"dataset.path={data}")
    with pytest.raises(UserError, match="no row of the first 64 \\(eval.rows\\) fits"):
        run_tiny_sft(tmp_path / "run", f"eval.path={data}", "dataset.overlong=truncate")
    argv = [
        "local",
        "tiny-sft",
        "--set",
        f"dataset.path={data}",
        "--set",
        "dataset.overlong=truncate",
    ]
    assert main([*argv, "--run-dir", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "none keeps an assistant token: dataset.overlong truncate" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cli").exists()


def test_a_grpo_recipe_starts_from_an_sft_runs_model_folder(tmp_path):
    """SFT then GRPO: the GRPO recipe names the SFT run's model folder as model.hf_id; the
    launcher ships that folder to the nodes and the trainer starts from its weights."""
    from safetensors.torch import load_file

    from launcher.files import local_files
    from recipes import plan
    from runtime.backends.build import initial_weights, model_spec
    from runtime.models import to_hf

    run_tiny_sft(tmp_path / "sft", steps=5)
    folder = tmp_path / "sft" / "model"
    grpo = apply_overrides(load_recipe("tiny"), [f"model.hf_id={folder}", "model.init=hub"])
    assert plan(grpo, 0).cpu
    [shipped] = [f for f in local_files(grpo) if f.field == "model.hf_id"]
    assert shipped.local == folder.resolve() and shipped.remote.endswith("/model.hf_id/model")
    spec = model_spec(grpo)
    start = to_hf(initial_weights(grpo, spec).state_dict(), spec)
    trained = load_file(folder / "model.safetensors")
    assert trained
    assert all(torch.equal(start[k].float(), trained[k].float()) for k in trained)


def test_model_lora_trains_an_sft_adapter(tmp_path):
    from runtime.evaluate import run as evaluate

    run_tiny_sft(tmp_path / "run", "model.lora.rank=8", steps=3)
    model = tmp_path / "run" / "model"
    assert sorted(p.name for p in model.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "forgesky.json",
    ]
    assert json.loads((model / "adapter_config.json").read_text())["r"] == 8
    assert evaluate(str(model), None, [], None) == 0


def test_the_profiled_step_leaves_a_summary_and_trains_as_the_others(tmp_path):
    from runtime.sft.run import run

    lines: list[str] = []
    recipe = apply_overrides(load_recipe("tiny-sft"), ["trainer.profile_step=2"])
    run(recipe, tmp_path / "profiled", steps=3, log=lines.append)
    run_tiny_sft(tmp_path / "plain", steps=3)
    folder = tmp_path / "profiled" / "profile"
    assert [p.name for p in folder.iterdir()] == ["step_2_rank_0.json"]
    summary = json.loads((folder / "step_2_rank_0.json").read_text())
    assert (summary["step"], summary["rank"], summary["device"]) == (2, 0, "cpu")
    assert summary["by_kind_s"]["attention"] > 0 and summary["by_kind_s"]["optimizer"] > 0
    assert summary["kernel_s"] > 0 and summary["gpu_idle_share"] is None
    assert summary["summary_s"] > 0  # reading the events back, after the step's own wall_s
    said = [x for x in lines if x.startswith("profile of step 2 (rank 0): ")]
    assert said and "the profile's summary took" in said[0], lines
    keys = ("loss", "grad_norm", "tokens", "eval/loss")
    a = read_metrics(tmp_path / "profiled" / "metrics.jsonl")
    b = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    assert [r["step"] for r in a if r.get("trainer/profiled")] == [2]
    # every step's record counts the graphs compiled during it (none: tiny-sft is not compiled)
    assert [r.get("compile/graphs") for r in a if r["step"] > 0] == [0.0] * 3
    for r in (r for r in a if r["step"] > 0):  # the data's seconds and the trainer's, apart
        assert (
            0 <= r["time/data_s"] < r["time/step_s"] and 0 < r["time/train_s"] <= r["time/step_s"]
        )
    with pytest.raises(UserError, match="profile_step"):
        apply_overrides(load_recipe("tiny-sft"), ["trainer.profile_step=-1"])
