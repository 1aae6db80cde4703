"""The memory model against the models themselves: every catalog model built at full size on the
meta device (no storage), its exact parameter count and the exact shard each GPU holds (FSDP2's
own sharding of the meta model, through the trainer's code, with a fake process group), compared
with what `recipes/memory.py` estimates for every recipe at its minimum and at 8 GPUs."""

from __future__ import annotations

import json
import math

import pytest

from recipes import (
    UserError,
    apply_overrides,
    architecture,
    estimate_memory,
    list_recipes,
    load_recipe,
    minimum_gpus,
    plan,
)
from recipes.lora import adapter_params, max_lora_rank, slot_bytes
from recipes.memory import (
    GB,
    LORA_ONE_RANK_WORKSPACE,
    RUNTIME_OVERHEAD_GB,
    checkpoint_bytes,
    disk_plan,
    lora_graph_bytes,
    lora_slot_bytes,
    model_file_bytes,
    trainer_fixed_bytes,
    trainer_step_bytes,
    version_bytes,
)
from runtime.backends import build
from runtime.models.titan import meta_model

# plan() shows GB rounded to 0.1
ROUNDING = 0.05 * 1e9
GPU_RECIPES = [
    n
    for n in list_recipes()
    if load_recipe(n).resources.accelerator != "cpu" and load_recipe(n).kind == "grpo"
]
_SHAPES: dict[tuple[str, str], list[tuple[int, ...]]] = {}


def shapes(recipe) -> list[tuple[int, ...]]:
    """Every parameter's shape (a tied embedding once), from the model built on meta."""
    key = (recipe.model.family, recipe.model.size)
    if key not in _SHAPES:
        model = meta_model(build.model_spec(recipe))
        _SHAPES[key] = [tuple(p.shape) for p in model.parameters()]
    return _SHAPES[key]


def fsdp_shard(shape: tuple[int, ...], ranks: int) -> int:
    """Elements one FSDP2 rank holds of a parameter: dim 0 chunked (torch.chunk), padded."""
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def tp_shard(shape: tuple[int, ...], tp: int) -> int:
    """Elements one tensor-parallel rank holds: matrices split, norm weights replicated."""
    return math.ceil(math.prod(shape) / tp) if len(shape) > 1 else math.prod(shape)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_the_parameter_count_is_the_models(name: str):
    recipe = load_recipe(name)
    arch = architecture(recipe.model.family, recipe.model.size)
    assert sum(math.prod(s) for s in shapes(recipe)) == arch.params


def _plans(recipe):
    smallest = minimum_gpus(recipe)
    for gpus in sorted({smallest, 8}):
        try:
            yield gpus, plan(recipe, gpus)
        except UserError as e:
            # a count below the minimum is refused, with both numbers in the one line
            assert gpus < smallest and str(smallest) in str(e), (gpus, str(e))


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_gpu_estimate_covers_its_exact_shard(name: str):
    recipe = load_recipe(name)
    arch = architecture(recipe.model.family, recipe.model.size)
    params = shapes(recipe)
    checked = 0
    for gpus, p in _plans(recipe):
        # trainer: fp32 weights, gradients and two AdamW moments of this rank's shard; with
        # LoRA the frozen base's shard in bf16 and those 16 bytes of the adapter's
        ranks = p.trainer_gpus
        lora = recipe.model.lora
        if lora is None:
            state = 16 * sum(fsdp_shard(s, ranks) for s in params)
        else:
            state = 2 * sum(fsdp_shard(s, ranks) for s in params)
            state += 16 * math.ceil(adapter_params(arch, lora) / ranks)
        assert p.memory["trainer"] * GB + ROUNDING >= state + RUNTIME_OVERHEAD_GB * GB, (
            gpus,
            "trainer",
        )
        for checkpointing in (False, True):
            assert trainer_fixed_bytes(arch, ranks, checkpointing, lora) >= state, (gpus, "plan")
        # generator and reference: bf16 weights of one tensor-parallel rank
        weights = 2 * sum(tp_shard(s, p.generator_tp) for s in params)
        assert p.memory["generator"] * GB + ROUNDING >= weights + RUNTIME_OVERHEAD_GB * GB, (
            gpus,
            "gen",
        )
        if "reference" in p.memory:
            weights = 2 * sum(fsdp_shard(s, p.reference_gpus) for s in params)
            assert p.memory["reference"] * GB + ROUNDING >= weights, (gpus, "reference")
        # and nothing is planned onto a GPU it cannot fit
        limit = {"H100": 80.0, "H200": 141.0}[p.accelerator]
        assert max(p.memory.values()) <= limit, (gpus, p.memory)
        checked += 1
    assert checked >= 1


