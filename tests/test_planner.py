"""The planner: minimums, the extra-GPU rule, nodes, CPU plans, and invariants over many layouts."""

import dataclasses
import functools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes import (
    UserError,
    apply_overrides,
    estimate_memory,
    list_recipes,
    load_recipe,
    minimum_gpus,
    plan,
)
from recipes.costs import predict_step
from recipes.lora import adapter_params
from recipes.measured import MEASURED
from recipes.memory import GB, kv_gb, trainer_step_bytes


@functools.cache
def recipe(name: str, *overrides: str):
    """A catalog recipe with every service on GPUs of its own (layout.share none: the rule
    most tests here are about) unless the overrides name another layout.share."""
    if not any(o.startswith("layout.share=") for o in overrides):
        overrides = ("layout.share=none", *overrides)
    return apply_overrides(load_recipe(name), list(overrides))


def error_of(*args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        plan(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def shape(p):
    return (p.generator_replicas, p.trainer_gpus, len(p.idle_gpus))


def test_minimum_is_the_sum_of_services():
    assert minimum_gpus(recipe("qwen3-8b")) == 2 + 1 + 2
    assert minimum_gpus(recipe("qwen3-8b", "layout.reference.enabled=false")) == 4
    assert minimum_gpus(recipe("qwen3-8b", "layout.generator.replicas=3")) == 6 + 1 + 2
    assert minimum_gpus(recipe("tiny")) == 0


def test_below_minimum_names_the_breakdown():
    assert error_of(recipe("qwen3-8b"), 4) == (
        "qwen3-8b needs at least 5 GPUs (generator 2 = TP2×1, reference 1, trainer 2 = FSDP2); "
        "4 with services sharing GPUs (layout.share auto); got 4"
    )
    assert "got 0" in error_of(recipe("qwen3-8b"), 0)
    assert error_of(recipe("qwen3-1.7b", "layout.share=auto"), 0).startswith(
        "qwen3-1.7b needs at least 1 GPU on an H100 with services sharing them"
    )
    assert "(generator 4 = TP4×1, reference 4 = FSDP4, trainer 8 = FSDP8); got 12" in error_of(
        recipe("qwen3-32b"), 12
    )


def test_minimum_plan_is_the_recipe_layout():
    p = plan(recipe("qwen3-8b"), 5)
    assert (p.total_gpus, p.num_nodes, p.gpus_per_node, p.minimum_gpus) == (5, 1, 5, 5)
    assert [(x.service, x.replica, x.node, x.gpus) for x in p.placements] == [
        ("generator", 0, 0, (0, 1)),
        ("reference", 0, 0, (2,)),
        ("trainer", 0, 0, (3, 4)),
        ("reward", 0, 0, ()),
        ("reward", 1, 0, ()),
    ]
    assert (p.trainer_gpus, p.idle_gpus) == (2, ())


def test_extra_gpus_go_to_the_generator_until_twice_the_trainer():
    r = recipe("qwen3-1.7b")  # generator TP1, reference 1, trainer 1
    # gpus: (generator replicas, trainer GPUs, idle)
    expected = {3: (1, 1, 0), 4: (2, 1, 0), 5: (2, 2, 0), 6: (3, 2, 0), 7: (4, 2, 0), 8: (4, 3, 0)}
    expected[16] = (10, 5, 0)  # two nodes: generator 10 = 2 x trainer 5
    assert {n: shape(plan(r, n)) for n in expected} == expected


def test_generator_tp_sets_the_replica_unit():
    r = recipe("qwen3-8b")  # generator TP2, trainer 2
    assert shape(plan(r, 6)) == (1, 3, 0)  # one spare GPU cannot hold a TP2 replica
    assert shape(plan(r, 7)) == (2, 2, 0)
    assert shape(plan(r, 8)) == (2, 3, 0)  # 4 generator GPUs reach 2 x 2: the trainer grows


def test_generator_never_exceeds_twice_the_trainer():
    r = recipe("qwen3-8b", "layout.generator.tp=4")  # replicas of 4 GPUs, trainer 2
    p = plan(r, 8)  # generator 4 = 2 x trainer 2: the spare GPU widens the trainer
    assert shape(p) == (1, 3, 0)
    # a second replica fits from 12 GPUs on; one GPU fewer goes to the trainer instead
    assert shape(plan(r, 11, gpus_per_node=16)) == (1, 6, 0)
    assert shape(plan(r, 12, gpus_per_node=16)) == (2, 3, 0)


def test_memory_follows_the_grown_layout():
    r = recipe("qwen3-8b")
    small, big = plan(r, 5).memory, plan(r, 8).memory
    assert big["trainer"] < small["trainer"]  # FSDP3 shards the optimizer state wider
    assert big["generator"] < small["generator"]  # KV reserve spread over 2 replicas
    assert big["reference"] == small["reference"]


def test_multi_node_puts_the_trainer_on_node_0_and_keeps_tp_groups_whole():
    p = plan(recipe("qwen3-32b"), 16)
    assert (p.num_nodes, p.gpus_per_node) == (2, 8)
    assert [(x.service, x.node, x.gpus) for x in p.placements if x.service != "reward"] == [
        ("generator", 1, (0, 1, 2, 3)),
        ("reference", 1, (4, 5, 6, 7)),
        ("trainer", 0, (0, 1, 2, 3, 4, 5, 6, 7)),
    ]
    # The trainer fills node 0 and cannot widen; the generator stops at twice its GPUs.
    p = plan(recipe("qwen3-32b"), 32)
    assert (p.num_nodes, p.generator_replicas, p.trainer_gpus) == (4, 4, 8)
    assert p.idle_gpus == ((3, 4), (3, 5), (3, 6), (3, 7))
    for x in p.placements_of("generator") + p.placements_of("reference"):
        assert len(x.gpus) == 4 and max(x.gpus) < 8 and x.node > 0
    assert [(x.node, x.gpus) for x in p.placements_of("trainer")] == [(0, tuple(range(8)))]
    assert all(x.node == 0 for x in p.placements_of("reward"))
    # Below a node, the trainer takes node 0 first and the rest of the services fill around it.
    p = plan(recipe("qwen3-8b"), 16)
    assert (p.generator_replicas, p.trainer_gpus, p.idle_gpus) == (5, 5, ())
    assert [(x.service, x.node, x.gpus) for x in p.placements if x.service != "reward"] == [
        ("generator", 0, (0, 1)),
        ("generator", 1, (0, 1)),
        ("generator", 1, (2, 3)),
        ("generator", 1, (4, 5)),
        ("generator", 1, (6, 7)),
        ("reference", 0, (2,)),
        ("trainer", 0, (3, 4, 5, 6, 7)),
    ]


def test_nodes_left_idle_are_explained():
    text = plan(recipe("qwen3-32b"), 48).describe()
    assert (
        "nodes 4-5 idle: the trainer stays on node 0, where checkpoints are written, and the "
        "generator stops at twice its GPUs; --gpus 32 gives the same plan"
    ) in text
    assert plan(recipe("qwen3-32b"), 48).placements == plan(recipe("qwen3-32b"), 32).placements
    assert "node 4 idle:" in plan(recipe("qwen3-32b"), 40).describe()
    assert " idle:" not in plan(recipe("qwen3-32b"), 32).describe()  # half a node: a row only


def test_trainer_larger_than_a_node_is_an_error():
    r = recipe("qwen3-32b", "resources.gpus_per_node=4")  # trainer FSDP8 on nodes of 4 GPUs
    assert error_of(r, 16) == (
        "qwen3-32b: the trainer's 8 GPUs must all sit on node 0 (the controller's node, where "
        "checkpoints are written), and a node here has 4; set layout.trainer.gpus to at most 4 "
        "or use nodes of at least 8 GPUs"
    )


def test_multi_node_uses_whole_nodes():
    assert error_of(recipe("qwen3-8b"), 9) == (
        "9 GPUs span 2 nodes, and a multi-node run uses whole nodes of 8 GPUs: use 8 or 16 GPUs"
    )
    assert error_of(recipe("qwen3-32b"), 20).endswith("use 16 or 24 GPUs")
    p = plan(recipe("qwen3-8b"), 8, gpus_per_node=4)
    assert (p.num_nodes, p.gpus_per_node) == (2, 4)
    assert plan(recipe("qwen3-8b"), 6).gpus_per_node == 6  # one node: as many GPUs as asked


def test_gpus_per_node_defaults_to_the_recipe():
    r = recipe("qwen3-8b", "resources.gpus_per_node=4")
    assert plan(r, 8).num_nodes == 2
    assert plan(r, 8, gpus_per_node=8).num_nodes == 1


def test_tp_group_that_cannot_sit_on_a_node_is_an_error():
    r = recipe("qwen3-8b", "layout.generator.tp=8")  # 8 + 1 + 2 = 11 GPUs
    message = error_of(r, 12, gpus_per_node=6)  # the TP8 replica fits neither node
    assert message.startswith("qwen3-8b: cannot place its services on 2 nodes of 6 GPUs")
    assert "largest TP 8" in message
    assert plan(r, 16).num_nodes == 2


def test_cpu_plan():
    p = plan(recipe("tiny"), 0)
    assert p.cpu and (p.total_gpus, p.num_nodes, p.generator_replicas, p.trainer_gpus) == (
        0,
        1,
        1,
        0,
    )
    assert [(x.service, x.replica, x.gpus) for x in p.placements] == [
        ("generator", 0, ()),
        ("reference", 0, ()),
        ("trainer", 0, ()),
        ("reward", 0, ()),
    ]
    p = plan(recipe("tiny", "layout.reward.procs=3", "layout.reference.enabled=false"), 0)
    assert [x.service for x in p.placements] == [
        "generator",
        "trainer",
        "reward",
        "reward",
        "reward",
    ]
    assert error_of(recipe("tiny"), 2) == (
        "tiny runs on CPU (resources.accelerator: cpu) and takes 0 GPUs, got 2; "
        "leave --gpus out (forgesky local tiny runs it here)"
    )
    assert "tiny on CPU" in plan(recipe("tiny"), 0).describe()


def test_cpu_plan_over_nodes_keeps_the_trainer_on_node_0():
    p = plan(recipe("tiny"), 0, nodes=3)
    assert p.cpu and p.num_nodes == 3
    assert [(x.service, x.replica, x.node) for x in p.placements] == [
        ("generator", 0, 1),
        ("reference", 0, 2),
        ("trainer", 0, 0),
        ("reward", 0, 0),
    ]
    # The generator replicas and the reference go round-robin from node 1, the trainer stays.
    p = plan(recipe("tiny"), 0, nodes=2)
    assert [(x.service, x.node) for x in p.placements] == [
        ("generator", 1),
        ("reference", 0),
        ("trainer", 0),
        ("reward", 0),
    ]
    p = plan(recipe("tiny", "layout.generator.replicas=3", "layout.reward.procs=2"), 0, nodes=2)
    assert [(x.service, x.node) for x in p.placements] == [
        ("generator", 1),
        ("generator", 0),
        ("generator", 1),
        ("reference", 0),
        ("trainer", 0),
        ("reward", 0),
        ("reward", 0),
    ]
    assert plan(recipe("tiny"), 0, nodes=1) == plan(recipe("tiny"), 0)
    assert "tiny on CPU, 3 nodes" in plan(recipe("tiny"), 0, nodes=3).describe()
    assert error_of(recipe("tiny"), 0, nodes=0) == "a run needs at least 1 node, got 0"


def test_gpu_plan_nodes_must_match_the_gpus():
    assert plan(recipe("qwen3-32b"), 16, nodes=2).num_nodes == 2
    assert error_of(recipe("qwen3-32b"), 16, nodes=3) == (
        "qwen3-32b on 16 GPUs uses 2 nodes of 8 GPUs, not 3: ask for 24 GPUs for 3 nodes"
    )
    assert error_of(recipe("qwen3-8b"), 5, nodes=2).startswith(
        "qwen3-8b on 5 GPUs uses 1 node of 5 GPUs, not 2"
    )


def test_to_dict_is_json_and_describe_is_a_table():
    p = plan(recipe("qwen3-8b"), 8)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["placements"][0] == {"service": "generator", "replica": 0, "node": 0, "gpus": [0, 1]}
    assert d["memory"] == p.memory and d["num_nodes"] == 1
    text = p.describe()
    assert text.splitlines()[0] == "qwen3-8b on 8 x H100 (1 node x 8 GPUs; minimum 5 GPUs)"
    assert "generator  1        0     2-3   TP2" in text
    assert "FSDP3" in text
    idle = plan(recipe("qwen3-32b"), 32)
    assert idle.to_dict()["idle_gpus"] == [[3, 4], [3, 5], [3, 6], [3, 7]]
    assert "idle       -        3     4-7" in idle.describe()


# --- invariants over many layouts --------------------------------------------------------------

layouts = st.fixed_dictionaries(
    {
        "layout.generator.tp": st.sampled_from([1, 2, 4]),
        "layout.generator.replicas": st.integers(1, 3),
        "layout.reference.enabled": st.booleans(),
        "layout.reference.gpus": st.sampled_from([1, 2, 3]),
        "layout.trainer.gpus": st.integers(1, 6),
    }
)


def layout_recipe(layout: dict):
    return recipe("qwen3-0.6b", *(f"{k}={v}" for k, v in sorted(layout.items())))


def try_plan(r, gpus, gpn):
    try:
        return plan(r, gpus, gpus_per_node=gpn)
    except UserError:
        return None


@settings(max_examples=300, deadline=None)
@given(layouts, st.integers(0, 40), st.sampled_from([2, 4, 8]))
def test_plan_invariants(layout, gpus, gpn):
    r = layout_recipe(layout)
    need = minimum_gpus(r)
    if gpus < need:
        with pytest.raises(UserError, match=f"needs at least {need} GPUs"):
            plan(r, gpus, gpus_per_node=gpn)
        return
    p = try_plan(r, gpus, gpn)
    if p is None:
        return  # uneven node split, or a TP group larger than a node: a UserError, checked above
    assert p == plan(r, gpus, gpus_per_node=gpn)  # deterministic
    assert p.num_nodes * p.gpus_per_node == gpus and p.gpus_per_node <= gpn
    assert p.num_nodes == 1 or p.gpus_per_node == gpn
    used = [(x.node, g) for x in p.placements for g in x.gpus]
    assert len(used) == len(set(used))  # no GPU given twice
    assert all(0 <= g < p.gpus_per_node and 0 <= n < p.num_nodes for n, g in used)
    assert len(used) + len(p.idle_gpus) == gpus
    assert not set(used) & set(p.idle_gpus)
    for x in p.placements:
        if x.service == "generator":
            assert len(x.gpus) == p.generator_tp
        elif x.service == "reference":
            assert len(x.gpus) == p.reference_gpus
        elif x.service == "reward":
            assert x.gpus == () and x.node == 0
    # The trainer: all its GPUs on node 0, where the controller writes the checkpoints.
    [trainer] = p.placements_of("trainer")
    assert trainer.node == 0 and len(trainer.gpus) == p.trainer_gpus
    assert (
        len(p.placements_of("generator"))
        == p.generator_replicas
        >= layout["layout.generator.replicas"]
    )
    assert p.trainer_gpus >= layout["layout.trainer.gpus"]
    # GPUs stay idle only when no generator replica (while the generator holds less than twice
    # the trainer's GPUs) and no trainer rank fits: that layout as a recipe does not plan.
    if p.idle_gpus:
        grown = dict(layout, **{"layout.trainer.gpus": p.trainer_gpus})
        grown["layout.generator.replicas"] = p.generator_replicas
        wider = dict(grown, **{"layout.trainer.gpus": p.trainer_gpus + 1})
        assert try_plan(layout_recipe(wider), gpus, gpn) is None
        if p.generator_replicas * p.generator_tp < 2 * p.trainer_gpus:
            more = dict(grown, **{"layout.generator.replicas": p.generator_replicas + 1})
            assert try_plan(layout_recipe(more), gpus, gpn) is None
    # A replica is added only while the generator holds fewer than twice the trainer's GPUs.
    assert p.generator_replicas == layout["layout.generator.replicas"] or (
        (p.generator_replicas - 1) * p.generator_tp < 2 * p.trainer_gpus
    )


def test_the_trainer_runs_on_node_0_in_every_catalog_plan():
    """Checkpoint files and their COMMITTED marker are then written on one node."""
    planned = 0
    for name in list_recipes():
        if load_recipe(name).kind == "sft":  # one node, the trainer alone (tests/test_sft.py)
            continue
        r = recipe(name)
        if r.cpu:
            plans = [plan(r, 0, nodes=n) for n in range(1, 6)]
        else:
            gpn = r.resources.gpus_per_node
            counts = [n for n in range(minimum_gpus(r), 65) if n <= gpn or n % gpn == 0]
            plans = [plan(r, n) for n in counts]  # every whole-node count plans
        for p in plans:
            assert [x.node for x in p.placements_of("trainer")] == [0], (name, p.total_gpus)
            assert [x.node for x in p.placements_of("reward")] == [0] * p.reward_procs
        planned += len(plans)
    assert planned > 50


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 40), st.integers(1, 24), st.sampled_from([2, 4, 8]))
def test_more_gpus_never_mean_fewer_generator_replicas(layout, gpus, more, gpn):
    r = layout_recipe(layout)
    small, big = try_plan(r, gpus, gpn), try_plan(r, gpus + more, gpn)
    if small is not None and big is not None:
        assert big.generator_replicas >= small.generator_replicas


