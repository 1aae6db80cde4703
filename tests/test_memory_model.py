"""The memory model against the models themselves: every catalog model built at full size on the
meta device (no storage), its exact parameter count and the exact shard each GPU holds (FSDP2's
own sharding of the meta model, through the trainer's code, with a fake process group), compared
with what `recipes/memory.py` estimates for every recipe at its minimum and at 8 GPUs."""

from __future__ import annotations

import json
import math

import pytest

from recipes import UserError, architecture, list_recipes, load_recipe, minimum_gpus, plan
from recipes.memory import GB, RUNTIME_OVERHEAD_GB, trainer_fixed_bytes
from runtime.backends import build
from runtime.models.titan import meta_model

# plan() shows GB rounded to 0.1
ROUNDING = 0.05 * 1e9
GPU_RECIPES = [n for n in list_recipes() if load_recipe(n).resources.accelerator != "cpu"]
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
        # trainer: fp32 weights, gradients and two AdamW moments of this rank's shard
        ranks = p.trainer_gpus
        state = 16 * sum(fsdp_shard(s, ranks) for s in params)
        assert p.memory["trainer"] * GB + ROUNDING >= state + RUNTIME_OVERHEAD_GB * GB, (
            gpus,
            "trainer",
        )
        for checkpointing in (False, True):
            assert trainer_fixed_bytes(arch, ranks, checkpointing) >= state, (gpus, "plan")
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