_FSDP2_SHARDS = """
import json, sys, types
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from recipes import load_recipe
from runtime.backends import build
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.models.titan import meta_model
out = []
for name, world in json.loads(sys.argv[1]):
    for rank in (0, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        model = meta_model(build.model_spec(load_recipe(name)))
        # the trainer's own sharding (FSDP2 per block and at the root), on meta
        owner = types.SimpleNamespace(
            model=model, device=torch.device("cpu"), world=world, compute_dtype=torch.bfloat16
        )
        FSDPTrainer._shard(owner)
        local = sum(p._local_tensor.numel() for p in model.parameters())
        out.append([name, world, rank, local])
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_fsdp2_shards_every_catalog_model_as_the_estimates_count():
    """FSDP2 itself, through the trainer's `_shard`, on the meta model of every catalog recipe at
    the trainer ranks of its plans (a fake process group: no storage, no peers): rank 0 holds
    exactly the ceil-chunked shard `fsdp_shard` counts, the last rank no more."""
    import subprocess
    import sys
    from pathlib import Path

    cases = sorted(
        {(name, p.trainer_gpus) for name in GPU_RECIPES for _, p in _plans(load_recipe(name))}
    )
    assert any(ranks > 1 for _, ranks in cases)
    done = subprocess.run(
        [sys.executable, "-c", _FSDP2_SHARDS, json.dumps(cases)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen) == 2 * len(cases)
    for name, world, rank, local in seen:
        counted = sum(fsdp_shard(s, world) for s in shapes(load_recipe(name)))
        if rank == 0:
            assert local == counted, (name, world)
        else:
            assert local <= counted, (name, world, rank)


# --- against what GPU runs measured (bench/memory_check.py, bench/results/memory_model_check.json)


def _memory_check():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import memory_check

    return memory_check


def test_the_committed_memory_check_is_todays_model():
    # a change to recipes/memory.py or the planner rewrites bench/results/memory_model_check.json
    # (python bench/memory_check.py --out bench/results/memory_model_check.json)
    check = _memory_check()
    rows = check.rows()
    assert len(rows) > len(check.RUNS)  # and a row per trainer-alone config
    committed = json.loads(check.OUT.read_text())
    assert committed == {"model": "recipes/memory.py", "runs": rows}


def test_the_publish_estimate_covers_every_publish_that_streamed_a_group_at_a_time():
    rows = [r for r in _memory_check().rows() if "publish_gb" in r]
    assert len(rows) >= 10
    for row in rows:
        publish = row["publish_gb"]
        if row.get("publish_gathered_a_whole_version"):
            # what the streaming publish fixed: above today's estimate, as docs/benchmarks.md says
            assert publish["estimate"] < publish["measured"], row
        else:
            assert publish["estimate"] >= publish["measured"], row


def test_the_checkpoint_estimate_covers_every_measured_checkpoint():
    rows = [r for r in _memory_check().rows() if "checkpoint_gb" in r]
    assert len(rows) >= 5  # 1.7B on one and two ranks, both 8B models on two
    for row in rows:
        assert row["checkpoint_gb"]["estimate"] >= row["checkpoint_gb"]["measured"], row


def test_the_trainer_estimate_covers_every_measured_step_and_start_up():
    # H100 runs in the loop: one and two ranks, with and without activation checkpointing,
    # compiled and eager; the trainer alone on an H200 at four micro-batches. The model may be high (it plans with headroom); below a measured peak, a plan that
    # it lets through could run out of memory on a paid node.
    for row in _memory_check().rows():
        step = row["step_gb"]
        assert step["estimate"] >= step["measured"], row
        assert row.get("startup_below_step_estimate", True), row


# --- LoRA: the adapter's size and what a LoRA run holds ------------------------------------------


@pytest.mark.parametrize(
    ("name", "adapter"),
    [
        # rank 16 x (in + out) of q, k, v, o, gate, up, down, in every block
        ("qwen3-8b-lora", 36 * 16 * (2 * 8192 + 2 * 5120 + 3 * 16384)),
        ("llama3.1-8b-lora", 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)),
        ("qwen3-14b-lora", 40 * 16 * (2 * 10240 + 2 * 6144 + 3 * 22528)),
        ("qwen3-32b-lora", 64 * 16 * (2 * 13312 + 2 * 6144 + 3 * 30720)),
        ("tiny-lora", 2 * 16 * (2 * 128 + 2 * 96 + 3 * 192)),
    ],
)
def test_the_adapter_is_rank_times_in_plus_out_of_each_projection(name, adapter):
    r = load_recipe(name)
    assert adapter_params(r.arch, r.model.lora) == adapter
    assert version_bytes(r) == 2 * adapter  # bf16, as a version goes to the generators
    assert checkpoint_bytes(r.arch, r.model.lora) == 12 * adapter  # fp32 weights, two moments
    assert model_file_bytes(r) == 4 * adapter  # the exported adapter, fp32
    assert disk_plan(r)["exported model"] == round(4 * adapter / GB, 1)
    two_q = apply_overrides(r, ["model.lora.targets=[q_proj, v_proj]"]).model.lora
    assert adapter_params(r.arch, two_q) < adapter


@pytest.mark.parametrize(
    ("name", "tokens", "peaks"),
    [
        # GB a trainer rank peaks at with activation checkpointing, on 1, 2 and 4 ranks
        ("qwen3-8b-lora", 4096, (26.3, 17.5, 13.2)),
        ("qwen3-8b-lora", 8192, (31.4, 22.5, 18.2)),
        ("qwen3-32b-lora", 4096, (81.1, 47.8, 30.9)),
        ("qwen3-32b-lora", 8192, (90.0, 56.7, 39.8)),
    ],
)
def test_a_lora_trainer_holds_the_bf16_base_and_the_adapters_state(name, tokens, peaks):
    r = load_recipe(name)
    arch, lora = r.arch, r.model.lora
    got = tuple(
        round(trainer_step_bytes(arch, ranks, tokens, True, True, lora) / GB, 1)
        for ranks in (1, 2, 4)
    )
    assert got == peaks
    # the base in bf16 (the embedding in fp32 on one rank) and 16 bytes an adapter parameter
    one = 2 * arch.params + 2 * arch.vocab_size * arch.dim + 16 * adapter_params(arch, lora)
    assert trainer_fixed_bytes(arch, 1, True, lora) == one + 3e9
    # against every parameter trained: a fraction
    assert trainer_fixed_bytes(arch, 2, True, lora) < trainer_fixed_bytes(arch, 2, True) / 4


def test_one_lora_rank_without_checkpointing_is_planned_above_its_measured_peak():
    # no autocast copies of a bf16 base and no workspace beyond the activations: qwen3-8b rank
    # 16 on one H200 at 8192 tokens, compiled, peaked at 67.4 GB in its step (the trainer's
    # allocator; bench/results/gpu_h200_2026-11-28-lora): the estimate stays above it
    r = load_recipe("qwen3-8b-lora")
    arch, lora = r.arch, r.model.lora
    assert LORA_ONE_RANK_WORKSPACE == 0
    assert trainer_fixed_bytes(arch, 1, False, lora) == trainer_fixed_bytes(arch, 1, True, lora)
    estimate = trainer_step_bytes(arch, 1, 8192, False, True, lora) / GB
    assert round(estimate, 1) == 82.5 and estimate > 67.4


def test_a_lora_generator_reserves_vllms_adapter_slots():
    r = load_recipe("qwen3-8b-lora")
    full = apply_overrides(
        r, ["model.lora=null", "layout.reference.device=gpu", "layout.trainer.gpus=2"]
    )
    # two adapters of max_lora_rank 16 on every linear, bf16: 0.17 GB for an 8B model
    assert lora_slot_bytes(r) == 2 * 2 * adapter_params(r.arch, r.model.lora)
    assert round(lora_slot_bytes(r) / GB, 2) == 0.17
    slots = lora_slot_bytes(r) / GB  # each estimate is rounded to 0.1 GB
    gap = estimate_memory(r)["generator"] - estimate_memory(full)["generator"]
    assert gap == pytest.approx(slots, abs=0.1)
    assert lora_slot_bytes(full) == 0
    assert lora_slot_bytes(load_recipe("tiny-lora")) == 0  # transformers' generate: no slots
    # rank 17 is served at vLLM's rank 32: slots of that rank
    wider = apply_overrides(r, ["model.lora.rank=17"])
    assert lora_slot_bytes(wider) == 2 * slot_bytes(r.arch, 16)


def test_a_reference_in_the_trainer_has_no_memory_of_its_own():
    r = load_recipe("qwen3-8b-lora")
    assert set(estimate_memory(r)) == {"generator", "trainer"}
    assert "reference" in estimate_memory(load_recipe("qwen3-8b"))


def test_vllms_lora_rank_is_the_smallest_allowed_one_at_least_the_recipes():
    got = {rank: max_lora_rank(rank) for rank in (1, 2, 8, 9, 16, 17, 100, 257, 320, 321, 512)}
    assert got == {
        1: 1, 2: 8, 8: 8, 9: 16, 16: 16, 17: 32, 100: 128, 257: 320, 320: 320, 321: 512, 512: 512,
    }  # fmt: skip
    assert max_lora_rank(513) is None


def test_lora_specialize_active_adds_its_second_set_of_cuda_graphs():
    r = load_recipe("qwen3-8b-lora")
    on = apply_overrides(r, ["generator.lora_specialize_active=true"])
    # qwen3-8b-lora on one H200: 4.01 GiB of graphs with it, 1.22 without (2026-12-01c)
    assert lora_graph_bytes(r) == 0
    assert lora_graph_bytes(on) / 2**30 == pytest.approx(4.01 - 1.22)
    gap = estimate_memory(on)["generator"] - estimate_memory(r)["generator"]
    assert gap == pytest.approx(3.0, abs=0.1)
    # no graphs without them: enforce_eager, or transformers' generate on a CPU
    eager = apply_overrides(on, ["generator.enforce_eager=true"])
    assert lora_graph_bytes(eager) == 0
    # a wider, deeper model captures larger graphs
    big = apply_overrides(load_recipe("qwen3-32b-lora"), ["generator.lora_specialize_active=true"])
    assert lora_graph_bytes(big) > lora_graph_bytes(on)
