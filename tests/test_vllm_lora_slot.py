"""A LoRA version written into its adapter's GPU slot (runtime.backends.vllm_lora_slot) against
what vLLM's own build and activation put there, on real tensors in vLLM's stacked layout.

vLLM is not installed on a CPU; its LoRA layers and model manager are stood in for below, as far
as a slot goes, after vLLM 0.24's code: the layers' stacked tensors, `set_lora` and `reset_lora`
(vllm/lora/layers/base_linear.py, column_parallel_linear.py), the build of a version
(`LoRAModel.from_lora_tensors`: each matrix cast to the LoRA dtype; `_create_merged_loras_inplace`
and `PackedLoRALayerWeights.pack`: a packed module's parts gathered in its order;
`LoRALayerWeights.optimize`: B multiplied by the scale in place, in that dtype), the scale
(`PEFTHelper`: alpha / r), the parsing of PEFT names (`parse_fine_tuned_lora_name`) and
`activate_adapter`. tests/test_gpu_lora.py checks the same against vLLM itself on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_models import QWEN
from test_peft_format import random_adapter

from recipes.run_sections import Lora
from runtime.backends.vllm_lora import LoraSlots
from runtime.backends.vllm_lora_slot import InPlace, NotInPlace, plan_slot
from runtime.models.peft_format import adapter_config

LORA = Lora(rank=8, alpha=12)  # a scale of 1.5: bf16(bf16(B) * 1.5) is not bf16(B * 1.5)
MAX_RANK = 16  # past the rank: the slot's padding must stay zero


# --- vLLM's side, stood in for


class _Linear:
    """A vLLM LoRA linear layer with TP=1: per slice, A's stacked as (max_loras, 1, max_rank,
    in) and B's as (max_loras, 1, out, max_rank); set_lora zeroes the slot, then copies each
    slice's A and B into its top-left corner."""

    tp_size = 1

    def __init__(self, slices, max_loras=2, max_rank=MAX_RANK, dtype=torch.bfloat16):
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, max_rank, inp, dtype=dtype) for _, inp in slices
        )
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, 1, out, max_rank, dtype=dtype) for out, _ in slices
        )

    def reset_lora(self, index):
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked, strict=True):
            a[index] = 0
            b[index] = 0

    def set_lora(self, index, lora_a, lora_b):
        self.reset_lora(index)
        if not isinstance(lora_a, list):
            lora_a, lora_b = [lora_a], [lora_b]
        for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if a is not None:
                self.lora_a_stacked[i][index, 0, : a.shape[0], : a.shape[1]].copy_(a)
            if b is not None:
                self.lora_b_stacked[i][index, 0, : b.shape[0], : b.shape[1]].copy_(b)


class MergedQKVParallelLinearWithLoRA(_Linear):
    pass


class MergedColumnParallelLinearWithLoRA(_Linear):
    pass


class RowParallelLinearWithLoRA(_Linear):
    pass


class RowParallelLinearWithShardedLoRA(_Linear):  # slices B in its set_lora
    pass


class LogitsProcessorWithLoRA:
    """The output head's LoRA layer: no adapter of ours touches it."""

    def reset_lora(self, index):
        pass


class Weights:
    """vLLM's LoRALayerWeights (a tensor each) or PackedLoRALayerWeights (a list each)."""

    def __init__(self, lora_a, lora_b):
        self.lora_a, self.lora_b = lora_a, lora_b


def parse(name):
    """vLLM's parse_fine_tuned_lora_name for a PEFT name without a weights mapper."""
    module, side = name.removeprefix("base_model.model.").rsplit(".", 2)[:2]
    return module, side == "lora_A"