# --- layout.share all: the services share every GPU -------------------------------------------------


def test_colocated_services_share_every_gpu_of_one_node():
    one = plan(recipe("qwen3-1.7b", "layout.share=all"), 1)
    assert minimum_gpus(recipe("qwen3-1.7b", "layout.share=all")) == 1
    assert {(p.service, p.gpus) for p in one.placements if p.gpus} == {
        ("generator", (0,)),
        ("reference", (0,)),
        ("trainer", (0,)),
    }
    s = one.settings
    assert s.generator.kv_cache_gb is not None and s.generator.gpu_memory_utilization == 0.05
    assert s.trainer.activation_checkpointing and s.weight_sync.expected == ("ipc",)
    assert "take turns" in one.describe()
    four = plan(recipe("qwen3-1.7b", "layout.share=all"), 4)
    assert (four.generator_replicas, four.trainer_gpus, four.idle_gpus) == (4, 4, ())
    assert [p.gpus for p in four.placements_of("generator")] == [(0,), (1,), (2,), (3,)]
    # the version is on trainer rank 0's GPU: the generator there opens it, the others get it pushed
    assert four.settings.weight_sync.expected == ("ipc", "push", "push", "push")
    # the 8B's widest service is its TP2 generator (and FSDP2 trainer), but all of it fits
    # only on 4 H100s (2 H200s)
    eight = recipe("qwen3-8b", "layout.share=all")
    assert minimum_gpus(eight) == 4 and minimum_gpus(eight, "H200") == 2
    assert error_of(eight, 1) == (
        "qwen3-8b needs at least 4 GPUs on an H100 with services sharing them (layout.share "
        "all), 5 GPUs (generator 2 = TP2×1, reference 1, trainer 2 = FSDP2) with a GPU for each "
        "service; got 1"
    )


