"""Recipe validation, loading and overrides: every user mistake ends as one clear line."""

import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import recipes
from recipes import UserError, apply_overrides, load_recipe, plan, schema
from recipes.loader import catalog_path


def write(tmp_path: Path, data, name: str = "x.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def catalog_data(name: str = "qwen3-8b") -> dict:
    return yaml.safe_load(catalog_path(name).read_text())


def load_with(tmp_path: Path, section: str, key: str, value, base: str = "qwen3-8b"):
    data = catalog_data(base)
    node = data
    for part in section.split("."):
        node = node[part]
    node[key] = value
    return load_recipe(write(tmp_path, data))


def error_of(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        (
            "grpo",
            "group_size",
            1,
            "grpo.group_size: Input should be greater than or equal to 2 (got 1)",
        ),
        (
            "grpo",
            "max_prompt_tokens",
            0,
            "grpo.max_prompt_tokens: Input should be greater than 0 (got 0)",
        ),
        (
            "grpo",
            "max_response_tokens",
            -5,
            "grpo.max_response_tokens: Input should be greater than 0",
        ),
        ("grpo", "learning_rate", 0, "grpo.learning_rate: Input should be greater than 0 (got 0)"),
        ("grpo", "learning_rate", ".nan", "grpo.learning_rate: Input should be a finite number"),
        ("grpo", "clip_low", -0.1, "grpo.clip_low: must be in [0, 1], got -0.1"),
        ("grpo", "clip_low", 1.5, "grpo.clip_low: must be in [0, 1], got 1.5"),
        ("grpo", "clip_high", -1, "grpo.clip_high: Input should be greater than or equal to 0"),
        (
            "grpo",
            "loss",
            "ppo",
            "grpo.loss: unknown loss 'ppo'; use grpo, dr_grpo, dapo, gspo, cispo, sapo or module:function",
        ),
        (
            "grpo",
            "max_policy_age",
            -1,
            "grpo.max_policy_age: Input should be greater than or equal to 0",
        ),
        (
            "layout.generator",
            "replicas",
            0,
            "layout.generator.replicas: Input should be greater than or equal to 1",
        ),
        (
            "layout.trainer",
            "tp",
            2,
            "layout.trainer.tp: unknown key; valid keys here: gpus",
        ),
        ("model", "family", "gpt", "model.family: Input should be 'qwen3' or 'llama3' (got 'gpt')"),
        (
            "model",
            "size",
            "9b",
            "model.size: unknown qwen3 size '9b'; known sizes: 0.6b, 1.7b, 4b, 8b",
        ),
        (
            "resources",
            "accelerator",
            "A100",
            "resources.accelerator: Input should be 'H100', 'H200', 'A100-80GB', 'B200' or 'cpu'",
        ),
    ],
)
def test_bad_values_name_the_field(tmp_path, section, key, value, expected):
    if value == ".nan":
        value = float("nan")
    message = error_of(load_with, tmp_path, section, key, value)
    assert message.startswith(str(tmp_path / "x.yaml") + ": ") or message.startswith("x.yaml: ")
    assert expected in message


def test_clip_low_is_a_bound_a_ratio_can_meet():
    """The loss clips a ratio from below at 1 - clip_low: 0 and 1 (no clip below) are taken;
    past 1 the bound is below any ratio (a typed 1.5 for 0.15, say), and the line says why."""
    tiny = load_recipe("tiny")
    for edge in (0, 1):
        assert apply_overrides(tiny, [f"grpo.clip_low={edge}"]).grpo.clip_low == edge
    assert error_of(apply_overrides, tiny, ["grpo.clip_low=1.5"]) == (
        "tiny with grpo.clip_low=1.5: grpo.clip_low: must be in [0, 1], got 1.5 (a ratio is "
        "clipped from below at 1 - clip_low, and a ratio is never below 0)"
    )