class FakeVLLM:
    """vLLM's LoRA model manager for a Qwen3 model, as far as its slots go."""

    def __init__(self, spec=QWEN, dtype=torch.bfloat16):
        q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
        d, f = spec.dim, spec.ffn_dim
        self.dtype = dtype
        self.modules, self.packed_modules = {}, {}
        for i in range(spec.n_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            self.modules[f"{attn}.qkv_proj"] = MergedQKVParallelLinearWithLoRA(
                [(q, d), (kv, d), (kv, d)], dtype=dtype
            )
            self.packed_modules[f"{attn}.qkv_proj"] = [
                f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")
            ]
            self.modules[f"{attn}.o_proj"] = RowParallelLinearWithLoRA([(d, q)], dtype=dtype)
            self.modules[f"{mlp}.gate_up_proj"] = MergedColumnParallelLinearWithLoRA(
                [(f, d), (f, d)], dtype=dtype
            )
            self.packed_modules[f"{mlp}.gate_up_proj"] = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            self.modules[f"{mlp}.down_proj"] = RowParallelLinearWithLoRA([(d, f)], dtype=dtype)
        self.modules["lm_head"] = LogitsProcessorWithLoRA()
        self.lora_index_to_id = [None, None]
        self.registered = {}

    def build(self, tensors, config):
        """What vLLM's build registers of a version."""
        scale = config["lora_alpha"] / config["r"]
        by_module = {}
        for name, tensor in tensors.items():
            module, is_a = parse(name)
            by_module.setdefault(module, [None, None])[0 if is_a else 1] = tensor.to(self.dtype)
        loras = {}
        for layer, parts in self.packed_modules.items():
            found = [by_module.pop(p, None) for p in parts]
            if any(found):
                loras[layer] = Weights([p and p[0] for p in found], [p and p[1] for p in found])
        for module, (a, b) in by_module.items():
            loras[module] = Weights(a, b)
        for w in loras.values():
            for b in w.lora_b if isinstance(w.lora_b, list) else [w.lora_b]:
                if b is not None and scale != 1:
                    b *= scale
        return loras

    def add_and_activate(self, lora_id, tensors, config):
        self.registered[lora_id] = self.build(tensors, config)
        slot = self.lora_index_to_id.index(None)
        self.lora_index_to_id[slot] = lora_id
        for name, layer in self.modules.items():
            weights = self.registered[lora_id].get(name)
            if weights is None:
                layer.reset_lora(slot)
            else:
                layer.set_lora(slot, weights.lora_a, weights.lora_b)

    def plan(self, lora_id, tensors, config):
        return plan_slot(
            lora_id=lora_id,
            slot=self.lora_index_to_id.index(lora_id),
            layers=self.modules,
            packed=self.packed_modules,
            adapter=self.registered[lora_id],
            where={name: parse(name) for name in tensors},
            tensors=tensors,
            scale=config["lora_alpha"] / config["r"],
            config=config,
        )

    def stacked(self):
        """Every slot of every layer, by layer and slice."""
        out = {}
        for name, layer in self.modules.items():
            for side in "ab":
                for i, t in enumerate(getattr(layer, f"lora_{side}_stacked", ())):
                    out[f"{name}.{side}{i}"] = t.clone()
        return out

    def registered_tensors(self, lora_id):
        out = {}
        for name, w in self.registered[lora_id].items():
            for side, held in (("a", w.lora_a), ("b", w.lora_b)):
                for i, t in enumerate(held if isinstance(held, list) else [held]):
                    if t is not None:
                        out[f"{name}.{side}{i}"] = t.clone()
        return out


def engine_with(lora_id, tensors, lora=LORA, other=True):
    """An engine whose slot 0 holds another adapter (so ours is in slot 1) and whose next slot
    holds `tensors` as vLLM activated them, under `lora_id`."""
    engine = FakeVLLM()
    if other:
        engine.add_and_activate(99, random_adapter(QWEN, lora, seed=99), adapter_config(lora, None))
    engine.add_and_activate(lora_id, tensors, adapter_config(lora, None))
    return engine


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    differ = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not differ, differ[:4]


# --- the plan and the write


@pytest.mark.parametrize(
    ("lora", "source_dtype"),
    [
        (LORA, torch.float32),
        (LORA, torch.bfloat16),
        (Lora(rank=16, alpha=32), torch.float32),  # the 8B recipe's: scale 2, no padding
        (Lora(rank=8, alpha=8, targets=["q_proj", "v_proj", "up_proj"]), torch.float32),
    ],
    ids=["fp32-scale-1.5", "bf16", "rank16-scale2", "some-parts-scale1"],
)
def test_a_version_in_place_is_what_vllms_own_activation_puts_in_the_slot(lora, source_dtype):
    config = adapter_config(lora, None)
    v0, v1 = (
        {k: t.to(source_dtype) for k, t in random_adapter(QWEN, lora, seed=s).items()}
        for s in (0, 1)
    )
    engine = engine_with(1, v0, lora)
    after_v0 = engine.stacked()
    plan = engine.plan(1, v1, config)
    assert plan.slot == 1 and len(plan.names) == len(v1)
    sent = {k: t.clone() for k, t in v1.items()}
    plan.write(v1)
    assert_same(v1, sent)  # what was handed over is untouched
    # vLLM's build and activation of v1 into the same slot of an engine that never held v0
    # (given a copy: its build scales a bf16 B in the tensor it is handed)
    twin = engine_with(1, {k: t.clone() for k, t in v1.items()}, lora)
    assert_same(engine.stacked(), twin.stacked())
    # the registered adapter is v1 as vLLM built it: activated anew, it gives the same slot
    assert_same(engine.registered_tensors(1), twin.registered_tensors(1))
    now = engine.stacked()
    assert all(torch.equal(now[k][0], after_v0[k][0]) for k in now)  # the other slot untouched
    assert any(not torch.equal(now[k][1], after_v0[k][1]) for k in now)


def test_each_part_of_a_packed_module_lands_in_its_slice_b_scaled_after_the_cast():
    v0, v1 = (random_adapter(QWEN, LORA, seed=s) for s in (0, 1))
    engine = engine_with(1, v0, other=False)
    engine.plan(1, v1, adapter_config(LORA, None)).write(v1)
    qkv = engine.modules["model.layers.1.self_attn.qkv_proj"]
    gate_up = engine.modules["model.layers.0.mlp.gate_up_proj"]
    key = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
    for layer, block, part, s in [
        (qkv, 1, "self_attn.k_proj", 1),
        (qkv, 1, "self_attn.v_proj", 2),
        (gate_up, 0, "mlp.up_proj", 1),
    ]:
        mod, proj = part.split(".")
        a, b = (v1[key.format(block, mod, proj, side)] for side in "AB")
        rank = a.shape[0]
        assert torch.equal(layer.lora_a_stacked[s][0, 0, :rank], a.to(torch.bfloat16))
        expected_b = b.to(torch.bfloat16) * 1.5  # cast, then scaled in bf16, as vLLM's build
        assert torch.equal(layer.lora_b_stacked[s][0, 0, :, :rank], expected_b)
        assert not torch.equal(expected_b, (b * 1.5).to(torch.bfloat16))  # the order shows
        assert not layer.lora_a_stacked[s][0, 0, rank:].any()  # padding past the rank
        assert not layer.lora_b_stacked[s][0, 0, :, rank:].any()


def _refused(engine, lora_id, tensors, match):
    before = engine.stacked()
    with pytest.raises(NotInPlace, match=match):
        engine.plan(lora_id, tensors, adapter_config(LORA, None)).write(tensors)
    assert_same(engine.stacked(), before)  # nothing written


def test_what_the_slot_cannot_take_as_vllm_would_is_refused_before_anything_is_written():
    v0 = random_adapter(QWEN, LORA, seed=0)
    engine = engine_with(1, v0)
    # another rank than the adapter in the slot: its padding would keep the old ranks
    wider = random_adapter(QWEN, Lora(rank=16, alpha=24), seed=1)
    _refused(engine, 1, wider, r"has shape \(16, 64\), the adapter in the slot \(8, 64\)")
    # fewer matrices than the adapter in the slot: the ones left out would keep the old version
    fewer = dict(list(v0.items())[:-2])
    _refused(engine, 1, fewer, "the adapter in the slot has 28 matrices, the version 26")
    # no adapter of that id in a slot is the caller's to know; a layer whose set_lora slices
    engine.modules["model.layers.0.self_attn.o_proj"] = RowParallelLinearWithShardedLoRA(
        [(QWEN.dim, QWEN.n_heads * QWEN.head_dim)]
    )
    _refused(engine, 1, v0, "o_proj is vLLM's RowParallelLinearWithShardedLoRA")
    engine = engine_with(1, v0)
    engine.modules["model.layers.1.mlp.down_proj"].tp_size = 2
    _refused(engine, 1, v0, "down_proj is split over 2 GPUs")


def test_a_layer_that_does_not_fit_the_version_is_refused():
    v0 = random_adapter(QWEN, LORA, seed=0)
    engine = engine_with(1, v0)
    qkv = engine.modules["model.layers.0.self_attn.qkv_proj"]
    qkv.lora_a_stacked = (
        qkv.lora_a_stacked[0],
        qkv.lora_a_stacked[1][..., :-8],
        qkv.lora_a_stacked[2],
    )
    _refused(engine, 1, v0, r"k_proj.lora_A.weight of shape \(8, 64\) does not fill slice 1")
    engine = engine_with(1, v0)
    gate_up = engine.modules["model.layers.0.mlp.gate_up_proj"]
    gate_up.lora_a_stacked = gate_up.lora_a_stacked[:1]
    _refused(engine, 1, v0, "gate_up_proj has 1 slices for 2 projections")


def test_a_version_unlike_the_plan_is_refused_at_the_write():
    v0, v1 = (random_adapter(QWEN, LORA, seed=s) for s in (0, 1))
    engine = engine_with(1, v0)
    plan = engine.plan(1, v0, adapter_config(LORA, None))
    before = engine.stacked()
    name = next(iter(v1))
    for odd in (
        {k: v for k, v in v1.items() if k != name},
        {**v1, name: v1[name][:, :-1]},
    ):
        with pytest.raises(NotInPlace):
            plan.write(odd)
        assert_same(engine.stacked(), before)


# --- what the generator calls


def test_in_place_plans_once_per_adapter_and_says_once_why_it_cannot():
    v0, v1, v2 = (random_adapter(QWEN, LORA, seed=s) for s in range(3))
    engine = engine_with(1, v0)
    lines = []
    plans = []

    def plan(lora_id, tensors, config):
        plans.append(lora_id)
        return engine.plan(lora_id, tensors, config)

    in_place = InPlace(plan, say=lines.append)
    config = adapter_config(LORA, None)
    assert set(in_place(1, v1, config)) == {"plan_s", "write_s"}
    assert set(in_place(1, v2, config)) == {"write_s"} and plans == [1]
    wider = random_adapter(QWEN, Lora(rank=16, alpha=24), seed=3)
    assert in_place(1, wider, config) is None and in_place(1, wider, config) is None
    assert len(lines) == 1 and "add and activate, not in place: " in lines[0]
    assert "has shape (16, 64), the adapter in the slot (8, 64)" in lines[0]
    twin = engine_with(1, v2)
    assert_same(engine.stacked(), twin.stacked())  # the refused version wrote nothing


def test_a_plan_that_cannot_read_vllm_falls_back_with_the_reason():
    """vLLM's LoRA manager is read through private parts: where a vLLM release moved them, the
    versions go in the ordinary way."""
    lines = []

    def plan(lora_id, tensors, config):
        raise AttributeError("'LRUCacheLoRAModelManager' object has no attribute 'modules'")

    in_place = InPlace(plan, say=lines.append)
    v1 = random_adapter(QWEN, LORA, seed=1)
    assert in_place(1, v1, adapter_config(LORA, None)) is None
    assert len(lines) == 1 and "has no attribute 'modules'" in lines[0]


class Engine:
    """What LoraSlots uses of vLLM's LLMEngine."""

    def __init__(self):
        self.removed = []

    def remove_lora(self, lora_id):
        self.removed.append(lora_id)
        return True


def test_slots_keep_the_adapters_id_for_a_version_in_place_under_a_new_name(tmp_path):
    """The name is what vLLM's prefix cache keys on (new each version); the id what its slots
    and registered adapters go by (kept while versions go in place)."""
    engine, handed, answers = Engine(), [], [{"write_s": 0.001}, None]

    def from_memory(lora_id, tensors, config):
        handed.append(("add", lora_id))
        return {"build_s": 0.01, "activate_s": 0.02}

    def in_place(lora_id, tensors, config):
        handed.append(("in place", lora_id))
        return answers.pop(0)

    slots = LoraSlots(
        engine,
        LORA,
        root=tmp_path / "lora",
        request_type=lambda *args: args,
        from_memory=from_memory,
        in_place=in_place,
    )
    versions = [random_adapter(QWEN, LORA, seed=s) for s in range(3)]
    assert slots.load(0, versions[0])[:2] == ("policy-v0", 1)
    assert slots.load(1, versions[1])[:2] == ("policy-v1", 1)
    assert slots.timings == {"write_s": 0.001} and engine.removed == []
    # a version the slot cannot take goes into a slot of its own; the one before is removed
    assert slots.load(2, versions[2])[:2] == ("policy-v2", 3)
    assert slots.timings == {"build_s": 0.01, "activate_s": 0.02} and engine.removed == [1]
    assert handed == [("add", 1), ("in place", 1), ("in place", 1), ("add", 3)]
    assert not slots.root.exists()