def test_colocated_services_must_fit_a_gpu_together():
    # The layouts that do not fit say why, at the trainer's step peak on its fullest GPU:
    # sharing its GPU with the reference, a trainer rank of 4 GPUs less its generator's two
    four = plan(recipe("qwen3-8b", "layout.share=auto"), 4)
    refused = {c.share: c.refused for c in four.candidates if c.refused}
    assert refused["trainer_reference"].startswith(
        "qwen3-8b: layout.share trainer_reference: while the trainer steps, node 0 GPU 3 would "
        "hold trainer "
    )
    assert "GB, over an H100's 85.5 GB; use more GPUs" in refused["trainer_reference"]
    assert "needs at least 5 GPUs" in refused["none"]
    # a generator replica on each pair of GPUs would leave the trainer's step no room there
    # (its version buffer on rank 0 beside one of them); one replica does
    assert (four.share, four.generator_replicas, four.trainer_gpus) == ("all", 1, 4)
    assert [p.gpus for p in four.placements_of("generator")] == [(0, 1)]
    assert all(sum(g.values()) <= 85.5 for g in four.while_training_gb.values())
    message = error_of(recipe("qwen3-1.7b", "layout.share=all"), 16)
    assert "layout.share all runs on one node; use at most 8 GPUs" in message


