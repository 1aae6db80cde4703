"""The services' settings: every knob is a recipe field, "auto" values are planned for the GPU
type and the layout (recipes/settings.py), `plan` shows them, and a setting that cannot fit is
refused with its memory arithmetic."""

from __future__ import annotations

import pytest

from recipes import UserError, apply_overrides, load_recipe, plan
from recipes.memory import (
    ACCELERATOR_BYTES,
    PLAN_HEADROOM,
    trainer_memory_plan,
)
from recipes.placements import Placement, shared_services
from recipes.settings import plan_settings

H100, H200 = ACCELERATOR_BYTES["H100"], ACCELERATOR_BYTES["H200"]


def recipe(name: str, *overrides: str):
    """A catalog recipe with every service on GPUs of its own (the settings of a layout are
    what this file is about) unless the overrides name another layout.share."""
    if not load_recipe(name).cpu and not any(o.startswith("layout.share=") for o in overrides):
        overrides = ("layout.share=none", *overrides)
    return apply_overrides(load_recipe(name), list(overrides))


# --- the trainer's memory plan -----------------------------------------------------------------


def test_memory_plan_is_calibrated_on_the_measured_peaks_and_stays_above_them():
    # Qwen3-1.7B alone on an H200, compiled, no checkpointing: peaks of 67.8, 90.9 and 137.1 GB
    # at 8192, 16384 and 32768 tokens per micro-batch (bench/results, trainer_mfu).
    arch = recipe("qwen3-1.7b").arch
    for tokens, measured in ((8192, 67.8e9), (16384, 90.9e9), (32768, 137.1e9)):
        _, checkpointing, peak = trainer_memory_plan(arch, 1, 10**15, tokens=tokens)
        assert not checkpointing
        assert measured < peak < 1.15 * measured, tokens


def test_memory_plan_keeps_activations_where_the_gpu_holds_them():
    small, big = recipe("qwen3-1.7b").arch, recipe("qwen3-8b").arch
    assert trainer_memory_plan(small, 1, H200)[:2] == (16384, False)
    assert trainer_memory_plan(small, 1, H100)[:2] == (8192, False)
    # 8B over two H100 ranks: the sharded optimizer state leaves room only with checkpointing
    tokens, checkpointing, peak = trainer_memory_plan(big, 2, H100)
    assert checkpointing and peak <= PLAN_HEADROOM * H100
    assert trainer_memory_plan(big, 1, H100) is None  # nothing fits one H100
    # more memory never means fewer tokens or checkpointing where less memory went without
    previous = None
    for gb in range(60, 200, 10):
        fit = trainer_memory_plan(small, 1, gb * 2**30)
        assert fit is not None
        if previous is not None and not previous[1]:
            assert not fit[1] and fit[0] >= previous[0]
        previous = fit[:2]


# --- planned settings --------------------------------------------------------------------------


def test_auto_settings_are_planned_for_the_gpu_type():
    on_h100 = plan(recipe("qwen3-1.7b"), 3).settings
    on_h200 = plan(recipe("qwen3-1.7b"), 3, accelerator="H200").settings
    assert (on_h100.trainer.tokens_per_micro_batch, on_h100.trainer.activation_checkpointing) == (
        8192,
        False,
    )
    assert (on_h200.trainer.tokens_per_micro_batch, on_h200.trainer.activation_checkpointing) == (
        16384,
        False,
    )
    for s in (on_h100, on_h200):
        assert s.generator.backend == "vllm" and s.trainer.compile and s.reference.compile
        assert s.generator.kv_cache_gb is None and s.generator.gpu_memory_utilization == 0.85
        assert s.weight_sync.expected == ("push",)  # the generator has a GPU of its own
        assert "trainer.tokens_per_micro_batch" in s.planned
    eight = plan(recipe("qwen3-8b"), 5).settings.trainer
    assert (eight.ranks, eight.activation_checkpointing) == (2, True)
    with pytest.raises(UserError, match="runs on H100 or H200"):
        plan(recipe("qwen3-1.7b"), 3, accelerator="A100")


