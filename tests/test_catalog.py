"""The shipped catalog: names, header comments, upstream GRPO settings, and that each fits."""

import re

import pytest

from recipes import (
    apply_overrides,
    dedicated_gpus,
    estimate_memory,
    launch_gpus,
    list_recipes,
    load_recipe,
    minimum_gpus,
    plan,
)
from recipes.loader import catalog_path
from recipes.memory import ACCELERATOR_GB, version_bytes

NAMES = [
    "llama3.1-8b",
    "llama3.1-8b-lora",
    "llama3.2-1b",
    "llama3.2-3b",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-1.7b-tools",
    "qwen3-14b",
    "qwen3-14b-lora",
    "qwen3-32b",
    "qwen3-32b-lora",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-8b-lora",
    "tiny",
    "tiny-gpu",
    "tiny-lora",
    "tiny-tools",
]
CPU_NAMES = ["tiny", "tiny-lora", "tiny-tools"]
GPU_NAMES = [n for n in NAMES if n not in CPU_NAMES]
MODEL_NAMES = [n for n in GPU_NAMES if n != "tiny-gpu"]  # the Qwen3 and Llama recipes
LORA_NAMES = [n for n in NAMES if n.endswith("-lora")]


def header(name: str) -> str:
    lines = catalog_path(name).read_text().splitlines()
    comments = []
    for line in lines:
        if not line.startswith("#"):
            break
        comments.append(line)
    return "\n".join(comments)


SFT_NAMES = ["llama3.1-8b-sft", "qwen3-1.7b-sft", "qwen3-8b-sft", "tiny-sft"]