def test_an_override_that_cannot_fit_a_shared_gpu_is_refused_with_its_arithmetic():
    # One H100 for qwen3-1.7b is a sharing plan (layout.share all) until an override leaves
    # no room: the line names both minimums and the override's memory arithmetic.
    message = error_of(recipe("qwen3-1.7b", "layout.share=auto", "generator.kv_cache_gb=200"), 1)
    assert message.startswith("qwen3-1.7b needs at least 3 GPUs"), message
    assert "generator.kv_cache_gb: 200 GB of KV cache + 3 GB of bf16 weights" in message
    big = recipe(
        "qwen3-1.7b",
        "layout.share=auto",
        "trainer.tokens_per_micro_batch=65536",
        "trainer.activation_checkpointing=false",
    )
    message = error_of(big, 1)
    assert "trainer: 65536 tokens per micro-batch without activation checkpointing need" in message
    assert "beside the 45.4 GB that the services sharing it keep there" in message
    # off-policy, the version's CUDA IPC buffer stays through the next step: counted apart
    assert "and the 3.4 GB CUDA IPC buffer of a version (held through a step)" in message
    # no more than the step the plan falls back to on a shared GPU: taken as given
    small = plan(
        recipe("qwen3-1.7b", "layout.share=auto", "trainer.tokens_per_micro_batch=4096"), 1
    )
    assert small.share == "all" and small.settings.trainer.tokens_per_micro_batch == 4096
    assert small.settings.trainer.activation_checkpointing is True


# --- layout.reference.device: cpu ----------------------------------------------------------------


def test_a_reference_on_the_cpu_takes_no_gpu():
    on_cpu = recipe("qwen3-1.7b", "layout.reference.device=cpu")
    assert minimum_gpus(on_cpu) == 2
    p = plan(on_cpu, 2)
    assert [x.gpus for x in p.placements_of("reference")] == [()]
    assert {g for x in p.placements for g in x.gpus} == {0, 1} and p.idle_gpus == ()
    assert p.reference_host_gb == pytest.approx(11, abs=1) and p.reference_step_tflop > 100
    assert "reference" not in p.memory and not p.settings.reference.compile
    assert "reference on node 0's CPU" in p.describe()
    # with extra GPUs the generator grows into what the reference would have held
    assert plan(on_cpu, 3).generator_replicas == 2
    together = plan(recipe("qwen3-1.7b", "layout.reference.device=cpu", "layout.share=all"), 1)
    assert {(x.service, x.gpus) for x in together.placements if x.service != "reward"} == {
        ("generator", (0,)),
        ("trainer", (0,)),
        ("reference", ()),
    }
    assert "reference on CPU" in error_of(on_cpu, 1)


def test_a_reference_on_the_cpu_needs_the_hosts_memory():
    from runtime.procs.cluster import Cluster, check_plan_fits

    p = plan(recipe("qwen3-1.7b", "layout.reference.device=cpu"), 2)
    check_plan_fits(p, Cluster(), available_bytes=int(64e9))
    with pytest.raises(UserError, match="needs ~11 GB of host memory and this node has 8 GB free"):
        check_plan_fits(p, Cluster(), available_bytes=int(8e9))
    gpus = "layout.reference.gpus: a reference on the CPU takes no GPU"
    with pytest.raises(UserError, match=gpus):
        recipe("qwen3-8b", "layout.reference.device=cpu", "layout.reference.gpus=2")


def test_checkpoint_writes_need_the_hosts_memory_for_their_staged_copy():
    from runtime.procs.cluster import Cluster, check_plan_fits

    p = plan(recipe("qwen3-8b"), 5)
    assert p.checkpoint_host_gb == pytest.approx(12 * p_params("qwen3-8b") / 1e9, abs=0.1)
    assert "checkpoints: each write first copies the trainer's state" in p.describe()
    check_plan_fits(p, Cluster(), available_bytes=int(200e9))
    with pytest.raises(UserError, match=r"stages the trainer's state \(~98 GB\) in host memory"):
        check_plan_fits(p, Cluster(), available_bytes=int(64e9))
    # the export at the end needs room beside the copy: the file being filled (5 GB at most)
    # and the gathered group in hand (the embedding and output projection, 2.5 GB in bf16)
    assert p.export_host_gb == pytest.approx(7.5, abs=0.1)
    with pytest.raises(
        UserError,
        match=r"the export at the end holds a file of the model there at a time \(~8 GB\)",
    ):
        check_plan_fits(p, Cluster(), available_bytes=int(101e9))
    # with a CPU reference both count
    both = plan(recipe("qwen3-1.7b", "layout.reference.device=cpu"), 2)
    need = (both.reference_host_gb + both.checkpoint_host_gb) * 1e9
    with pytest.raises(UserError, match="beside the CPU reference's"):
        check_plan_fits(both, Cluster(), available_bytes=int(need - 1e9))