def test_the_push_paths_buffer_is_planned_or_a_version_goes_a_group_at_a_time():
    """push sends each version from one flat bf16 buffer on trainer rank 0 (2 bytes a
    parameter): where that leaves the trainer no micro-batch, "auto" pushes a group at a time
    (no buffer on the trainer); where it fits, the trainer's micro-batch is planned without it;
    where a generator cannot hold its receive buffer beside vLLM, the store streams instead."""
    from recipes.memory import ACCELERATOR_BYTES, trainer_memory_plan

    for name, gpus, accelerator, buffer in (
        ("qwen3-14b", 8, "H100", "groups"),
        ("qwen3-8b", 8, "H100", "version"),
        ("qwen3-32b", 16, "H200", "groups"),
    ):
        r = recipe(name)
        s = plan(r, gpus, accelerator=accelerator).settings
        sync = s.weight_sync
        assert (sync.transport, set(sync.expected), sync.push_buffer) == (
            "auto",
            {"push"},
            buffer,
        ), (name, gpus)
        assert "weight_sync.push_buffer" in s.planned
        flat = 2 * r.arch.params
        room = ACCELERATOR_BYTES[accelerator] - flat
        whole = trainer_memory_plan(r.arch, s.trainer.ranks, room)
        if buffer == "groups":
            assert whole is None
        else:
            assert whole is not None
            assert s.trainer.peak_gb * 1e9 + flat <= ACCELERATOR_BYTES[accelerator]
    # 32B's generator on H100s cannot hold its 65.5 GB receive buffer beside vLLM: the store
    s = plan(recipe("qwen3-32b"), 16, accelerator="H100").settings
    assert (s.weight_sync.transport, s.weight_sync.expected) == ("store", ("store",))
    assert "weight_sync.transport" in s.planned
    # what the recipe sets is kept: a whole version where it leaves the trainer's step no room
    # is refused with the arithmetic, and planned where it fits
    with pytest.raises(UserError) as err:
        plan(recipe("qwen3-14b", "weight_sync.push_buffer=version"), 8, accelerator="H100")
    assert str(err.value) == (
        "weight_sync.push_buffer version: a whole version (29.5 GB) beside trainer rank 0's "
        "shards leaves it no micro-batch that fits an H100; leave it auto (a group at a time, "
        "no buffer on the trainer)"
    )
    forced = plan(recipe("qwen3-8b", "weight_sync.transport=push"), 8).settings
    assert forced.weight_sync.transport == "push" and set(forced.weight_sync.expected) == {"push"}
    assert forced.weight_sync.push_buffer == "version"
    # the push set by hand where a whole version leaves no room: a group at a time
    forced = plan(recipe("qwen3-8b", "weight_sync.transport=push"), 5).settings
    assert (forced.weight_sync.transport, forced.weight_sync.push_buffer) == ("push", "groups")


def test_a_cpu_plan_samples_with_transformers_and_compiles_nothing():
    s = plan(recipe("tiny"), 0).settings
    assert s.generator.backend == "hf"
    assert (s.trainer.ranks, s.trainer.compile, s.reference.compile) == (1, False, False)
    assert (s.trainer.tokens_per_micro_batch, s.trainer.activation_checkpointing) == (8192, False)
    assert s.weight_sync.expected == ("store",)


def test_a_value_the_recipe_sets_is_kept_and_the_rest_planned_around_it():
    # checkpointing forced on: the largest micro-batch that fits with it
    s = plan(recipe("qwen3-1.7b", "trainer.activation_checkpointing=true"), 3).settings.trainer
    assert s.activation_checkpointing and s.tokens_per_micro_batch == 16384
    assert (
        "trainer.activation_checkpointing"
        not in plan(
            recipe("qwen3-1.7b", "trainer.activation_checkpointing=true"), 3
        ).settings.planned
    )
    # a micro-batch too big to keep activations: checkpointing is planned on, not refused
    s = plan(recipe("qwen3-1.7b", "trainer.tokens_per_micro_batch=32768"), 3).settings.trainer
    assert (s.tokens_per_micro_batch, s.activation_checkpointing) == (32768, True)
    s = plan(
        recipe("qwen3-1.7b", "trainer.compile=false", "generator.enforce_eager=true"), 3
    ).settings
    assert not s.trainer.compile and s.generator.enforce_eager


def test_the_generators_engine_is_shown_recorded_and_left_out_on_cpu():
    """vLLM's engine core in the generator's process unless the recipe gives it one of its own:
    `plan` shows which on GPUs (a CPU plan's transformers generator has no such engine)."""
    default = plan(recipe("qwen3-1.7b"), 3).settings
    assert default.generator.engine == "in-process"
    assert "enforce_eager off, engine in-process" in "\n".join(default.describe())
    apart = plan(recipe("qwen3-1.7b", "generator.engine=separate"), 3).settings
    assert apart.to_dict()["generator"]["engine"] == "separate"
    assert "generator.engine" not in apart.planned
    assert "engine separate" in "\n".join(apart.describe())
    cpu = plan(load_recipe("tiny"), 0).settings
    assert "engine" not in "\n".join(cpu.describe(cpu=True))