def test_wrong_type_shows_file_path_and_value(tmp_path):
    message = error_of(load_with, tmp_path, "grpo", "group_size", "eight")
    assert message.endswith(
        "x.yaml: grpo.group_size: Input should be a valid integer, unable to parse string as an "
        "integer (got 'eight')"
    )


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        (
            "layout.generator",
            "tp",
            3,
            "layout.generator.tp: 3 must divide the qwen3 8b head counts (n_heads 32, n_kv_heads 8)",
        ),
    ],
)
def test_tensor_parallel_must_divide_heads(tmp_path, section, key, value, expected):
    assert expected in error_of(load_with, tmp_path, section, key, value)


def test_tp_dividing_query_heads_but_not_kv_heads_is_rejected(tmp_path):
    data = catalog_data("llama3.2-3b")  # 24 query heads, 8 kv heads
    data["layout"]["generator"]["tp"] = 3
    message = error_of(load_recipe, write(tmp_path, data))
    assert (
        "layout.generator.tp: 3 must divide the llama3 3b head counts (n_heads 24, n_kv_heads 8)"
        in message
    )


def test_disabled_reference_gpus_are_not_checked(tmp_path):
    data = catalog_data()
    data["layout"]["reference"] = {"enabled": False, "gpus": 16}
    assert not load_recipe(write(tmp_path, data)).layout.reference.enabled


def test_the_reference_is_sharded_over_its_gpus_not_tensor_parallel(tmp_path):
    """The reference's GPUs are FSDP shards: any count that fits a node, no head-count rule;
    `tp` is no longer a key; its processes follow its GPUs."""
    data = catalog_data()
    data["layout"]["reference"] = {"enabled": True, "gpus": 3}  # 3 does not divide 32 heads
    assert load_recipe(write(tmp_path, data)).layout.reference.gpus == 3
    data["layout"]["reference"] = {"enabled": True, "gpus": 9}
    assert "layout.reference.gpus: 9 exceeds resources.gpus_per_node 8" in error_of(
        load_recipe, write(tmp_path, data)
    )
    data["layout"]["reference"] = {"enabled": True, "tp": 2}
    assert "layout.reference.tp: unknown key" in error_of(load_recipe, write(tmp_path, data))
    data["layout"]["reference"] = {"enabled": True, "gpus": 2}
    data["reference"] = {"ranks": 3}
    assert "reference.ranks: 3 must be auto or layout.reference.gpus (2)" in error_of(
        load_recipe, write(tmp_path, data)
    )


def test_memory_must_fit_the_accelerator(tmp_path):
    data = catalog_data()
    data["layout"]["trainer"]["gpus"] = 1  # 8B params x 16 bytes on one GPU
    message = error_of(load_recipe, write(tmp_path, data))
    assert "resources.accelerator: trainer needs ~136 GB per GPU but H100 has 85.5 GB" in message
    assert "raise layout.trainer.gpus" in message

    data["resources"] = {"accelerator": "H200", "alternatives": []}
    assert load_recipe(write(tmp_path, data)).resources.accelerator == "H200"

    data["resources"]["alternatives"] = ["H100"]
    message = error_of(load_recipe, write(tmp_path, data))
    assert "resources.alternatives.0: trainer needs ~136 GB per GPU but H100 has 85.5 GB" in message


def test_generator_kv_reserve_counts_against_memory(tmp_path):
    data = catalog_data("qwen3-1.7b")
    data["grpo"]["prompts_per_step"] = 64  # 64 x 8 x 2048 tokens of KV cache on one GPU
    assert "resources.accelerator: generator needs" in error_of(load_recipe, write(tmp_path, data))
    data["layout"]["generator"]["replicas"] = 4
    assert load_recipe(write(tmp_path, data)).grpo.prompts_per_step == 64