def p_params(name: str) -> int:
    return load_recipe(name).arch.params


def test_launches_ask_for_gpu_counts_clouds_sell():
    from recipes import launch_gpus
    from recipes.planner import unsold_note

    counts = {
        n: launch_gpus(recipe(n)) for n in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b")
    }
    assert counts == {"qwen3-1.7b": 4, "qwen3-4b": 4, "qwen3-8b": 8, "qwen3-14b": 8}
    assert launch_gpus(recipe("qwen3-32b")) == 16 and launch_gpus(recipe("tiny")) == 0
    assert launch_gpus(recipe("qwen3-8b", "resources.gpus_per_node=4")) == 8  # two whole nodes
    # the extra GPUs get work: the 1.7B's fourth GPU is a second generator replica
    assert plan(recipe("qwen3-1.7b"), 4).generator_replicas == 2
    assert unsold_note(5, 8).startswith("note: 5 GPUs a node: VM clouds sell 1, 2, 4 or 8")
    assert unsold_note(8, 8) is None and unsold_note(16, 8) is None


def test_a_colocated_trainer_counts_the_ipc_buffer_it_holds_from_publish_to_load():
    from recipes.memory import trainer_publish_gb

    r = recipe("qwen3-8b", "layout.share=all", "resources.accelerator=H200")
    p = plan(r, 2)
    assert p.settings.weight_sync.expected == ("ipc",)
    # 12 bytes a parameter over 2 ranks, the 2-byte buffer, the embedding group in flight
    publish = trainer_publish_gb(r.arch, 2)
    assert publish == pytest.approx(12 * 8.19 / 2 + 2 * 8.19 + 5.0 + 3, abs=0.5)
    assert p.memory["trainer"] >= publish
    # a reference on one GPU keeps its embedding in fp32 (2 more bytes a vocabulary row entry)
    one = estimate_memory(r)["reference"]
    two = estimate_memory(apply_overrides(r, ["layout.reference.gpus=2"]))["reference"]
    half_the_weights = r.arch.params / 1e9
    assert one - two == pytest.approx(half_the_weights + 2 * 151936 * 4096 / 1e9, abs=0.15)


def test_a_trainer_above_its_memory_headroom_is_named():
    # qwen3-32b's 8 trainer ranks on H100s: 16 bytes a parameter sharded over 8 leave no
    # micro-batch within 90 % of the GPU; the plan says so instead of showing only the figure
    tight = plan(recipe("qwen3-32b"), 16).describe()
    assert "note: the trainer's ~84 GB a rank is above the 77 GB (90% of an H100)" in tight
    assert "resources.accelerator: H200" in tight  # its node's 8 GPUs are the trainer's already
    assert "note: the trainer" not in plan(recipe("qwen3-14b"), 8).describe()
    assert "note: the trainer" not in plan(recipe("qwen3-1.7b"), 3).describe()


def test_a_shared_gpu_that_the_kv_cache_overfills_names_the_cache_that_fits():
    # two steps a generate call on one H100: the cache for 256 sequences at once (45.5 GB)
    # would leave the trainer's step no room; planned, it is cut to the largest that leaves it
    # room (vLLM samples in waves), down to half
    two_calls = ["grpo.max_response_tokens=512", "grpo.steps_per_call=2"]
    planned = plan(recipe("qwen3-1.7b", "layout.share=auto", *two_calls), 1)
    assert planned.settings.generator.kv_cache_gb == 30
    assert "generator.kv_cache_gb" in planned.settings.planned
    assert sum(planned.while_training_gb["node 0 GPU 0"].values()) <= 85.5
    assert (
        "note: the generator's KV cache is 30 GB, cut from the 45.5 GB that holds a generate "
        "call's 256 sequences a replica at once" in planned.describe()
    )
    # set by the recipe, it is kept and refused: the line names the largest that fits, and
    # that one is accepted
    line = error_of(
        recipe("qwen3-1.7b", "layout.share=auto", *two_calls, "generator.kv_cache_gb=45.5"), 1
    )
    assert "or a KV cache of at most 30 GB (--set generator.kv_cache_gb=30; set to 45.5 GB" in line
    fits = plan(
        recipe("qwen3-1.7b", "layout.share=auto", *two_calls, "generator.kv_cache_gb=30"), 1
    )
    assert fits.settings.generator.kv_cache_gb == 30
    # where the cache is not the problem (nothing smaller would do), no such advice
    assert "KV cache of at most" not in error_of(recipe("qwen3-8b", "layout.share=auto"), 3)


def test_a_shared_kv_cache_too_small_for_every_lanes_episodes_is_noted():
    # qwen3-1.7b-tools on one H100: the cache is sized (and cut) for one call's 128 episodes;
    # its two lanes keep 256 open, so one lane's prefixes may be evicted by the other's
    tools = recipe("qwen3-1.7b-tools", "layout.share=auto")
    shared = plan(tools, 1)
    kv = shared.settings.generator.kv_cache_gb
    held = math.floor(kv / kv_gb(tools, 1))
    assert held < 256
    assert (
        "note: env.batches_in_flight 2 keeps 256 episodes open a replica, and its KV cache "
        f"holds ~{held} at the longest" in shared.describe()
    )
    # one lane, or a generator with a GPU of its own (vLLM's share of the GPU, no sized
    # cache): nothing to say
    one_lane = plan(recipe("qwen3-1.7b-tools", "layout.share=auto", "env.batches_in_flight=1"), 1)
    assert "episodes open a replica" not in one_lane.describe()
    assert "episodes open a replica" not in plan(tools, 2).describe()


def _gb(x: float) -> float:
    return round(x / GB, 1)