def test_settings_that_cannot_fit_are_refused_with_the_arithmetic():
    big = recipe(
        "qwen3-1.7b",
        "trainer.tokens_per_micro_batch=65536",
        "trainer.activation_checkpointing=false",
    )
    with pytest.raises(UserError) as info:
        plan(big, 3)
    message = str(info.value)
    assert "65536 tokens per micro-batch without activation checkpointing need ~" in message
    assert "GB per trainer GPU" in message
    # the generator is pushed to: rank 0 keeps the 3.4 GB flat bf16 buffer of each version
    assert "90% of what an H100 leaves beside the 3.4 GB weight-push buffer is 74 GB" in message
    assert "set trainer.activation_checkpointing=true" in message and "\n" not in message
    with pytest.raises(
        UserError, match=r"generator.kv_cache_gb: 90 GB of KV cache \+ 3 GB of bf16 weights"
    ):
        plan(recipe("qwen3-1.7b", "generator.kv_cache_gb=90"), 3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("generator.gpu_memory_utilization=1.5", "must be in (0, 1] or auto, got 1.5"),
        ("generator.kv_cache_gb=0", "must be > 0 or auto, got 0"),
        ("trainer.tokens_per_micro_batch=0", "must be >= 1 or auto, got 0"),
        ("trainer.compile=maybe", "trainer.compile"),
        ("weight_sync.timeout_s=0", "weight_sync.timeout_s: Input should be greater than 0"),
        ("generator.engine=both", "generator.engine: Input should be 'in-process' or 'separate'"),
    ],
)
def test_bad_settings_are_one_line_errors(override, message):
    with pytest.raises(UserError) as info:
        recipe("qwen3-1.7b", override)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_services_sharing_a_gpu_get_a_fixed_kv_cache_and_the_trainer_what_they_leave():
    placements = (
        Placement("generator", 0, 0, (0,)),
        Placement("reference", 0, 0, (1,)),
        Placement("trainer", 0, 0, (1,)),
        Placement("reward", 0, 0, ()),
    )
    assert shared_services(placements) == {"reference", "trainer"}
    r = recipe("qwen3-1.7b")

    def settings(accelerator: str, beside: frozenset[str]):
        return plan_settings(
            r,
            accelerator=accelerator,
            shared=frozenset({"generator", "trainer", "reference"}),
            beside_trainer=beside,
            trainer_gpus=1,
            generator_replicas=1,
        )

    s = settings("H200", frozenset({"generator", "reference"}))
    # 16 prompts x 8 samples of 2048 tokens, 112 KiB of bf16 keys and values a token: 30 GB
    assert s.generator.kv_cache_gb == 30.5 and s.generator.gpu_memory_utilization == 0.05
    # an H200 less vLLM (3.4 GB of weights, the 30.5 GB cache, 3 GB) and the reference's 8.5 GB
    # fits 8192 tokens without recomputing; beside the reference alone, 16384
    assert (s.trainer.tokens_per_micro_batch, s.trainer.activation_checkpointing) == (8192, False)
    alone = settings("H200", frozenset({"reference"})).trainer
    assert (alone.tokens_per_micro_batch, alone.activation_checkpointing) == (16384, False)
    # an H100 beside vLLM and the reference: 4096 tokens, recomputed (~34 of its ~36 GB)
    small = settings("H100", frozenset({"generator", "reference"})).trainer
    assert (small.tokens_per_micro_batch, small.activation_checkpointing) == (4096, True)
    assert small.peak_gb == 34.2 and small.note is None
    assert s.reference.tokens_per_micro_batch == 8192
    # uncompiled (the fp32 log-softmax of the head kept for backward) not even that: 8192
    # tokens recomputed, and `plan` says so with the arithmetic
    r = recipe("qwen3-1.7b", "trainer.compile=false")
    eager = settings("H100", frozenset({"generator", "reference"})).trainer
    assert (eager.tokens_per_micro_batch, eager.activation_checkpointing) == (8192, True)
    assert eager.peak_gb is None and s.trainer.note is None
    assert eager.note is not None and eager.note.endswith(
        "above the ~36 GB its memory plan keeps beside what shares its GPU: the smallest step"
    ), eager.note
    one_h100 = plan(recipe("qwen3-1.7b", "layout.share=auto"), 1)
    line = next(x for x in one_h100.describe().splitlines() if x.startswith("  trainer "))
    assert line.endswith(f"({one_h100.settings.trainer.note})"), line


def test_plan_shows_and_records_every_setting():
    p = plan(recipe("qwen3-1.7b", "trainer.compile=false"), 3)
    text = p.describe()
    assert "settings (* planned for H100; set any with --set SECTION.KEY=VALUE):" in text
    assert "tokens_per_micro_batch 8192*" in text and "compile off (~" in text
    assert "kv_cache_gb profiled*" in text and "(expected: push)" in text
    recorded = p.to_dict()["settings"]
    assert recorded["trainer"]["compile"] is False
    assert recorded["generator"]["backend"] == "vllm"
    assert "trainer.compile" not in recorded["planned"]


