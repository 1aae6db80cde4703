"""Services that share a GPU take turns; generate calls that carry several steps' prompts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from runtime_helpers import run_on_one_gpu

from recipes import UserError, apply_overrides, estimate_memory, load_recipe, plan
from runtime.control.turns import GpuTurns, shared_gpus


def test_services_on_their_own_gpus_never_take_turns():
    recipe = apply_overrides(load_recipe("qwen3-1.7b"), ["layout.share=none"])
    assert plan(recipe, 3).share == "none" and plan(recipe, 8).share == "none"
    assert shared_gpus(plan(recipe, 3).placements) == {}
    assert shared_gpus(plan(recipe, 8).placements) == {}
    assert not GpuTurns(plan(recipe, 3).placements)


def test_one_gpu_puts_every_gpu_service_on_one_lock():
    one = plan(load_recipe("qwen3-1.7b"), 1)
    assert shared_gpus(one.placements) == {(0, 0): {"generator0", "reference", "trainer"}}


def test_two_gpus_pair_the_services_that_land_on_the_same_one():
    # the plan for 2 GPUs: the generator alone, the trainer beside the reference
    two = plan(load_recipe("qwen3-1.7b"), 2)
    where = {p.service: p.gpus for p in two.placements if p.service != "reward"}
    assert where == {"generator": (0,), "reference": (1,), "trainer": (1,)}
    assert shared_gpus(two.placements) == {(0, 1): {"reference", "trainer"}}


def test_sharing_is_per_gpu_and_per_node():
    from recipes.placements import Placement

    chain = [
        Placement("generator", 0, 0, (0, 1)),
        Placement("reference", 0, 0, (1, 2)),
        Placement("trainer", 0, 0, (2,)),
        Placement("generator", 1, 1, (0,)),  # same index, another node
        Placement("reward", 0, 0, ()),
    ]
    assert shared_gpus(chain) == {
        (0, 1): {"generator0", "reference"},
        (0, 2): {"reference", "trainer"},
    }


def spans_of(turns: GpuTurns, units: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Each unit's calls (0.05 s of work in its turn), all started at once: their spans."""
    spans: dict[str, list[tuple[float, float]]] = {}

    async def call(unit: str) -> None:
        async with turns.turn(unit):
            start = time.perf_counter()
            await asyncio.sleep(0.05)
            spans.setdefault(unit, []).append((start, time.perf_counter()))

    async def main() -> None:
        await asyncio.gather(*(call(u) for u in units))

    asyncio.run(main())
    return spans


def in_turn(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:], strict=False))


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_turns_serialize_a_shared_gpu_and_leave_other_units_alone():
    from recipes.placements import Placement

    placements = [
        Placement("generator", 0, 0, (0,)),
        Placement("trainer", 0, 0, (0,)),
        Placement("generator", 1, 0, (1,)),
        Placement("reference", 0, 0, (2,)),
    ]
    turns = GpuTurns(placements)
    spans = spans_of(turns, ["generator0", "trainer", "generator1", "reference", "generator0"])
    shared = spans["generator0"] + spans["trainer"]
    assert in_turn(shared), shared
    # the unshared ones ran alongside the first turn on the shared GPU
    (g1,), (ref,) = spans["generator1"], spans["reference"]
    first = min(shared)
    assert overlap(g1, first) and overlap(ref, first)
    stats = turns.take_stats()
    assert stats["gpu/turns_generator"] == 2 and stats["gpu/turns_trainer"] == 1
    assert "gpu/turns_reference" not in stats  # it shares with nobody: no turn taken
    assert stats["gpu/turn_wait_s"] >= 0.05 + 0.05 + 0.05 - 0.03  # the 2nd, 3rd waited
    assert turns.take_stats()["gpu/turn_wait_s"] == 0.0