def test_the_plan_says_what_the_trainers_gpus_hold_while_it_steps():
    # GB/GPU is what each service holds between steps; the trainer's step adds its activations
    # (tens of GB), and rank 0 keeps a version's buffer where it outlives the publish. The plan
    # prints the fullest of the trainer's GPUs with them.
    from recipes.memory import trainer_step_bytes

    def step(p):
        t = p.settings.trainer
        arch = load_recipe(p.recipe_name).arch
        return trainer_step_bytes(
            arch, t.ranks, t.tokens_per_micro_batch, t.activation_checkpointing, t.compile
        )

    params = load_recipe("qwen3-1.7b").arch.params
    # on-policy on two GPUs: every service shares both, a generator on each GPU, the reference
    # on GPU 1; versions by CUDA IPC to the generator on rank 0's GPU and pushed to the other
    # from the ipc path's buffer: nothing outlives a publish
    on = plan(recipe("qwen3-1.7b", "layout.share=all", "grpo.max_policy_age=0"), 2)
    assert on.settings.weight_sync.expected == ("ipc", "push")
    assert on.while_training_gb == {
        "node 0 GPU 0": {
            "trainer": _gb(step(on)),
            "generator": on.memory["generator"],
        },
        "node 0 GPU 1": {
            "trainer": _gb(step(on)),
            "generator": on.memory["generator"],
            "reference": on.memory["reference"],
        },
    }
    total = sum(on.while_training_gb["node 0 GPU 1"].values())
    assert f"while the trainer steps: ~{total:.1f} GB on node 0 GPU 1 (trainer" in on.describe()
    # one step off-policy by CUDA IPC on one GPU: rank 0 holds the version's bf16 buffer
    # through the next step
    one = plan(recipe("qwen3-1.7b", "layout.share=all"), 1)
    assert one.while_training_gb["node 0 GPU 0"]["trainer"] == _gb(step(one) + 2 * params)
    # the generator on a GPU of its own: the trainer's GPUs only, with the push path's buffer
    off = plan(recipe("qwen3-1.7b", "layout.share=trainer_reference"), 2)
    assert off.settings.weight_sync.expected == ("push",)
    assert off.while_training_gb == {
        "node 0 GPU 1": {
            "trainer": _gb(step(off) + 2 * params),
            "reference": off.memory["reference"],
        }
    }
    # a rank's activations are counted: the step is above the between-steps figure
    assert off.while_training_gb["node 0 GPU 1"]["trainer"] > off.memory["trainer"]
    assert json.loads(json.dumps(off.to_dict()))["while_training_gb"] == off.while_training_gb


def test_a_spread_reference_is_weighed_where_services_share_gpus():
    # On-policy on two GPUs every service takes its turn; the reference on GPU 1 alone scores
    # both generators' halves one after the other there (2 x 0.35 s a step on two H100s). With
    # layout.reference.spread the planner also weighs it sharded over both GPUs, its rows split.
    base = ("layout.share=auto", "grpo.max_policy_age=0")
    kept = plan(recipe("qwen3-1.7b", *base), 2)
    spread = plan(recipe("qwen3-1.7b", *base, "layout.reference.spread=true"), 2)
    (ref,) = kept.placements_of("reference")
    assert ref.gpus == (1,) and kept.settings.reference.ranks == 1
    assert [c.layout for c in kept.candidates if c.share == "all"] == [
        "generator0 0, generator1 1, reference 1, trainer 0-1"
    ]
    (ref,) = spread.placements_of("reference")
    assert spread.share == "all" and ref.gpus == (0, 1)
    assert spread.settings.reference.ranks == 2 and spread.reference_gpus == 2
    assert spread.memory["reference"] < kept.memory["reference"]  # half the weights a GPU
    assert spread.predicted_step_s < kept.predicted_step_s
    weighed = {c.layout: c for c in spread.candidates if c.share == "all"}
    assert weighed["generator0 0, generator1 1, reference 0-1, trainer 0-1"].chosen
    assert not weighed["generator0 0, generator1 1, reference 1, trainer 0-1"].chosen
    # a reference.ranks the recipe sets stays; one GPU has nothing to spread over
    ranked = plan(
        recipe("qwen3-1.7b", *base, "layout.reference.spread=true", "reference.ranks=1"), 2
    )
    assert ranked.placements_of("reference")[0].gpus == (1,)
    one = plan(recipe("qwen3-1.7b", *base, "layout.reference.spread=true"), 1)
    assert one.placements_of("reference")[0].gpus == (0,)
    # with GPUs of their own (layout.share none) the reference keeps layout.reference.gpus
    own = plan(recipe("qwen3-1.7b", "layout.reference.spread=true"), 3)
    assert own.share == "none" and len(own.placements_of("reference")[0].gpus) == 1


def test_a_spread_reference_leaves_the_count_with_gpus_of_their_own_as_the_recipe_has_it():
    # the spread reference is planned on a copy of the recipe with the reference over both
    # GPUs; "N with GPUs of their own" is the recipe's own layout: 1 + 1 + 1 GPUs
    spread = plan(
        recipe(
            "qwen3-1.7b",
            "layout.share=auto",
            "grpo.max_policy_age=0",
            "layout.reference.spread=true",
        ),
        2,
    )
    assert spread.placements_of("reference")[0].gpus == (0, 1)
    assert spread.dedicated_gpus == 3
    assert "minimum 1 GPU with services sharing, 3 with GPUs of their own" in spread.describe()


@pytest.mark.parametrize("accelerator", ["H100", "H200"])
def test_no_accepted_plan_puts_more_on_a_gpu_while_the_trainer_steps_than_the_gpu_has(accelerator):
    # every catalog recipe, both policy modes, one to eight GPUs: what `plan` accepts fits each
    # of the trainer's GPUs at its step peak (the trainer's step at its planned micro-batch,
    # rank 0's version buffer, whatever shares the GPU), as `plan` prints it
    from recipes.memory import ACCELERATOR_GB

    accepted = 0
    for name in list_recipes():
        if load_recipe(name).kind == "sft":  # no generator, no grpo section
            continue
        for age in (0, 1):
            try:
                r = recipe(
                    name, "layout.share=auto", f"grpo.max_policy_age={age}",
                    f"resources.accelerator={accelerator}",
                )  # fmt: skip
            except UserError:  # tiny-lora on a GPU: vLLM serves no LoRA for its 14-token model
                assert name == "tiny-lora"
                continue
            if r.cpu:
                continue
            for gpus in (1, 2, 3, 4, 5, 8):
                try:
                    p = plan(r, gpus)
                except UserError:
                    continue
                accepted += 1
                for where, parts in p.while_training_gb.items():
                    assert sum(parts.values()) <= ACCELERATOR_GB[accelerator], (name, gpus, where)
    assert accepted > 50


