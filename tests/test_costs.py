"""The planner's cost model and the layouts it picks (layout.share auto)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from recipes import (
    apply_overrides,
    dedicated_gpus,
    list_recipes,
    load_recipe,
    minimum_gpus,
    plan,
)
from recipes.costs import predict_step, speeds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cost_constants  # noqa: E402

GPU_RECIPES = [
    n for n in list_recipes() if not load_recipe(n).cpu and load_recipe(n).kind == "grpo"
]


def recipe(name: str, *overrides: str):
    return apply_overrides(load_recipe(name), list(overrides))


def test_the_measured_speeds_are_the_ones_the_committed_runs_give():
    # recipes/measured.py is written from bench/results by bench/cost_constants.py
    text = (Path(cost_constants.__file__).parents[1] / "recipes" / "measured.py").read_text()
    assert text == cost_constants.module_text(cost_constants.derive())


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_auto_takes_the_fastest_layout_that_fits(name):
    r = load_recipe(name)
    for accelerator in ("H100", "H200"):
        least = minimum_gpus(r, accelerator)
        for gpus in sorted({least, least + 1, dedicated_gpus(r), 8}):
            if gpus < least or (
                gpus > r.resources.gpus_per_node and gpus % r.resources.gpus_per_node
            ):
                continue
            p = plan(r, gpus, accelerator=accelerator)
            fits = [c for c in p.candidates if c.refused is None]
            chosen = [c for c in p.candidates if c.chosen]
            assert len(chosen) == 1 and chosen[0].share == p.share
            assert chosen[0].step_s == min(c.step_s for c in fits) == p.predicted_step_s
            assert all(c.refused for c in p.candidates if c.step_s is None)


def test_qwen3_1_7b_shares_gpus_where_that_is_faster():
    # one GPU: everything on it; two: the generator alone, the trainer beside the reference;
    # three H200s: the same with the trainer sharded over two GPUs (at the recipe's 2048-token
    # sequences a trainer on one GPU of its own bounds the step); three H100s: the same (a GPU
    # each would be bound by the staleness chain, half of generate + reference + one rank's
    # train, 7.79 s against the generator's 7.37 s beside the sharded trainer)
    r = load_recipe("qwen3-1.7b")
    one, two, three = (plan(r, n, accelerator="H200") for n in (1, 2, 3))
    assert (one.share, two.share, three.share) == ("all", "trainer_reference", "trainer_reference")
    where = {p.service: p.gpus for p in two.placements if p.gpus}
    assert where == {"generator": (0,), "reference": (1,), "trainer": (1,)}
    where = {p.service: p.gpus for p in three.placements if p.gpus}
    assert where == {"generator": (0,), "reference": (2,), "trainer": (1, 2)}
    assert two.settings.weight_sync.expected == ("push",)
    assert two.settings.generator.kv_cache_gb is None  # the generator profiles its own GPU
    assert one.predicted_step_s > two.predicted_step_s > three.predicted_step_s
    h100 = plan(r, 3, accelerator="H100")
    assert h100.share == "trainer_reference"
    apart = next(c for c in h100.candidates if c.share == "none")
    assert apart.step_s > h100.predicted_step_s and "max_policy_age" in apart.bound_by


def test_a_shared_trainer_is_planned_in_what_the_others_leave_on_its_gpu():
    # qwen3-1.7b on one GPU: beside vLLM's weights and fixed cache and the reference, an H200
    # leaves room for 8192 tokens a micro-batch without recomputing (what the benchmark used
    # to set by hand); an H100 does not, and the trainer recomputes
    r = load_recipe("qwen3-1.7b")
    h200 = plan(r, 1, accelerator="H200").settings.trainer
    h100 = plan(r, 1, accelerator="H100").settings.trainer
    assert (h200.tokens_per_micro_batch, h200.activation_checkpointing) == (8192, False)
    assert h200.peak_gb is not None
    assert (h100.tokens_per_micro_batch, h100.activation_checkpointing) == (8192, True)
    # a value the recipe sets is kept
    given = plan(recipe("qwen3-1.7b", "trainer.tokens_per_micro_batch=4096"), 1)
    assert given.settings.trainer.tokens_per_micro_batch == 4096


def test_a_layout_the_recipe_names_is_the_only_one_planned():
    p = plan(recipe("qwen3-1.7b", "layout.share=trainer_reference"), 3)
    assert p.share == "trainer_reference" and p.candidates == ()
    assert "only that layout was planned" in p.explain()
    none = plan(recipe("qwen3-1.7b", "layout.share=none"), 3)
    assert none.share == "none" and none.predicted_step_s is not None


def test_lock_step_adds_up_every_service():
    r = recipe("qwen3-1.7b", "grpo.max_policy_age=0")
    p = plan(r, 3, accelerator="H200")
    estimate = predict_step(
        r,
        "H200",
        p.placements,
        trainer_checkpointing=p.settings.trainer.activation_checkpointing,
        transports=p.settings.weight_sync.expected,
    )
    assert estimate.seconds == pytest.approx(sum(estimate.work.values()))
    overlapped = plan(load_recipe("qwen3-1.7b"), 3, accelerator="H200")
    assert overlapped.predicted_step_s < p.predicted_step_s


def test_speeds_say_where_they_come_from():
    assert speeds("H200", load_recipe("qwen3-8b").arch).basis == "H200 qwen3-8b (measured)"
    scaled = speeds("H100", load_recipe("qwen3-32b").arch)
    assert scaled.basis.startswith("H200 qwen3-8b, scaled to 32.8B parameters")
    assert scaled.basis.endswith("scaled to H100 by memory bandwidth and bf16 peak")
    # a bigger model samples and trains fewer tokens a second; an H100 samples fewer
    small = speeds("H200", load_recipe("qwen3-8b").arch)
    assert scaled.generate_tok_s < small.generate_tok_s and scaled.train_tok_s < small.train_tok_s
    assert speeds("H100", load_recipe("qwen3-8b").arch).generate_tok_s < small.generate_tok_s


def test_more_gpus_never_predict_a_slower_step():
    r = load_recipe("qwen3-1.7b")
    steps = [plan(r, n, accelerator="H200").predicted_step_s for n in range(1, 9)]
    assert all(b <= a for a, b in zip(steps, steps[1:], strict=False)), steps


def test_a_tp_group_splits_the_weight_reads_of_a_decode_step():
    # qwen3-1.7b's weights are about a seventh of a 128-sequence decode step on an H200: TP2
    # samples about 1.08x as fast as one GPU (measured 1.07x, gpu_grpo_h200x4_2026-11-22.json);
    # a large model's decode is mostly reading weights, up to the t^0.5 the model allows
    from recipes.costs import tp_replicas

    small = load_recipe("qwen3-1.7b").arch
    s = speeds("H200", small)
    assert tp_replicas(1, "H200", small, s.generate_tok_s, s.sequences_per_call) == 1
    two = tp_replicas(2, "H200", small, s.generate_tok_s, s.sequences_per_call)
    assert 1.05 < two < 1.1
    large = load_recipe("qwen3-32b").arch
    s = speeds("H200", large)
    assert tp_replicas(4, "H200", large, s.generate_tok_s, s.sequences_per_call) == 2.0


def test_an_off_policy_plan_that_overlaps_nothing_says_on_policy_is_as_fast():
    # qwen3-1.7b (max_policy_age 1) on one GPU: its services take turns, nothing overlaps
    shared = plan(load_recipe("qwen3-1.7b"), 1, accelerator="H200")
    line = shared.fresher_policy
    assert line.startswith("grpo.max_policy_age 0 (on-policy) is predicted at ")
    assert line.endswith("--set grpo.max_policy_age=0") and line in shared.describe().splitlines()
    there, here = map(
        float, re.match(r".* at ([0-9.]+) s a step against ([0-9.]+) ", line).groups()
    )
    on_policy = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_policy_age=0"])
    fresher = plan(on_policy, 1, accelerator="H200")
    assert fresher.placements == shared.placements
    assert there == pytest.approx(fresher.predicted_step_s, abs=0.01)
    assert here == pytest.approx(shared.predicted_step_s, abs=0.01) and there <= 1.02 * here
    # where staleness buys speed (qwen3-8b on 8 H100s, bound by it), or already on-policy: none
    assert plan(load_recipe("qwen3-8b"), 8).fresher_policy == ""
    assert fresher.fresher_policy == ""
    # two steps a call need max_policy_age 1: no line that suggests a setting refused
    two = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.steps_per_call=2"])
    assert plan(two, 1, accelerator="H200").fresher_policy == ""


def test_a_plan_bound_by_staleness_says_what_one_version_more_would_take():
    # qwen3-8b on 8 H100s: each call waits for the step two before it to train
    staled = plan(load_recipe("qwen3-8b"), 8)
    assert staled.prediction.startswith("max_policy_age: a call starts once the step 2 before")
    line = staled.staler_policy
    assert line.startswith("grpo.max_policy_age 2 is predicted at ")
    assert line.endswith("--set grpo.max_policy_age=2")
    there, here = map(
        float, re.match(r".* at ([0-9.]+) s a step against ([0-9.]+):", line).groups()
    )
    staler = plan(apply_overrides(load_recipe("qwen3-8b"), ["grpo.max_policy_age=2"]), 8)
    assert here == pytest.approx(staled.predicted_step_s, abs=0.01)
    assert there == pytest.approx(staler.predicted_step_s, abs=0.01) and there <= 0.9 * here
    assert line in staled.describe().splitlines()
    # bound by a GPU's work (qwen3-1.7b on 3), or on-policy (no overlap to gain): no line
    assert plan(load_recipe("qwen3-1.7b"), 3).staler_policy == ""
    on_policy = apply_overrides(load_recipe("qwen3-8b"), ["grpo.max_policy_age=0"])
    assert plan(on_policy, 8).staler_policy == ""
