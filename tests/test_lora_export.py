"""A LoRA policy out: the adapter folder a LoRA run exports loads in PEFT on its base, `--merge`
writes the same model as a full folder transformers loads, and `forgesky eval` gives one answer
for both. The base is `tiny`'s seeded random init, rebuilt a block at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from test_peft_format import random_adapter
from transformers import AutoModelForCausalLM

from launcher.cli import main
from recipes import apply_overrides, load_recipe, validate_recipe
from recipes.run_sections import Lora
from runtime import export
from runtime.backends import build
from runtime.eval_weights import base_groups
from runtime.models import build_hf_model
from runtime.models.peft_format import CONFIG_FILE, merge, pairs
from runtime.sources import full_model, resolve_recipe, resolve_source

LORA = Lora(rank=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"])
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 13, 11, 4], [3, 3, 8, 10, 1, 0, 6, 2]])  # vocabulary 14


def lora_recipe():
    """`tiny` with LoRA, as a LoRA run records it (its reference in the trainer)."""
    recipe = apply_overrides(
        load_recipe("tiny"),
        [
            "model.lora.rank=8",
            "model.lora.alpha=16",
            "model.lora.targets=[q_proj,v_proj,down_proj]",
            "layout.reference.device=trainer",
        ],
    )
    assert recipe.model.lora == LORA
    return recipe


@pytest.fixture(scope="module")
def spec():
    return build.model_spec(load_recipe("tiny"))


@pytest.fixture(scope="module")
def tensors(spec):
    return random_adapter(spec, LORA, seed=3)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tensors) -> Path:
    """What the export of a tiny LoRA run writes: the adapter folder with its forgesky.json."""
    folder = tmp_path_factory.mktemp("adapter") / "model"
    return build.write_adapter(lora_recipe(), tensors, folder, {"recipe": "tiny", "step": 9})


@pytest.fixture(scope="module")
def merged(adapter, tmp_path_factory) -> Path:
    """The same adapter as `--merge` writes it: merged into the base a block at a time."""
    source = resolve_source(str(adapter), command="export")
    recipe = resolve_recipe(source, None, [], command="export")
    folder = tmp_path_factory.mktemp("merged") / "model"
    return export.write(source, recipe, folder, {"recipe": "tiny", "step": 9}, merge=True)


def base_model(spec):
    """The base as transformers holds it: tiny's seeded init."""
    model = build_hf_model(spec)
    state = {}
    for group in base_groups(load_recipe("tiny")):
        state.update(group)
    model.load_state_dict(state, strict=not spec.tie_embeddings)
    return model, state


def logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_the_adapter_folder_is_peft_and_loads_on_its_base(adapter, spec, tensors):
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "forgesky.json",
    ]
    config = json.loads((adapter / CONFIG_FILE).read_text())
    # tiny starts from a random init: no name finds its base again
    assert config["base_model_name_or_path"] is None
    assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    record = json.loads((adapter / "forgesky.json").read_text())
    assert record["step"] == 9 and record["recipe_config"]["model"]["lora"]["rank"] == 8
    model, state = base_model(spec)
    peft = PeftModel.from_pretrained(model, adapter).eval()
    ours = build_hf_model(spec)
    ours.load_state_dict(merge(state, pairs(tensors), LORA.scaling), strict=False)
    torch.testing.assert_close(logits(peft), logits(ours), atol=1e-5, rtol=1e-5)


def test_the_merged_folder_loads_in_transformers_with_the_adapters_logits(merged, adapter, spec):
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
    record = json.loads((merged / "forgesky.json").read_text())
    assert record["recipe_config"]["model"].get("lora") is None  # a full model
    full = AutoModelForCausalLM.from_pretrained(merged).eval()
    model, _ = base_model(spec)
    with_adapter = PeftModel.from_pretrained(model, adapter).eval()
    expected = logits(with_adapter)
    torch.testing.assert_close(logits(full), expected, atol=1e-4, rtol=1e-4)
    base_only = logits(base_model(spec)[0])
    assert not torch.allclose(base_only, expected, atol=1e-2)  # the adapter is in there


def test_eval_of_the_adapter_and_of_its_merged_folder_agree(adapter, merged, tmp_path, capsys):
    results = []
    for name, folder in (("adapter", adapter), ("merged", merged)):
        out = tmp_path / f"{name}.json"
        assert main(["eval", str(folder), "--out", str(out)]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert f"evaluating {folder} (step 9) with recipe tiny" in printed
        result = json.loads(out.read_text())
        results.append(
            {k: v for k, v in result.items() if k.startswith("eval/") and "sec" not in k}
        )
    assert results[0] == results[1] and results[0]["eval/prompts"] == 10


def test_an_adapter_of_another_base_is_refused_in_one_line(adapter, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    for file in adapter.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    config = json.loads((other / CONFIG_FILE).read_text())
    (other / CONFIG_FILE).write_text(json.dumps({**config, "base_model_name_or_path": "Qwen/X"}))
    assert main(["eval", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"forgesky: error: eval: {other / CONFIG_FILE}: the adapter's base is Qwen/X and recipe "
        "tiny's base is its random init (model.init random, builtin:tiny); pass --recipe with "
        "the adapter's base model"
    ]


def test_full_model_drops_only_the_adapter():
    recipe = lora_recipe()
    assert full_model(recipe).model.lora is None
    assert full_model(recipe).model.model_dump(exclude={"lora"}) == recipe.model.model_dump(
        exclude={"lora"}
    )


def test_full_model_of_a_lora_recipe_is_a_recipe_that_validates():
    # a LoRA recipe scores its reference in the trainer, which only a LoRA run can: the full
    # model (eval's generator, the merged folder's record) has a reference of its own
    recipe = load_recipe("tiny-lora")
    full = full_model(recipe)
    assert full.layout.reference.device == "gpu" and full.layout.reference.enabled
    assert validate_recipe(full.model_dump(mode="json"), "merged") == full
    assert full.layout.model_dump(exclude={"reference"}) == recipe.layout.model_dump(
        exclude={"reference"}
    )


def test_eval_tells_an_adapter_folder_by_the_files_peft_format_writes():
    from runtime.models.peft_format import WEIGHTS_FILE
    from runtime.sources import ADAPTER_FILES

    assert set(ADAPTER_FILES) == {CONFIG_FILE, WEIGHTS_FILE}


def test_a_lora_recipe_without_its_adapter_is_a_valid_recipe():
    # (forgesky eval of a tiny-lora run or its adapter folder refused the recipe it merged to:
    # its reference stayed in the trainer, which only a LoRA run has)
    merged = full_model(load_recipe("tiny-lora"))
    assert merged.model.lora is None and not merged.layout.reference.in_trainer
    again = validate_recipe(merged.model_dump(mode="json"), "tiny-lora merged")
    assert again.layout.reference.enabled and again.model.lora is None