def test_node_0s_host_memory_holds_the_checkpoint_copy_and_the_processes():
    from recipes.memory import BASE_HOST_GB, CHECKPOINT_BYTES_PER_PARAM, PROCESS_HOST_GB

    p = plan(recipe("qwen3-32b", "layout.share=auto"), 16)
    copy = CHECKPOINT_BYTES_PER_PARAM * load_recipe("qwen3-32b").arch.params / GB
    assert p.host["checkpoint copy"] == round(copy, 1)  # 393.6 GB, pinned
    assert p.host["processes"] == BASE_HOST_GB + 8 * PROCESS_HOST_GB  # node 0's 8 GPUs
    assert p.host["total"] % 16 == 0 and p.host["total"] >= copy + 80
    assert f"host memory: {p.host['total']:.0f} GB on node 0" in p.describe()
    assert plan(recipe("tiny"), 0).host == {}  # a CPU run: its own processes only


def test_a_tight_trainer_note_offers_only_what_can_be_done():
    # qwen3-32b on two nodes of H100s: the trainer already has every GPU of node 0 (it runs
    # there alone), so only a larger GPU holds less a rank
    p = plan(load_recipe("qwen3-32b"), 16)
    assert p.trainer_gpus == p.gpus_per_node == 8
    (note,) = p._tight_trainer()
    assert "resources.accelerator: H200" in note and "layout.trainer.gpus" not in note
    # a trainer on part of its node hears of both
    fewer = dataclasses.replace(p, trainer_gpus=4)
    (note,) = fewer._tight_trainer()
    assert "layout.trainer.gpus" in note and "H200" in note
    assert plan(load_recipe("qwen3-32b"), 16, accelerator="H200")._tight_trainer() == []


def test_a_run_says_where_its_own_lengths_make_another_layout_faster():
    """Plans rank layouts at the recipe's maximum lengths; a run, at its own mean lengths,
    says in one line where another layout.share is predicted at least 10 % faster."""
    from recipes.planner import layout_hint

    r = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_response_tokens=512"])
    chosen = plan(r, 2, accelerator="H200")
    assert chosen.share == "all"  # at 1024-token prompts
    assert layout_hint(r, chosen, 207, 512) == (
        "at this run's mean lengths (207-token prompts, 512-token completions) layout.share "
        "trainer_reference is predicted at 2.93 s a step, this plan (all) at 3.50 s; the plan "
        "ranked layouts at the recipe's maximum lengths (1024 + 512): --set "
        "layout.share=trainer_reference takes it, or --set dataset.prompt_tokens_mean=207 "
        "lets the plan weigh them at this run's prompts"
    )
    # at the maxima the plan's own choice stands
    assert layout_hint(r, chosen, 1024, 512) is None
    # a layout.share the recipe sets is kept without a word, and a CPU run has one layout
    fixed = apply_overrides(r, ["layout.share=all"])
    assert layout_hint(fixed, plan(fixed, 2, accelerator="H200"), 207, 512) is None
    tiny = load_recipe("tiny")
    assert layout_hint(tiny, plan(tiny, 0), 20, 10) is None


def test_plans_rank_layouts_at_the_prompt_length_the_dataset_states():
    """dataset.prompt_tokens_mean: layouts are weighed at it instead of grpo.max_prompt_tokens
    (memory is still planned for the longest prompt). qwen3-1.7b on two H200s one step
    off-policy, 512-token completions: at 1024-token prompts `all` comes first, at 207 the
    generator on a GPU of its own (measured on one host of two H200s at 207: 3.16 s a step
    against `all`'s 4.10 s, bench/results/gpu_h200x2_2026-11-27h)."""
    base = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_response_tokens=512"])
    from recipes.planner import layout_hint

    at_max = plan(base, 2, accelerator="H200")
    stated = apply_overrides(base, ["dataset.prompt_tokens_mean=207"])
    at_mean = plan(stated, 2, accelerator="H200")
    assert (at_max.share, at_mean.share) == ("all", "trainer_reference")
    assert at_mean.predicted_step_s == 2.93
    fixed = apply_overrides(base, ["layout.share=trainer_reference"])
    assert at_mean.memory == plan(fixed, 2, accelerator="H200").memory
    words = "at 207-token prompts (dataset.prompt_tokens_mean) and 512-token completions"
    assert words in at_mean.describe() and words in at_mean.explain()
    assert "at the recipe's maximum lengths (1024 + 512)" in at_max.describe()
    # a run at the lengths its plan was ranked at has nothing to add
    assert layout_hint(stated, at_mean, 207, 512) is None
    with pytest.raises(UserError, match="dataset.prompt_tokens_mean: 2000 exceeds grpo.max_prompt"):
        apply_overrides(base, ["dataset.prompt_tokens_mean=2000"])
    with pytest.raises(UserError, match="dataset.prompt_tokens_mean"):
        apply_overrides(base, ["dataset.prompt_tokens_mean=0"])


def test_a_plan_ranked_at_the_longest_prompt_says_where_shorter_ones_change_its_choice():
    """Without dataset.prompt_tokens_mean the plan ranks at grpo.max_prompt_tokens; where
    shorter prompts would put another layout first by 10 % or more, it says below which mean
    length, and the setting that ranks there (one line, in what `plan` prints)."""
    base = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_response_tokens=512"])
    two = plan(base, 2, accelerator="H200")
    assert two.share == "all"
    assert two.shorter_prompts.startswith(
        "prompts averaging 320 tokens or fewer put layout.share trainer_reference first by 10 % "
        "or more (3.39 s a step against 3.78 at 320): --set dataset.prompt_tokens_mean=N"
    )
    assert two.shorter_prompts in two.describe()
    # with that mean stated, the plan takes it, and has nothing more to say
    stated = plan(apply_overrides(base, ["dataset.prompt_tokens_mean=320"]), 2, accelerator="H200")
    assert (stated.share, stated.shorter_prompts) == ("trainer_reference", "")
    # one layout that fits (one GPU), or a layout the recipe fixes: nothing to say
    assert plan(base, 1, accelerator="H200").shorter_prompts == ""
    fixed = apply_overrides(base, ["layout.share=all"])
    assert plan(fixed, 2, accelerator="H200").shorter_prompts == ""


# --- LoRA: the reference in the trainer, the adapter as a version ---------------------------------