def test_cpu_recipes_skip_the_memory_check_but_need_single_procs(tmp_path):
    data = catalog_data("tiny")
    data["model"]["size"] = "32b"
    data["grpo"]["max_prompt_tokens"] = 1024
    assert load_recipe(write(tmp_path, data)).cpu
    data = catalog_data("tiny")
    data["layout"]["trainer"]["gpus"] = 2
    assert "layout.trainer.gpus: must be 1 on accelerator cpu" in error_of(
        load_recipe, write(tmp_path, data)
    )
    data = catalog_data("tiny")
    data["layout"]["generator"]["tp"] = 2
    assert "layout.generator.tp: must be 1 on accelerator cpu, got 2" in error_of(
        load_recipe, write(tmp_path, data)
    )


def test_token_budget_must_fit_the_context(tmp_path):
    data = catalog_data("tiny")
    data["grpo"]["max_prompt_tokens"] = 60
    data["grpo"]["max_response_tokens"] = 8
    assert (
        "grpo.max_prompt_tokens + grpo.max_response_tokens: 68 exceeds the qwen3 tiny context of 64"
        in error_of(load_recipe, write(tmp_path, data))
    )


def test_rewards_and_template_are_checked(tmp_path):
    data = catalog_data()
    data["dataset"]["rewards"] = [{"name": "maths"}]
    assert (
        "dataset.rewards.0.name: unknown reward 'maths'; use math, gsm8k_format, format, builtin:<name> or module:function"
        in error_of(load_recipe, write(tmp_path, data))
    )
    data["dataset"]["rewards"] = []
    assert "dataset.rewards: List should have at least 1 item" in error_of(
        load_recipe, write(tmp_path, data)
    )
    data["dataset"]["rewards"] = [{"name": "builtin:tinny"}]
    assert (
        "dataset.rewards.0.name: no shipped task named 'tinny' (shipped: tiny, arith, tiny-tools)"
        in error_of(load_recipe, write(tmp_path, data))
    )
    data["dataset"]["rewards"] = [{"name": "mypkg.rewards:exact"}, {"name": "builtin:tiny"}]
    data["dataset"]["prompt_template"] = "Q: {prompt}"
    assert (
        "dataset.prompt_template: unknown placeholder {prompt}; the only one is {question}"
        in error_of(load_recipe, write(tmp_path, data))
    )
    data["dataset"]["prompt_template"] = "Q: {question"
    assert "dataset.prompt_template: not a format string" in error_of(
        load_recipe, write(tmp_path, data)
    )


def test_unknown_and_missing_keys(tmp_path):
    data = catalog_data()
    data["grpo"]["stepz"] = 3
    message = error_of(load_recipe, write(tmp_path, data))
    assert (
        "grpo.stepz: unknown key; did you mean steps? valid keys here: advantage_std, aggregation, "
        "checkpoint_finish_s, checkpoint_interval" in message
    )
    data = catalog_data()
    data["layout"]["trainer"]["dp"] = 2
    assert "layout.trainer.dp: unknown key; valid keys here: gpus" in error_of(  # nothing close
        load_recipe, write(tmp_path, data)
    )
    data = catalog_data()
    data["dataset"]["rewards"][0]["scale"] = 2
    assert "dataset.rewards.0.scale: unknown key; valid keys here: name, weight" in error_of(
        load_recipe, write(tmp_path, data)
    )
    data = catalog_data()
    del data["grpo"]["steps"]
    assert "grpo.steps: required field is missing" in error_of(load_recipe, write(tmp_path, data))
    # a misspelt key is also a missing one: the line names the misspelling
    data = catalog_data()
    data["grpo"]["stepz"] = data["grpo"].pop("steps")
    assert (
        error_of(load_recipe, write(tmp_path, data))
        .split(": ", 1)[1]
        .startswith("grpo.stepz: unknown key; did you mean steps?")
    )


def _sections(model: type[BaseModel]) -> set[type[BaseModel]]:
    """`model` and every model its fields hold, however deep (lists and unions included)."""
    found = {model}
    for info in model.model_fields.values():
        todo = [info.annotation]
        while todo:
            t = todo.pop()
            todo += typing.get_args(t)
            if isinstance(t, type) and issubclass(t, BaseModel) and t not in found:
                found |= _sections(t)
    return found