def test_generators_on_gpus_of_their_own_sample_at_once_beside_a_trainer_over_both():
    """The plan for two GPUs with every service on both (`--gpus 2`, lock-step): a generator a
    GPU, the reference on GPU 1, the trainer FSDP over both. The generators share no GPU, so
    their calls run together; the trainer waits for both, the reference for generator1."""
    two = plan(apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_policy_age=0"]), 2)
    assert two.share == "all"
    turns = GpuTurns(two.placements)
    assert turns.describe() == (
        "generator0 + trainer (node 0 GPU 0); generator1 + reference + trainer (node 0 GPU 1)"
    )
    spans = spans_of(turns, ["generator0", "generator1", "reference", "trainer"])
    (g0,), (g1,), (ref,), (tr,) = (
        spans[u] for u in ("generator0", "generator1", "reference", "trainer")
    )
    assert overlap(g0, g1), (g0, g1)
    assert in_turn([g1, ref, tr]) and in_turn([g0, tr])
    # the reference waits for GPU 1 alone: it scores while generator0 is still sampling
    spans = spans_of(
        GpuTurns(two.placements), ["generator0", "generator1", "reference", "generator0"]
    )
    ref = spans["reference"][0]
    assert any(overlap(ref, g) for g in spans["generator0"]), spans


def test_a_reference_spread_over_both_gpus_takes_its_turn_on_both():
    """The same plan with layout.reference.spread: the reference is sharded over both GPUs, so
    it scores once both generators are done, and neither generator samples while it does."""
    two = plan(
        apply_overrides(
            load_recipe("qwen3-1.7b"), ["grpo.max_policy_age=0", "layout.reference.spread=true"]
        ),
        2,
    )
    assert two.placements_of("reference")[0].gpus == (0, 1)
    turns = GpuTurns(two.placements)
    assert turns.describe() == (
        "generator0 + reference + trainer (node 0 GPU 0); "
        "generator1 + reference + trainer (node 0 GPU 1)"
    )
    spans = spans_of(turns, ["generator0", "generator1", "reference", "trainer"])
    (g0,), (g1,), (ref,), (tr,) = (
        spans[u] for u in ("generator0", "generator1", "reference", "trainer")
    )
    assert overlap(g0, g1), (g0, g1)
    assert in_turn([g0, ref, tr]) and in_turn([g1, ref, tr])


def test_steps_per_call_needs_the_policy_age_to_cover_the_call():
    recipe = load_recipe("qwen3-1.7b")
    assert recipe.grpo.max_policy_age == 1
    assert apply_overrides(recipe, ["grpo.steps_per_call=2"]).grpo.steps_per_call == 2
    with pytest.raises(UserError) as err:
        apply_overrides(recipe, ["grpo.steps_per_call=3"])
    assert "grpo.steps_per_call: 3 needs grpo.max_policy_age >= 2" in str(err.value)
    with pytest.raises(UserError, match="grpo.steps_per_call"):
        apply_overrides(recipe, ["grpo.steps_per_call=0"])


def test_steps_per_call_grows_the_generators_kv_reserve():
    recipe = load_recipe("qwen3-8b")
    one = estimate_memory(recipe)
    two = estimate_memory(apply_overrides(recipe, ["grpo.steps_per_call=2"]))
    assert two["generator"] > one["generator"]
    assert two["trainer"] == one["trainer"] and two["reference"] == one["reference"]


@pytest.mark.slow
def test_a_run_on_one_shared_gpu_takes_turns_and_two_step_calls_stay_fresh(tmp_path: Path):
    """Real procs, `tiny` with generator, reference and trainer placed on GPU index 0."""
    run_dir = tmp_path / "run"
    out = run_on_one_gpu(
        run_dir, ["grpo.steps=8", "grpo.steps_per_call=2", "grpo.checkpoint_interval=0"]
    )
    assert "services sharing a GPU take turns: generator0 + reference + trainer" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    # every GPU service went through its turns
    for kind in ("generator", "reference", "trainer"):
        assert sum(r.get(f"gpu/turns_{kind}", 0) for r in rows) > 0, kind
    assert all(r["gpu/turns_trainer"] == 1 for r in rows)  # the step and its publish: one turn
    # one call per two steps (a ninth step's call may end before the last record)
    assert 4 <= sum(r["generator/calls"] for r in rows) <= 5
    # the second step of a call is trained one version later, never dropped as stale
    assert rows[-1]["buffer/dropped_stale"] == 0
    assert max(r["policy/staleness_mean"] for r in rows) == 1.0