def test_qwen3_8b_lora_on_one_gpu_has_no_reference_placement_and_says_what_trains():
    p = plan(load_recipe("qwen3-8b-lora"), 1)
    assert (p.minimum_gpus, p.dedicated_gpus, p.share) == (1, 2, "all")
    assert {x.service for x in p.placements} == {"generator", "trainer", "reward"}
    assert p.reference_in_trainer and p.reference_enabled and "reference" not in p.memory
    text = p.describe()
    assert (
        "LoRA rank 16, alpha 32 on all-linear (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj): 43.6 M trainable (0.533 % of "
        "8.19 B), the base frozen; reference: the base with the adapter off, scored in the "
        "trainer's processes (no GPU and no copy of the model of its own)"
    ) in text
    assert text.splitlines().index(p.lora) == len(p.placements) + 2  # right under the table
    s = p.settings
    assert (s.generator.max_lora_rank, s.generator.max_loras) == (16, 2)
    assert "max_lora_rank 16, max_loras 2" in text
    # the reference scores on the trainer's ranks, with its micro-batch and compile
    assert (s.reference.ranks, s.reference.tokens_per_micro_batch, s.reference.compile) == (
        s.trainer.ranks,
        s.trainer.tokens_per_micro_batch,
        s.trainer.compile,
    )
    assert "(in the trainer's processes: its ranks, micro-batch and compile)" in text
    # the shared H100: the generator's weights, KV cache and adapter slots beside a trainer of
    # a bf16 base, recomputing its layers
    assert s.trainer.activation_checkpointing
    assert sum(p.while_training_gb["node 0 GPU 0"].values()) <= 85.5
    d = json.loads(json.dumps(p.to_dict()))
    assert d["reference_in_trainer"] is True and d["lora"] == p.lora
    assert d["settings"]["generator"]["max_lora_rank"] == 16


def test_a_full_plan_has_no_lora_keys():
    p = plan(load_recipe("qwen3-8b"), 8)
    d = p.to_dict()
    assert "lora" not in d and "reference_in_trainer" not in d
    assert "max_lora_rank" not in d["settings"]["generator"]
    assert "LoRA" not in p.describe() and "max_lora" not in p.describe()


def test_a_lora_version_is_the_adapter_on_every_path():
    r = load_recipe("qwen3-8b-lora")
    adapter = 2 * adapter_params(r.arch, r.model.lora)
    own = plan(r, 2, accelerator="H100")  # apart: the push path
    if own.share != "none":
        own = plan(apply_overrides(r, ["layout.share=none"]), 2)
    assert own.settings.weight_sync.expected == ("push",)
    assert own.settings.weight_sync.push_buffer == "version"  # tens of MB go whole
    shared = plan(r, 1)
    assert shared.settings.weight_sync.expected == ("ipc",)
    # trainer rank 0 holds a version's buffer: the adapter's bytes, not the model's
    ranks = own.trainer_gpus
    t = own.settings.trainer
    step = trainer_step_bytes(
        r.arch, ranks, t.tokens_per_micro_batch, t.activation_checkpointing, t.compile, r.model.lora
    )
    assert own.while_training_gb["node 0 GPU 1"]["trainer"] == round((step + adapter) / GB, 1)


def test_the_lora_line_names_the_targets_as_model_lora_targets_takes_them():
    listed = plan(
        apply_overrides(load_recipe("tiny-lora"), ["model.lora.targets=[v_proj,q_proj]"]), 0
    )
    assert " on q_proj, v_proj: " in listed.lora
    # what the line shows can be set back: the same adapter, the same count
    again = apply_overrides(load_recipe("tiny-lora"), ["model.lora.targets=[q_proj,v_proj]"])
    assert plan(again, 0).lora == listed.lora


def test_the_cpu_lora_plan_runs_no_reference_process():
    p = plan(load_recipe("tiny-lora"), 0)
    assert {x.service for x in p.placements} == {"generator", "trainer", "reward"}
    assert p.reference_in_trainer and p.lora.startswith(
        "LoRA rank 16, alpha 32 on all-linear (q_proj"
    )
    assert p.settings.generator.max_lora_rank is None  # transformers' generate merges it
    assert "max_lora" not in p.describe()
    assert p.settings.reference.ranks == p.settings.trainer.ranks


def test_a_lora_step_is_predicted_with_the_measured_factors():
    r = load_recipe("qwen3-8b-lora")
    # the same run training every parameter, predicted on the same placements
    full = apply_overrides(
        r, ["model.lora=null", "layout.reference.enabled=false", "layout.trainer.gpus=2"]
    )
    p = plan(apply_overrides(r, ["layout.share=none"]), 2)
    paths = p.settings.weight_sync.expected
    ckpt = p.settings.trainer.activation_checkpointing
    lora = predict_step(r, "H100", p.placements, trainer_checkpointing=ckpt, transports=paths)
    plain = predict_step(full, "H100", p.placements, trainer_checkpointing=ckpt, transports=paths)
    factors = MEASURED["lora"]  # a qwen3-8b-lora run against qwen3-8b's speeds
    assert 0 < factors["generate_share"] < 1 and 0 < factors["train_time_share"] < 1
    assert lora.work["train"] == pytest.approx(plain.work["train"] * factors["train_time_share"])
    assert lora.work["generate"] == pytest.approx(
        plain.work["generate"] / factors["generate_share"]
    )
    adapter_gb = 2 * adapter_params(r.arch, r.model.lora) / 1e9
    assert lora.work["sync"] == pytest.approx(
        adapter_gb * MEASURED["sync"]["push"]["s_per_gb"] + factors["load_s"]
    )
    assert lora.work["sync"] < plain.work["sync"] / 4  # 87 MB against 16.4 GB, plus the load
    # the reference is the trainer's work, on the trainer's GPU, in its turn
    assert lora.work["reference"] > 0 and plain.work["reference"] == 0
    assert lora.busy["trainer"] == pytest.approx(
        lora.work["train"] + lora.work["sync"] + lora.work["reference"]
    )


def test_too_few_gpus_for_a_lora_recipe_names_the_reference_in_the_trainer():
    message = error_of(load_recipe("qwen3-32b-lora"), 3)
    assert message.startswith(
        "qwen3-32b-lora needs at least 4 GPUs (generator 2 = TP2×1, reference in trainer, "
        "trainer 2 = FSDP2), also with services sharing GPUs on an H100; got 3"
    )
    assert plan(load_recipe("qwen3-32b-lora"), 2, accelerator="H200").share == "all"
