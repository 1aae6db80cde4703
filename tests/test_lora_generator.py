"""The CPU generator under LoRA: versions that carry the adapter alone sample from the merged
model, each merged into the base it holds (not into the version before), over the same load
paths the weight transports use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from test_models import LLAMA, QWEN
from test_peft_format import TOKENS, random_adapter

from recipes.run_sections import Lora
from runtime.backends import HFGenerator
from runtime.backends.vllm_lora import LoraSlots, engine_options, max_lora_rank
from runtime.models import build_hf_model
from runtime.models.peft_format import merge, pairs
from runtime.weights.flat import fill, flat_layout, load_flat, views

LORA = Lora(rank=8, alpha=16)


def base_state(spec, seed):
    torch.manual_seed(seed)
    return build_hf_model(spec).state_dict()


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def merged_model(spec, state, tensors, lora=LORA):
    model = build_hf_model(spec)
    model.load_state_dict(merge(state, pairs(tensors), lora.scaling))
    return model


def generator(spec, lora=LORA, **kwargs):
    return HFGenerator(spec, eos_token_id=2, pad_token_id=0, seed=0, lora=lora, **kwargs)


def through_flat(gen, state):
    """A version as the direct paths hand it over: views of one flat buffer."""
    entries, size = flat_layout(state)
    flat = torch.zeros(size, dtype=torch.uint8)
    fill(flat, entries, state)
    load_flat(gen, flat, entries)


@pytest.mark.parametrize("spec", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_after_two_versions_the_generator_is_the_merged_model(spec):
    base = base_state(spec, 1)
    gen = generator(spec, weights=base)
    for version in (1, 2):
        tensors = random_adapter(spec, LORA, seed=version)
        through_flat(gen, tensors)
        expected = merged_model(spec, base, tensors)
        # merged into W0, not into the previous version's weights
        torch.testing.assert_close(logits_of(gen.model), logits_of(expected), atol=1e-6, rtol=0)
    prompts = [[1, 5, 9], [3, 8]]
    ours = gen.generate(prompts, n=1, max_new_tokens=6, temperature=0, logprobs=False)
    plain = HFGenerator(spec, eos_token_id=2, pad_token_id=0, weights=expected.state_dict())
    theirs = plain.generate(prompts, n=1, max_new_tokens=6, temperature=0, logprobs=False)
    assert [c.response_ids for c in ours] == [c.response_ids for c in theirs]


def test_a_base_version_loads_as_today_and_becomes_w0():
    spec = QWEN
    gen = generator(spec, weights=base_state(spec, 1))
    gen.load_weights(random_adapter(spec, LORA, seed=1))
    new_base = base_state(spec, 7)
    gen.load_weights(new_base)
    torch.testing.assert_close(logits_of(gen.model), logits_of(merged_model(spec, new_base, {})))
    tensors = random_adapter(spec, LORA, seed=2)
    gen.load_weights(tensors)
    expected = logits_of(merged_model(spec, new_base, tensors))
    torch.testing.assert_close(logits_of(gen.model), expected, atol=1e-6, rtol=0)


def test_only_the_targeted_projections_change():
    spec, lora = QWEN, Lora(rank=4, targets=["q_proj", "v_proj"])
    base = base_state(spec, 1)
    gen = generator(spec, lora=lora, weights=base)
    gen.load_weights(random_adapter(spec, lora))
    now = gen.model.state_dict()
    changed = sorted(k for k in base if not torch.equal(now[k], base[k]))
    assert changed == sorted(
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")
    )


def test_what_is_not_a_version_is_a_bug():
    spec = QWEN
    base = base_state(spec, 1)
    tensors = random_adapter(spec, LORA)
    gen = generator(spec, weights=base)
    with pytest.raises(KeyError, match="mixes adapter matrices"):
        gen.load_weights({**tensors, "model.norm.weight": base["model.norm.weight"]})
    with pytest.raises(KeyError, match="does not fit"):
        gen.load_weights(dict(list(tensors.items())[:-2]))
    with pytest.raises(KeyError, match="does not fit"):
        gen.load_weights(random_adapter(spec, Lora(rank=4)))
    # without LoRA an adapter is not weights of this model at all
    with pytest.raises(KeyError, match="unexpected"):
        generator(spec, lora=None).load_weights(tensors)


# --- the vLLM generator's adapter slots (the engine is vLLM's on a GPU: tests/test_gpu_lora.py)


class RecordingEngine:
    """What LoraSlots uses of vLLM's LLMEngine, recorded: which adapters it registers and drops,
    and whether each folder was whole when it was registered."""

    def __init__(self, accept: bool = True):
        self.calls: list[tuple] = []
        self.registered: set[int] = set()
        self.accept = accept

    def add_lora(self, request):
        name, lora_id, path = request
        files = sorted(p.name for p in Path(path).iterdir())
        self.calls.append(("add", name, lora_id, Path(path).name, files))
        if self.accept:
            self.registered.add(lora_id)
        return self.accept

    def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))
        self.registered.discard(lora_id)
        return True


def request(name, lora_id, path):
    return (name, lora_id, path)


def test_slots_write_register_then_drop_the_version_before(tmp_path):
    spec = QWEN
    engine = RecordingEngine()
    slots = LoraSlots(engine, LORA, root=tmp_path / "lora", request_type=request)
    versions = {v: random_adapter(spec, LORA, seed=v) for v in (0, 1)}
    entries, size = flat_layout(versions[0])
    flat = torch.zeros(size, dtype=torch.uint8)
    fill(flat, entries, versions[0])
    assert slots.load(0, views(flat, entries)) == ("policy-v0", 1, str(tmp_path / "lora/v0"))
    assert slots.load(1, versions[1]) == ("policy-v1", 2, str(tmp_path / "lora/v1"))
    files = ["adapter_config.json", "adapter_model.safetensors"]
    assert engine.calls == [
        ("add", "policy-v0", 1, "v0", files),
        ("add", "policy-v1", 2, "v1", files),
        ("remove", 1),
    ]
    assert engine.registered == {2} and slots.current == ("policy-v1", 2, str(slots.folder(1)))
    assert sorted(p.name for p in slots.root.iterdir()) == ["v1"]
    # what vLLM reads is a PEFT folder: PEFT itself gives the merged model from it
    base = base_state(spec, 1)
    model = build_hf_model(spec)
    model.load_state_dict(base)
    peft = PeftModel.from_pretrained(model, slots.folder(1))
    expected = logits_of(merged_model(spec, base, versions[1]))
    torch.testing.assert_close(logits_of(peft.eval()), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="adapter version 1 after version 1"):
        slots.load(1, versions[1])
    slots.close()
    assert not slots.root.exists()


def test_slots_hand_a_version_over_from_memory_without_a_folder(tmp_path):
    engine = RecordingEngine()
    handed = []

    def from_memory(lora_id, tensors, config):
        handed.append((lora_id, tensors, config))
        engine.registered.add(lora_id)
        return {"build_s": 0.0}

    slots = LoraSlots(
        engine, LORA, root=tmp_path / "lora", request_type=request, from_memory=from_memory
    )
    versions = {v: random_adapter(QWEN, LORA, seed=v) for v in (0, 1)}
    slots.load(0, versions[0])
    assert slots.load(1, versions[1]) == ("policy-v1", 2, str(tmp_path / "lora/v1"))
    assert [h[0] for h in handed] == [1, 2] and handed[1][1] is versions[1]
    # the config vLLM's PEFTHelper reads: rank, alpha and the HF names of the targets
    config = handed[1][2]
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 16, "none")
    assert sorted(config["target_modules"]) == sorted(LORA.modules)
    assert engine.calls == [("remove", 1)] and engine.registered == {2}
    assert not slots.root.exists() and slots.timings == {"build_s": 0.0}
    slots.close()


def test_an_adapter_the_engine_refuses_is_an_error(tmp_path):
    slots = LoraSlots(
        RecordingEngine(accept=False), LORA, root=tmp_path / "lora", request_type=request
    )
    with pytest.raises(RuntimeError, match="did not add the adapter of policy version 0"):
        slots.load(0, random_adapter(QWEN, LORA))
    assert slots.current is None


@pytest.mark.parametrize(
    ("rank", "engine_rank"), [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320), (512, 512)]
)
def test_the_engine_is_built_for_the_smallest_rank_vllm_allows(rank, engine_rank):
    assert max_lora_rank(rank) == engine_rank
    assert engine_options(Lora(rank=rank)) == {
        "enable_lora": True,
        "max_lora_rank": engine_rank,
        "max_loras": 2,
        "max_cpu_loras": 2,
    }
    # the recipe's generator.lora_specialize_active: vLLM's own option, added only where on
    specialized = engine_options(Lora(rank=rank), specialize_active=True)
    assert specialized == {**engine_options(Lora(rank=rank)), "specialize_active_lora": True}


def test_a_rank_above_vllms_largest_is_a_bug_here():
    # the recipe refuses it in one line before anything is built
    with pytest.raises(ValueError, match="up to 512, not 513"):
        max_lora_rank(513)
