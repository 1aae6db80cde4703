"""The adapter in PEFT's format: the folders forgesky writes load in PEFT itself with the logits
of forgesky's merge, under the names and shapes PEFT writes, for both families."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_models import LLAMA, QWEN

from recipes import UserError
from recipes.run_sections import Lora
from runtime.models import build_hf_model
from runtime.models.peft_format import (
    CONFIG_FILE,
    RECORD_FILE,
    adapter_config,
    adapter_layout,
    check_adapter,
    lora_of,
    merge,
    merge_groups,
    pairs,
    read_adapter_folder,
    write_adapter_folder,
)

SPECS = {"qwen3": QWEN, "llama3": LLAMA}
LORAS = {
    "all-linear": Lora(rank=8, alpha=16),
    "q-v": Lora(rank=4, alpha=12, targets=["v_proj", "q_proj"]),
}
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 30, 11, 4], [3, 3, 8, 40, 1, 0, 6, 2]])


def random_adapter(spec, lora, seed=0):
    """An adapter with every matrix random and nonzero (B too: a fresh one would be all zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen) * 0.2
        for name, shape in adapter_layout(spec, lora).items()
    }


def base_model(spec, seed=1):
    torch.manual_seed(seed)
    return build_hf_model(spec)


def logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("lora_name", sorted(LORAS))
@pytest.mark.parametrize("family", sorted(SPECS))
def test_names_and_shapes_are_peft_own(tmp_path, family, lora_name):
    spec, lora = SPECS[family], LORAS[lora_name]
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.scaling_alpha,
        target_modules=list(lora.modules),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    get_peft_model(base_model(spec), config).save_pretrained(tmp_path / "peft")
    theirs, _ = read_adapter_folder(tmp_path / "peft")
    assert {k: tuple(v.shape) for k, v in theirs.items()} == adapter_layout(spec, lora)
    check_adapter(theirs, spec, lora)
    read = lora_of(json.loads((tmp_path / "peft" / CONFIG_FILE).read_text()), "x")
    assert (read.rank, read.scaling, read.modules) == (lora.rank, lora.scaling, lora.modules)


@pytest.mark.parametrize("lora_name", sorted(LORAS))
@pytest.mark.parametrize("family", sorted(SPECS))
def test_our_folder_loads_in_peft_with_the_logits_of_our_merge(tmp_path, family, lora_name):
    spec, lora = SPECS[family], LORAS[lora_name]
    tensors = random_adapter(spec, lora)
    recipe = {"name": "made-up", "model": {"family": family}}
    folder = write_adapter_folder(
        tmp_path / "adapter", tensors, lora, None, recipe, {"recipe": "made-up", "step": 3}
    )
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "forgesky.json",
    ]
    assert not (tmp_path / "adapter.partial").exists()
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": int(lora.scaling_alpha),
        "bias": "none",
    }
    assert config["lora_dropout"] == 0 and config["base_model_name_or_path"] is None
    assert config["target_modules"] == list(lora.modules)
    assert json.loads((folder / RECORD_FILE).read_text()) == {
        "recipe": "made-up",
        "step": 3,
        "recipe_config": recipe,
    }

    base = base_model(spec)
    ours = build_hf_model(spec)
    ours.load_state_dict(merge(base.state_dict(), pairs(tensors), lora.scaling))
    peft = PeftModel.from_pretrained(base_model(spec), folder).eval()
    expected = logits(ours)
    torch.testing.assert_close(logits(peft), expected, atol=1e-5, rtol=1e-5)
    # the adapter matters: without it the logits are elsewhere
    assert not torch.allclose(logits(base), expected, atol=1e-3)


def test_merge_is_computed_in_fp32_and_cast_back():
    w0 = torch.randn(6, 5).to(torch.bfloat16)
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    out = merge({"model.layers.0.mlp.up_proj.weight": w0}, pairs(_ab(a, b)), 1.5)
    got = out["model.layers.0.mlp.up_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w0.float() + 1.5 * (b @ a)).to(torch.bfloat16))


def _ab(a, b):
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    return {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}


def test_merge_by_groups_equals_the_whole_and_misses_are_bugs():
    spec, lora = QWEN, LORAS["all-linear"]
    tensors = random_adapter(spec, lora)
    state = base_model(spec).state_dict()
    whole = merge(state, pairs(tensors), lora.scaling)
    groups = [{k: v for k, v in state.items() if f".{i}." in k} for i in range(spec.n_layers)]
    groups.append({k: v for k, v in state.items() if ".layers." not in k})
    by_group = {}
    for group in merge_groups(groups, tensors, lora):
        by_group.update(group)
    assert by_group.keys() == whole.keys()
    assert all(torch.equal(by_group[k], whole[k]) for k in whole)
    with pytest.raises(KeyError, match="never|no weight"):
        list(merge_groups(groups[:1], tensors, lora))
    with pytest.raises(KeyError, match="only one"):
        pairs({k: v for k, v in tensors.items() if "lora_B" not in k or ".0." not in k})
    with pytest.raises(KeyError, match="does not fit"):
        check_adapter(random_adapter(spec, LORAS["q-v"]), spec, lora)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"use_dora": True}, "use_dora=True is not a plain LoRA"),
        ({"bias": "all"}, "bias='all' is not a plain LoRA"),
        ({"target_modules": "all-linear"}, "is not a list of projection names"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules has 'lm_head'"),
        ({"peft_type": "IA3"}, "is not LORA"),
    ],
)
def test_an_adapter_config_we_cannot_apply_is_refused_in_one_line(change, words):
    config = {**adapter_config(LORAS["all-linear"], None), **change}
    with pytest.raises(UserError, match=words) as e:
        lora_of(config, "adapter x/adapter_config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("adapter x/")