def test_catalog_names():
    assert list_recipes() == sorted(NAMES + SFT_NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_recipe_name_matches_file(name):
    assert load_recipe(name).name == name


@pytest.mark.parametrize("name", GPU_NAMES)
def test_header_states_the_computed_minimum_and_run_command(name):
    text = header(name)
    assert text.startswith(f"# {name}: ")
    need = dedicated_gpus(load_recipe(name))
    assert re.search(r"Minimum: (\d+) GPUs", text).group(1) == str(need)
    least = minimum_gpus(load_recipe(name))
    if least < need:  # the least with services sharing GPUs, where that is fewer
        assert re.search(r"Minimum: \d+ GPUs [^,]*, (\d+) with ", text).group(1) == str(least)
    launched = launch_gpus(load_recipe(name))
    assert f"forgesky launch {name} --gpus {launched}" in text
    if launched != need:  # a count VM clouds do not sell: the header says where it runs
        assert f"--gpus {need} where a Kubernetes cluster grants it" in text
    assert f"forgesky cp {name} " in text


@pytest.mark.parametrize("name", CPU_NAMES)
def test_tiny_header_says_cpu(name):
    text = header(name)
    assert "Minimum: 0 GPUs (runs on CPU)" in text and f"forgesky local {name}\n" in text
    assert minimum_gpus(load_recipe(name)) == 0


@pytest.mark.parametrize(
    ("name", "need", "shared", "gated"),
    [("qwen3-1.7b", 3, 1, False), ("qwen3-8b", 5, 4, False), ("llama3.1-8b", 5, 4, True)],
)
def test_headline_minimums(name, need, shared, gated):
    # a GPU for each service as the upstream recipes state; with services sharing GPUs (on the
    # recipe's H100) the least the planner finds room for
    r = load_recipe(name)
    assert dedicated_gpus(r) == need
    assert minimum_gpus(r) == shared
    assert r.model.gated is gated


def test_headline_layouts():
    lay = load_recipe("qwen3-8b").layout
    assert (lay.generator.tp, lay.reference.gpus, lay.trainer.gpus) == (2, 1, 2)
    assert load_recipe("llama3.1-8b").model.hf_id == "meta-llama/Meta-Llama-3.1-8B-Instruct"


@pytest.mark.parametrize(
    ("name", "prompts"), [("qwen3-1.7b", 16), ("qwen3-8b", 12), ("llama3.1-8b", 4)]
)
def test_upstream_grpo_settings_on_gsm8k(name, prompts):
    r = load_recipe(name)
    d, g = r.dataset, r.grpo
    assert (d.path, d.config, d.split, d.prompt_field, d.answer_field) == (
        "openai/gsm8k",
        "main",
        "train",
        "question",
        "answer",
    )
    assert [w.name for w in d.rewards] == ["math", "gsm8k_format"]
    assert r.model.thinking is (False if r.model.family == "qwen3" else None)
    assert (r.eval.enabled, r.eval.split, r.eval.reward) == (True, "test", "math")
    assert (g.group_size, g.prompts_per_step, g.max_prompt_tokens, g.max_response_tokens) == (
        8,
        prompts,
        1024,
        1024,
    )
    assert (g.learning_rate, g.kl_beta, g.clip_low, g.clip_high, g.loss, g.max_policy_age) == (
        1e-5,
        0.1,
        0.2,
        0.28,
        "grpo",
        1,
    )


def test_llama_recipes_are_gated_and_qwen_are_not():
    for name in MODEL_NAMES:
        assert load_recipe(name).model.gated == name.startswith("llama")


def test_qwen3_32b_needs_two_nodes():
    r = load_recipe("qwen3-32b")
    need = minimum_gpus(r)
    assert need > 8
    p = plan(r, need)
    assert p.num_nodes == 2
    assert plan(r, 16).num_nodes == 2


@pytest.mark.parametrize("name", GPU_NAMES)
def test_every_gpu_recipe_fits_h100_at_its_minimum(name):
    r = load_recipe(name)
    assert r.resources.accelerator == "H100"
    memory = estimate_memory(r)
    # a reference in the trainer's processes (a LoRA run's) holds nothing of its own
    services = (
        {"generator", "reference", "trainer"}
        if r.layout.reference.on_gpu
        else {
            "generator",
            "trainer",
        }
    )
    assert set(memory) == services
    assert all(0 < gb <= ACCELERATOR_GB["H100"] for gb in memory.values()), memory
    p = plan(apply_overrides(r, ["layout.share=none"]), dedicated_gpus(r))
    # the trainer also holds the push path's flat bf16 buffer where it pushes a whole version
    # (a LoRA run's: the adapter)
    whole = p.settings.weight_sync.push_buffer == "version"
    buffer = version_bytes(r) / 1e9 if whole else 0.0
    assert p.memory == {**memory, "trainer": round(memory["trainer"] + buffer, 1)}
    assert p.memory["trainer"] <= ACCELERATOR_GB["H100"] and not p.idle_gpus


def test_tiny_recipe():
    r = load_recipe("tiny")
    assert r.cpu and r.resources.accelerator == "cpu"
    assert (r.model.family, r.model.size, r.model.tokenizer, r.model.init, r.model.dtype) == (
        "qwen3",
        "tiny",
        "builtin:tiny",
        "random",
        "float32",
    )
    assert r.dataset.path == "builtin:tiny" and [w.name for w in r.dataset.rewards] == [
        "builtin:tiny"
    ]
    g = r.grpo
    assert (g.group_size, g.loss, g.max_policy_age) == (8, "grpo", 1)
    # checkpoints land inside the run, not only at its end
    assert 0 < g.checkpoint_interval < g.steps
    assert g.max_prompt_tokens + g.max_response_tokens <= r.arch.max_seq_len


def test_tiny_gpu_recipe_runs_the_tiny_task_on_two_gpus_without_a_reference():
    r = load_recipe("tiny-gpu")
    assert not r.layout.reference.enabled and r.grpo.kl_beta == 0
    assert dedicated_gpus(r) == 2 and minimum_gpus(r) == 1
    p = plan(r, 2)
    assert p.share == "none"
    assert p.settings.weight_sync.expected == ("push",)  # generator and trainer apart
    assert r.arch.head_dim == 64 and r.model.tokenizer == "builtin:tiny"
    assert r.grpo.max_prompt_tokens + r.grpo.max_response_tokens <= r.arch.max_seq_len


@pytest.mark.parametrize(
    ("name", "need", "shared", "on_h200", "gated"),
    [
        ("qwen3-8b-lora", 2, 1, 1, False),
        ("llama3.1-8b-lora", 2, 1, 1, True),
        ("qwen3-14b-lora", 2, 2, 1, False),
        ("qwen3-32b-lora", 4, 4, 2, False),
    ],
)
def test_lora_minimums(name, need, shared, on_h200, gated):
    # the base in bf16 and a rank-16 adapter's state: an 8B model's trainer fits one H100 beside
    # its generator (4096 tokens recomputed); a 32B one needs two trainer ranks on H100s, one
    # GPU each on H200s shared with the generator's
    r = load_recipe(name)
    assert (dedicated_gpus(r), minimum_gpus(r), minimum_gpus(r, "H200")) == (need, shared, on_h200)
    assert r.model.gated is gated
    assert launch_gpus(r) == need


@pytest.mark.parametrize("name", LORA_NAMES)
def test_a_lora_recipe_is_its_parents_run_with_an_adapter(name):
    parent = name.removesuffix("-lora")
    r, full = load_recipe(name), load_recipe(parent)
    lora = r.model.lora
    assert (lora.rank, lora.scaling_alpha, lora.targets) == (16, 32, "all-linear")
    assert r.layout.reference.in_trainer and full.model.lora is None
    assert r.model.model_copy(update={"lora": None}) == full.model
    assert (r.dataset, r.eval, r.resources) == (full.dataset, full.eval, full.resources)
    assert r.grpo.learning_rate > full.grpo.learning_rate  # an adapter takes larger steps
    changed = {"learning_rate": full.grpo.learning_rate}
    if r.cpu:
        # the frozen random head caps the reward near 0.1 at temperature 1; tiny-lora samples
        # at 0.2 and takes longer (bench/results/tiny_lora_learning.json)
        assert (r.grpo.temperature, r.grpo.steps) == (0.2, 150)
        changed |= {"temperature": full.grpo.temperature, "steps": full.grpo.steps}
    assert r.grpo.model_copy(update=changed) == full.grpo
