"""The CPU generator under LoRA: versions that carry the adapter alone sample from the merged
model, each merged into the base it holds (not into the version before), over the same load
paths the weight transports use."""

from __future__ import annotations

import pytest
import torch
from test_models import LLAMA, QWEN
from test_peft_format import TOKENS, random_adapter

from recipes.run_sections import Lora
from runtime.backends import HFGenerator
from runtime.models import build_hf_model
from runtime.models.peft_format import merge, pairs
from runtime.weights.flat import fill, flat_layout, load_flat

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