def test_a_generator_taking_the_push_path_leaves_room_for_the_buffer_it_receives_into():
    # qwen3-8b on 8 H100s: two TP2 generators on GPUs of their own take each version by push
    # into a 16.4 GB buffer on their first GPU: vLLM at 0.85 would leave 12.8 GB there
    r = load_recipe("qwen3-8b")
    s = plan(r, 8, accelerator="H100").settings
    assert s.weight_sync.expected == ("push", "push")
    assert s.generator.gpu_memory_utilization == 0.77  # (85.5 - 16.4 - 3) / 85.5, rounded down
    assert "generator.gpu_memory_utilization" in s.planned
    # an H200 leaves room at 0.85; a generator on the ipc path receives nothing of its own
    assert plan(r, 8, accelerator="H200").settings.generator.gpu_memory_utilization == 0.85
    one = recipe("qwen3-1.7b")
    assert plan(one, 3, accelerator="H100").settings.generator.gpu_memory_utilization == 0.85
    # a share the recipe sets is kept, and refused where the buffer does not fit beside it
    # (with layout.share auto the planner then takes a layout whose generators share GPUs)
    with pytest.raises(UserError) as err:
        plan(recipe("qwen3-8b", "generator.gpu_memory_utilization=0.85"), 8, accelerator="H100")
    assert str(err.value) == (
        "generator.gpu_memory_utilization: 0.85 of an H100 leaves 12.8 GB beside vLLM, and the "
        "push path receives each version into a 16.4 GB buffer on the generator's first GPU "
        "(with 3 GB for the process): set it to at most 0.77, or weight_sync.transport=store"
    )
    kept = recipe("qwen3-8b", "generator.gpu_memory_utilization=0.7")
    assert plan(kept, 8, accelerator="H100").settings.generator.gpu_memory_utilization == 0.7


def test_the_push_path_gives_way_to_the_store_where_vllm_would_not_fit_beside_its_buffer():
    # qwen3-32b with TP1 generators of 64 sequences a group on H200s: a 65.5 GB buffer beside
    # 65.5 GB of weights and a group's 34 GB KV cache does not fit one GPU
    def settings(*overrides: str):
        r = recipe(
            "qwen3-32b",
            "resources.accelerator=H200",
            "layout.generator.tp=1",
            "grpo.group_size=64",
            "grpo.prompts_per_step=1",
            *overrides,
        )
        return plan_settings(
            r,
            accelerator="H200",
            shared=frozenset(),
            trainer_gpus=16,
            generator_replicas=1,
            expected_paths=("push",),
        )

    s = settings()
    assert s.weight_sync.transport == "store" and s.weight_sync.expected == ("store",)
    assert s.generator.gpu_memory_utilization == 0.85
    with pytest.raises(UserError) as err:
        settings("weight_sync.transport=push")
    assert str(err.value).startswith(
        "the push path: a 65.5 GB receive buffer on the generator's first GPU leaves vLLM "
        "0.54 of an H200, less than the "
    )


def test_a_push_a_group_at_a_time_keeps_no_version_on_the_trainer_and_is_refused_elsewhere():
    # qwen3-14b on 8 H100s: a whole version beside trainer rank 0's shards leaves it no
    # micro-batch, so auto pushes a group at a time; the store, set by hand, keeps none either
    r = load_recipe("qwen3-14b")
    groups = plan(r, 8, accelerator="H100")
    sync = groups.settings.weight_sync
    assert (sync.expected, sync.push_buffer) == (("push",), "groups")
    assert "weight_sync.push_buffer" in groups.settings.planned
    store = plan(apply_overrides(r, ["weight_sync.transport=store"]), 8, accelerator="H100")
    assert store.settings.weight_sync.push_buffer == "none"
    # the trainer's GPUs hold the same as with the store path (no buffer of a version) ...
    assert groups.while_training_gb == store.while_training_gb
    # ... the generator leaves room for the 29.6 GB it receives into, and a version is
    # predicted to move in about 2 s at the rate measured in a run instead of the store's minutes
    assert groups.settings.generator.gpu_memory_utilization == 0.61
    assert groups.predicted_step_s < store.predicted_step_s / 5
    assert "not measured" not in groups.prediction
    assert "push_buffer groups* (expected: push)" in "\n".join(groups.settings.describe())
    # where the push path goes out whole anyway (auto: version), or is not taken at all
    assert plan(recipe("qwen3-1.7b"), 3).settings.weight_sync.push_buffer == "version"
    with pytest.raises(UserError) as err:
        plan(apply_overrides(load_recipe("qwen3-1.7b"), ["weight_sync.push_buffer=groups"]), 1)
    assert str(err.value) == (
        "weight_sync.push_buffer groups: no generator takes the push path in this plan; leave "
        "it auto"
    )
