"""A real tiny-lora run's checkpoints out: `forgesky export RUN` writes the adapter as a PEFT
folder that PEFT loads on the seeded base with the trainer's logits, `--merge` a full model that
transformers loads with the same, and `forgesky eval` of the run, of one of its checkpoints, of
its adapter folder and of the merged folder answer alike. The run is conftest's `tiny_lora_run`
(shared with test_faults.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fault_runs import lock_step_args
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from launcher.cli import main
from recipes import load_recipe, plan
from recipes.memory import checkpoint_bytes, model_file_bytes
from runtime.backends import build
from runtime.control import checkpoint
from runtime.control.checkpoint import approx_size
from runtime.control.run import finished_already
from runtime.entry import parse_config
from runtime.eval_weights import base_groups
from runtime.models import build_hf_model
from runtime.models.peft_format import CONFIG_FILE, WEIGHTS_FILE

pytestmark = pytest.mark.slow

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 13, 11, 4], [3, 3, 8, 10, 1, 0, 6, 2]])  # vocabulary 14
RECIPE = load_recipe("tiny-lora")


@pytest.fixture(scope="module")
def run(tiny_lora_run) -> Path:
    return tiny_lora_run[0]


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> dict[str, Path]:
    """`forgesky export RUN` and `forgesky export RUN --merge`, each into a folder of its own."""
    out = tmp_path_factory.mktemp("exports")
    folders = {"adapter": out / "adapter", "merged": out / "merged"}
    assert main(["export", str(run), "--out", str(folders["adapter"])]) == 0
    assert main(["export", str(run), "--merge", "--out", str(folders["merged"])]) == 0
    return folders


def trainer_logits(ckpt: Path) -> torch.Tensor:
    """The trainer the run builds, resumed from `ckpt`: its policy's logits on TOKENS."""
    trainer = build.TrainerConfig(RECIPE, plan(RECIPE, 0).settings.trainer).build()
    trainer.load_checkpoint(str(ckpt))
    assert trainer.step == 8
    with torch.no_grad():
        return trainer.model(TOKENS)


def seeded_base() -> torch.nn.Module:
    """tiny-lora's frozen base as transformers holds it: tiny's seeded init."""
    spec = build.model_spec(RECIPE)
    model = build_hf_model(spec)
    state = {k: v for group in base_groups(RECIPE) for k, v in group.items()}
    model.load_state_dict(state, strict=not spec.tie_embeddings)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_the_run_says_what_it_saves_at_the_adapters_size(tiny_lora_run):
    run, out = tiny_lora_run
    lora = RECIPE.model.lora
    # checkpoints and the model at the end are the adapter's size, not the model's
    size = approx_size(checkpoint_bytes(RECIPE.arch, lora))
    assert size != approx_size(checkpoint_bytes(RECIPE.arch))
    assert f"writing the checkpoint of step 8 ({size}) ..." in out, out
    model = approx_size(model_file_bytes(RECIPE))
    assert f"writing the adapter ({model} of fp32 safetensors) ..." in out, out
    assert f"adapter -> {run / 'model'} (PEFT; `forgesky export {run} --merge --out DIR`" in out
    assert sorted(p.name for p in (run / "model").iterdir()) == [
        CONFIG_FILE,
        WEIGHTS_FILE,
        "forgesky.json",
    ]


def test_the_exported_adapter_loads_in_peft_with_the_trainers_logits(run, exported):
    folder = exported["adapter"]
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 16, 32)
    assert sorted(config["target_modules"]) == sorted(RECIPE.model.lora.modules)
    # the adapter the run wrote at its end from the trainer's memory, bit for bit
    ours, at_end = load_file(folder / WEIGHTS_FILE), load_file(run / "model" / WEIGHTS_FILE)
    assert ours.keys() == at_end.keys() and len(ours) == 7 * 2 * RECIPE.arch.n_layers
    assert all(torch.equal(ours[k], at_end[k]) for k in ours)
    newest = checkpoint.latest(run / "checkpoints")
    expected = trainer_logits(newest.path)
    peft = PeftModel.from_pretrained(seeded_base(), folder).eval()
    torch.testing.assert_close(logits(peft), expected, atol=1e-5, rtol=1e-5)
    # it trained: the adapter moves the logits off the base's
    assert not torch.allclose(logits(seeded_base()), expected, atol=1e-3)