def test_every_model_forbids_extra_keys():
    models = _sections(schema.Recipe)
    assert {m.__name__ for m in models} >= {
        "Recipe",
        "Model",
        "Dataset",
        "Reward",
        "Grpo",
        "Eval",
        "Layout",
        "GeneratorLayout",
        "ReferenceLayout",
        "MpsSmPercent",
        "Resources",
        "GeneratorSettings",
        "WatchdogSettings",
    }
    assert all(m.model_config.get("extra") == "forbid" for m in models)


def test_malformed_yaml_points_at_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\ngrpo:\n  steps: [1, 2\n  loss: grpo\n")
    message = error_of(load_recipe, path)
    assert message.startswith(f"{path}:4:") or message.startswith("x.yaml:4:")
    assert "expected ',' or ']'" in message


def test_duplicate_keys_are_rejected(tmp_path):
    text = (
        catalog_path("qwen3-8b").read_text().replace("  steps: 500\n", "  steps: 500\n  steps: 5\n")
    )
    message = error_of(load_recipe, write(tmp_path, text))
    assert "duplicate key 'steps'" in message
    line = text.splitlines().index("  steps: 5") + 1
    assert f"x.yaml:{line}:3:" in message


def test_non_mapping_file(tmp_path):
    assert "x.yaml: expected a mapping of recipe sections, got list" in error_of(
        load_recipe, write(tmp_path, "- a\n- b\n")
    )
    assert "x.yaml: expected a mapping of recipe sections, got nothing" in error_of(
        load_recipe, write(tmp_path, "")
    )


def test_load_by_name_path_and_yml(tmp_path):
    assert load_recipe("qwen3-8b").name == "qwen3-8b"
    path = write(tmp_path, catalog_path("qwen3-1.7b").read_text(), "mine.yml")
    assert load_recipe(path).name == "qwen3-1.7b"
    assert load_recipe(Path(path)).model.size == "1.7b"


def test_unknown_recipe_suggests_close_names():
    assert error_of(load_recipe, "qwen3-1.8b") == (
        "unknown recipe 'qwen3-1.8b'; did you mean: qwen3-1.7b, qwen3-8b? (forgesky recipes lists them)"
    )
    assert (
        error_of(load_recipe, "mistral") == "unknown recipe 'mistral' (forgesky recipes lists them)"
    )
    assert error_of(load_recipe, "nope/x.yaml") == "recipe file not found: nope/x.yaml"
    assert "try qwen3-8b" in error_of(load_recipe, "qwen3-8b.yaml")


def test_overrides_apply_and_revalidate():
    base = load_recipe("qwen3-8b")
    r = apply_overrides(
        base,
        [
            "grpo.steps=20",
            "layout.generator.replicas=2",
            "grpo.learning_rate=3e-6",
            "dataset.config=1",
            "dataset.rewards.1.weight=0.5",
            "resources.alternatives=[]",
            "model.tokenizer=",
        ],
    )
    assert (r.grpo.steps, r.layout.generator.replicas, r.grpo.learning_rate) == (20, 2, 3e-6)
    assert r.dataset.config == "1"  # a string field keeps the text as typed
    assert r.dataset.rewards[1].weight == 0.5 and r.resources.alternatives == []
    assert r.model.tokenizer is None
    assert base.grpo.steps == 500  # the original is untouched
    assert apply_overrides(base, []) is base
    # a string field that may be unset reads null or ~ as unset (eval.reward=null, as docs/tools.md
    # has it for a recipe that gains an env section); one that may not keeps the text
    r = apply_overrides(base, ["eval.reward=null", "dataset.config=~", "dataset.split=null"])
    assert (r.eval.reward, r.dataset.config, r.dataset.split) == (None, None, "null")


def test_override_mistakes():
    base = load_recipe("qwen3-8b")
    assert error_of(apply_overrides, base, ["grpo.stepz=3"]).startswith(
        "unknown key 'grpo.stepz'; did you mean steps? valid keys under grpo: advantage_std, "
        "aggregation, checkpoint_finish_s, checkpoint_interval"
    )
    assert (
        "valid keys under the top level: dataset, description, env, eval, generator, grpo, "
        "layout, model, name, reference, resources, trainer, watchdog, weight_sync"
    ) in error_of(apply_overrides, base, ["gpro.steps=3"])
    assert "did you mean grpo?" in error_of(apply_overrides, base, ["gpro.steps=3"])
    # a key in the wrong case names the key it meant, wherever difflib would not
    assert "did you mean grpo?" in error_of(apply_overrides, base, ["GRPO.steps=3"])
    assert "did you mean kl_beta?" in error_of(apply_overrides, base, ["grpo.KL_BETA=1"])
    # a blank value, a section given a value: one line each, saying what to write
    assert error_of(apply_overrides, base, ["grpo.learning_rate="]).endswith(
        "grpo.learning_rate: Input should be a valid number (got no value)"
    )
    assert error_of(apply_overrides, base, ["grpo=5"]).startswith(
        "override 'grpo=5': grpo is a section; set its keys, e.g. grpo."
    )
    assert "dataset.rewards is a list of 2; use an index 0..1" in error_of(
        apply_overrides, base, ["dataset.rewards.5.weight=1"]
    )
    assert "grpo.steps is a value, not a section" in error_of(
        apply_overrides, base, ["grpo.steps.x=1"]
    )
    assert "must look like KEY=VALUE" in error_of(apply_overrides, base, ["grpo.steps"])
    # the example is a key of the recipe's own kind
    sft = load_recipe("tiny-sft")
    assert error_of(apply_overrides, sft, ["sft.warmup_steps"]).endswith("e.g. sft.steps=20")
    assert "value is not valid YAML" in error_of(apply_overrides, base, ["grpo.steps=[1"])
    assert error_of(apply_overrides, base, ["grpo.group_size=1"]) == (
        "qwen3-8b with grpo.group_size=1: grpo.group_size: Input should be greater than or "
        "equal to 2 (got 1)"
    )
    assert "layout.generator.tp: 3 must divide" in error_of(
        apply_overrides, base, ["layout.generator.tp=3"]
    )


def test_import_is_torch_and_skypilot_free():
    code = (
        "import sys, recipes; recipes.plan(recipes.load_recipe('qwen3-8b'), 8); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sky', 'skypilot', 'launcher', 'runtime')]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_package_reexports_the_contract_api():
    for name in (
        "load_recipe",
        "list_recipes",
        "apply_overrides",
        "minimum_gpus",
        "plan",
        "UserError",
    ):
        assert callable(getattr(recipes, name))
    assert issubclass(recipes.UserError, Exception)


@pytest.mark.parametrize(
    ("base", "overrides", "expected"),
    [
        (
            "tiny",
            ["eval.k=4", "eval.samples=2"],
            "eval.k: pass@4 needs at least 4 samples a prompt",
        ),
        (
            "tiny",
            ["eval.split=validation"],
            "eval.split: the shipped task builtin:tiny has no split",
        ),
        ("qwen3-8b", ["eval.split=train"], "eval.split: 'train' is the split the run trains on"),
        (
            "tiny",
            ["eval.reward=format"],
            "eval.reward: 'format' is not one of the recipe's rewards",
        ),
        ("tiny", ["eval.prompts=0"], "eval.prompts: Input should be greater than or equal to 1"),
    ],
)
def test_bad_evaluations_are_refused(base, overrides, expected):
    recipe = load_recipe(base)
    message = error_of(apply_overrides, recipe, ["eval.enabled=true", *overrides])
    assert expected in message


def test_an_evaluation_of_local_data_needs_held_out_data(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "#### 2"}\n')
    recipe = load_recipe("qwen3-8b")
    same = ["eval.enabled=true", f"dataset.path={data}"]
    assert "name a held-out file as eval.path" in error_of(apply_overrides, recipe, same)
    held_out = tmp_path / "test.jsonl"
    held_out.write_text(data.read_text())
    ok = apply_overrides(recipe, [*same, f"eval.path={held_out}"])
    assert ok.eval.path == str(held_out)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    message = error_of(apply_overrides, recipe, ["eval.enabled=true", f"dataset.path={saved}"])
    assert "has no split 'test' (it has train, validation)" in message
    apply_overrides(recipe, ["eval.enabled=true", f"dataset.path={saved}", "eval.split=validation"])


def test_thinking_mode_is_qwen3s_only():
    recipe = load_recipe("llama3.1-8b")
    message = error_of(apply_overrides, recipe, ["model.thinking=true"])
    assert "model.thinking: llama3 models have no thinking mode" in message
    assert apply_overrides(load_recipe("qwen3-8b"), ["model.thinking=true"]).model.thinking


# --- model.lora ----------------------------------------------------------------------------------

LORA = ["model.lora.rank=8", "layout.reference.device=trainer"]


def test_a_lora_section_parses_with_its_defaults():
    r = apply_overrides(load_recipe("tiny"), LORA)
    lora = r.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets) == (8, None, 0.0, "all-linear")
    assert (lora.scaling_alpha, lora.scaling) == (16.0, 2.0)
    assert lora.modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip
    assert r.layout.reference.in_trainer
    assert not r.layout.reference.on_gpu and not r.layout.reference.on_cpu
    full = {"rank": 16, "alpha": 8, "dropout": 0, "targets": ["v_proj", "q_proj"]}
    lora = apply_overrides(r, [f"model.lora={full}"]).model.lora
    assert (lora.scaling, lora.modules) == (0.5, ("q_proj", "v_proj"))


def test_the_recorded_recipe_carries_model_lora_as_written():
    # RUN_DIR/config.json and W&B's config are model_dump(mode="json"): alpha stays None (not
    # 2 x rank), so the recorded recipe validates to the same one
    r = apply_overrides(load_recipe("tiny"), LORA)
    dumped = r.model_dump(mode="json")
    assert dumped["model"]["lora"] == {
        "rank": 8, "alpha": None, "dropout": 0.0, "targets": "all-linear",
    }  # fmt: skip
    assert schema.Recipe.model_validate(dumped) == r
    assert load_recipe("tiny").model_dump(mode="json")["model"]["lora"] is None


def test_both_set_forms_turn_lora_on_and_off():
    tiny = load_recipe("tiny")
    assert tiny.model.lora is None
    on = apply_overrides(tiny, LORA)  # a dotted key into an absent section
    assert on.model.lora.rank == 8
    assert apply_overrides(tiny, ["model.lora={rank: 8}", LORA[1]]).model.lora == on.model.lora
    # targets may be all-linear or a list: a list typed on the command line is a list
    two = apply_overrides(on, ["model.lora.targets=[q_proj,v_proj]"]).model.lora
    assert two.targets == ["q_proj", "v_proj"]
    assert apply_overrides(on, ["model.lora.targets=all-linear"]) == on
    template = apply_overrides(on, ["dataset.prompt_template={question} [1, 2]"])
    assert template.dataset.prompt_template == "{question} [1, 2]"  # a string field stays one
    off = apply_overrides(on, ["model.lora=null", "layout.reference.device=gpu"])
    assert off.model.lora is None and off == tiny
    # a mistyped key of the absent section is named with the section's keys
    assert error_of(apply_overrides, tiny, ["model.lora.rnak=8"]) == (
        "unknown key 'model.lora.rnak'; did you mean rank? valid keys under model.lora: "
        "alpha, dropout, rank, targets"
    )
    # a value still is not a section, and a required section cannot be null
    assert "model.tokenizer is a value, not a section" in error_of(
        apply_overrides, tiny, ["model.tokenizer.x=1"]
    )
    assert "model is a section; set its keys" in error_of(apply_overrides, tiny, ["model=null"])
    assert error_of(apply_overrides, tiny, ["model.lora.alpha=4"]).endswith(
        "model.lora.rank: required field is missing"
    )


@pytest.mark.parametrize(
    ("base", "overrides", "expected"),
    [
        (
            "tiny",
            ["model.lora.rank=0"],
            "model.lora.rank: a LoRA rank is at least 1; remove model.lora to train every "
            "parameter",
        ),
        (
            "tiny",
            ["model.lora.rank=-4"],
            "model.lora.rank: a LoRA rank is at least 1; remove model.lora to train every "
            "parameter",
        ),
        (
            "tiny",
            ["model.lora.rank=65"],
            "model.lora.rank: 65 exceeds the qwen3 tiny hidden size 64",
        ),
        (
            "qwen3-8b",
            ["model.lora.rank=1024"],
            "model.lora.rank: 1024 exceeds 512, the largest LoRA rank vLLM serves (the GPU "
            "generator); lower it",
        ),
        (
            "tiny",
            ["model.lora.alpha=0"],
            "model.lora.alpha: must be > 0, got 0.0 (the adapter is scaled by alpha / rank); "
            "leave it out for 2 x rank",
        ),
        (
            "tiny",
            ["model.lora.dropout=0.05"],
            "model.lora.dropout: 0.05 is not supported: TorchTitan's LoRA has no dropout; set 0 "
            "or leave it out",
        ),
        (
            "tiny",
            ["model.lora.targets=[qkv_proj]"],
            "model.lora.targets: 'qkv_proj' is not a qwen3 projection (q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj, or all-linear)",
        ),
        (
            "llama3.1-8b",
            ["model.lora.targets=[q_proj, wq]"],
            "model.lora.targets: 'wq' is not a llama3 projection (q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj, or all-linear)",
        ),
        (
            "tiny",
            ["model.lora.targets=[]"],
            "model.lora.targets: an empty list wraps nothing; name projections, or all-linear "
            "for all of them",
        ),
        (
            "tiny",
            ["model.lora.targets=[q_proj, v_proj, q_proj]"],
            "model.lora.targets: 'q_proj' is listed twice",
        ),
        (
            "tiny",
            ["model.lora.targets=[q_proj, all-linear]"],
            "model.lora.targets: all-linear stands alone (targets: all-linear), not in a list",
        ),
        (
            "tiny",
            ["model.lora.targets=q_proj"],
            "model.lora.targets: a list of projections (e.g. [q_proj, v_proj]) or all-linear, "
            "got 'q_proj'",
        ),
        (
            "tiny",
            ["weight_sync.push_buffer=groups"],
            "weight_sync.push_buffer: groups streams a full model's blocks; a LoRA version is "
            "the adapter alone and goes whole; leave it auto",
        ),
        (
            "tiny",
            ["layout.reference.device=gpu"],
            "layout.reference.device: a LoRA run's reference is its base with the adapter off, "
            "in the trainer's processes; set layout.reference.device=trainer (or "
            "layout.reference.enabled=false)",
        ),
        (
            "tiny",
            ["layout.reference.device=cpu"],
            "layout.reference.device: a LoRA run's reference is its base with the adapter off",
        ),
        (
            "tiny",
            ["model.lora=null"],
            "layout.reference.device: trainer scores the reference as the base with the "
            "adapter off, which only a LoRA run has (model.lora); set "
            "layout.reference.device=gpu (or cpu)",
        ),
        (
            "tiny",
            ["layout.reference.gpus=2"],
            "layout.reference.gpus: a reference in the trainer's processes takes no GPU of its "
            "own (it runs on the trainer's); set it to 1, got 2",
        ),
        (
            "qwen3-8b",
            ["layout.reference.spread=true"],
            "layout.reference.spread: a reference in the trainer's processes runs on every "
            "trainer GPU already; set it to false",
        ),
        (
            "qwen3-8b",
            ["reference.ranks=2"],
            "reference.ranks: a reference in the trainer's processes runs on the trainer's "
            "ranks (trainer.ranks); leave it auto, got 2",
        ),
        (
            "qwen3-8b",
            ["reference.compile=true"],
            "reference.compile: a reference in the trainer's processes runs the trainer's "
            "model, compiled as trainer.compile says; leave it auto",
        ),
        (
            "tiny",
            ["generator.lora_dual_stream=true"],
            "generator.lora_dual_stream: tunes vLLM's LoRA kernels, and this recipe's "
            "generators are transformers' (generator.backend hf, or a CPU recipe); leave it false",
        ),
        (
            "qwen3-8b",
            ["generator.backend=hf", "generator.lora_specialize_active=true"],
            "generator.lora_specialize_active: tunes vLLM's LoRA kernels, and this recipe's "
            "generators are transformers'",
        ),
        (
            "qwen3-8b",
            ["layout.sharing=mps", "layout.mps_sm_percent.reference=50"],
            "layout.mps_sm_percent.reference: a reference in the trainer's processes runs "
            "under the trainer's share (layout.mps_sm_percent.trainer); leave it 100",
        ),
    ],
)
def test_each_bad_lora_setting_is_one_line(base, overrides, expected):
    message = error_of(apply_overrides, load_recipe(base), [*LORA, *overrides])
    assert message.startswith(f"{base} with ")
    assert expected in message


def test_vllms_lora_kernel_options_need_a_lora_run_and_show_in_its_plan():
    full = load_recipe("qwen3-8b")
    for key in ("lora_dual_stream", "lora_specialize_active"):
        assert error_of(apply_overrides, full, [f"generator.{key}=true"]).endswith(
            f"generator.{key}: tunes vLLM's LoRA kernels, and this recipe trains every "
            "parameter (no model.lora); leave it false"
        )
    lora = load_recipe("qwen3-8b-lora")
    assert not lora.generator.lora_dual_stream and not lora.generator.lora_specialize_active
    line = next(x for x in plan(lora, 1).describe().splitlines() if "max_loras" in x)
    assert "lora_dual_stream" not in line and "lora_specialize_active" not in line
    both = ["generator.lora_dual_stream=true", "generator.lora_specialize_active=true"]
    line = next(
        x for x in plan(apply_overrides(lora, both), 1).describe().splitlines() if "max_loras" in x
    )
    assert line.endswith("max_loras 2, lora_dual_stream on, lora_specialize_active on")


def test_a_reference_in_the_trainer_needs_lora_and_a_disabled_one_needs_no_device():
    tiny = load_recipe("tiny")
    assert "which only a LoRA run has (model.lora)" in error_of(
        apply_overrides, tiny, ["layout.reference.device=trainer"]
    )
    alone = apply_overrides(tiny, ["model.lora.rank=8", "layout.reference.enabled=false"])
    assert alone.model.lora.rank == 8 and not alone.layout.reference.in_trainer


@pytest.mark.parametrize("folder", ["runs/sft/model", "./m", "s3://bucket/sft/model"])
def test_a_model_folder_nothing_would_read_is_refused(folder):
    # tiny: random weights and a tokenizer of its own, so hf_id is read by nothing
    tiny = load_recipe("tiny")
    message = error_of(apply_overrides, tiny, [f"model.hf_id={folder}"])
    assert f"model.hf_id: {folder!r} is a model folder, but model.init is random" in message
    assert "add --set model.init=hub" in message
    sft = load_recipe("tiny-sft")
    assert "model.init is random" in error_of(apply_overrides, sft, [f"model.hf_id={folder}"])
    # with init=hub the run starts from it; a Hub id (owner/name) is not a folder
    assert apply_overrides(tiny, [f"model.hf_id={folder}", "model.init=hub"]).model.init == "hub"
    assert apply_overrides(tiny, ["model.hf_id=Qwen/Qwen3-0.6B"]).model.hf_id == "Qwen/Qwen3-0.6B"


def test_a_path_deeper_than_a_hub_id_is_local():
    from recipes.files import looks_local

    assert looks_local("runs/sft/model") and looks_local("./m") and looks_local("data.jsonl")
    assert not looks_local("Qwen/Qwen3-1.7B") and not looks_local("openai/gsm8k")
    assert not looks_local("s3://bucket/a/b")