def test_the_merged_export_loads_in_transformers_with_the_trainers_logits(run, exported):
    folder = exported["merged"]
    assert not (folder / CONFIG_FILE).exists()
    record = json.loads((folder / "forgesky.json").read_text())
    assert record["step"] == 8 and record["recipe_config"]["model"].get("lora") is None
    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = trainer_logits(checkpoint.latest(run / "checkpoints").path)
    torch.testing.assert_close(logits(full), expected, atol=1e-5, rtol=1e-5)


def test_eval_of_the_run_its_checkpoint_its_adapter_and_the_merged_model_agree(
    run, exported, tmp_path, capsys
):
    of_run = f"step 8 of {run}"
    sources = {
        "run": (run, of_run),
        "checkpoint 8": (run / "checkpoints" / "step_000008", of_run),
        "adapter": (run / "model", f"{run / 'model'} (step 8)"),
        "merged": (exported["merged"], f"{exported['merged']} (step 8)"),
        "checkpoint 6": (run / "checkpoints" / "step_000006", f"step 6 of {run}"),
    }
    results = {}
    for name, (source, what) in sources.items():
        out = tmp_path / f"{name}.json"
        assert main(["eval", str(source), "--out", str(out)]) == 0, capsys.readouterr().err
        assert f"evaluating {what} with recipe tiny-lora: " in capsys.readouterr().out
        result = json.loads(out.read_text())
        results[name] = {
            k: v for k, v in result.items() if k.startswith("eval/") and "sec" not in k
        }
    assert results["run"]["eval/prompts"] == 10
    for name in ("checkpoint 8", "adapter", "merged"):
        assert results[name] == results["run"], name


def test_a_finished_lora_run_started_again_writes_its_adapter_from_the_checkpoint(
    tiny_lora_run, tmp_path, capsys
):
    run = shutil.copytree(tiny_lora_run[0], tmp_path / "run")
    shutil.rmtree(run / "model")  # ended before writing it
    assert finished_already(parse_config(lock_step_args(run, recipe="tiny-lora")))
    size = approx_size(model_file_bytes(RECIPE))
    assert capsys.readouterr().out.splitlines() == [
        f"forgesky: run dir {run} is at step 8 of 8 already: nothing to train, no service "
        f"started; writing its adapter from that checkpoint ({size} of fp32 safetensors) ...",
        f"adapter -> {run / 'model'} (PEFT; `forgesky export {run} --merge --out DIR` for a full "
        "model)",
    ]
    written, at_end = load_file(run / "model" / WEIGHTS_FILE), tiny_lora_run[0] / "model"
    expected = load_file(at_end / WEIGHTS_FILE)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in written)


def test_the_product_path_serves_a_lora_run_merged(tiny_lora_run, tmp_path):
    """bench/product_path.py's part b serves a run's model folder whole: a LoRA run's adapter
    goes through `forgesky export RUN --merge` first (a full run's folder as it is)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import product_path

    run = shutil.copytree(tiny_lora_run[0], tmp_path / "run")
    served, merged = product_path.servable(run)
    assert served == run / "merged" and merged is not None and merged["seconds"] >= 0
    assert (served / "config.json").exists() and list(served.glob("*.safetensors"))
    assert not (served / CONFIG_FILE).exists()  # a whole model, no adapter config
    full = tmp_path / "full"
    (full / "model").mkdir(parents=True)
    (full / "model" / "config.json").write_text("{}")
    assert product_path.servable(full) == (full / "model", None)


@pytest.mark.parametrize("recipe", ["tiny", "tiny-lora"])
def test_the_product_path_knows_the_line_each_run_writes_its_model_with(recipe, tmp_path):
    """bench/product_path.py's run B checks that the run wrote RUN_DIR/model by the line the
    runtime prints: a LoRA run's says `adapter -> `, a full run's `model -> ` (a check for the
    second alone failed the 14B LoRA run after it had trained and written its adapter)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import product_path

    from runtime.control.run import _model_words

    run = tmp_path / "run"
    line = _model_words(parse_config(lock_step_args(run, recipe=recipe)))[2]
    assert product_path.wrote_model(f"step 8/8\n{line}\nfinished at step 8\n", run)
    assert not product_path.wrote_model(f"step 8/8\n{line}\n", tmp_path / "other")
    assert not product_path.wrote_model("step 8/8\nfinished at step 8\n", run)
    # the same folder named another way (the bench's --work given relative) is the same folder
    assert product_path.wrote_model(line, tmp_path / "other" / ".." / "run")
