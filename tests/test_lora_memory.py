"""The planner's LoRA memory model (recipes/lora.py, recipes/memory.py) against the models the
runtime builds: the catalog's LoRA recipes, built on the meta device (shapes, no storage) by
the trainer's own code, count what the planner counts."""

from __future__ import annotations

import pytest
import torch

from recipes import load_recipe
from recipes.lora import adapter_bytes, adapter_params
from recipes.memory import checkpoint_bytes, trainer_state_bytes, version_bytes
from runtime.backends import build
from runtime.backends.fsdp_trainer import _round_frozen_weights
from runtime.models.lora import adapter_state, peft_state
from runtime.models.titan import meta_model


@pytest.fixture(
    scope="module", params=["qwen3-8b-lora", "llama3.1-8b-lora", "qwen3-14b-lora", "qwen3-32b-lora"]
)
def built(request):
    """(recipe, the LoRA model on meta as a GPU trainer holds it: frozen projections in bf16)."""
    recipe = load_recipe(request.param)
    model = meta_model(build.model_spec(recipe), lora=recipe.model.lora)
    _round_frozen_weights(model, torch.bfloat16)
    return recipe, model


def test_the_trainable_parameters_are_the_planners_adapter(built):
    recipe, model = built
    arch, lora = recipe.arch, recipe.model.lora
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == adapter_params(arch, lora)
    assert all(p.dtype == torch.float32 for p in trainable)  # weight, gradient, moments: 16 B
    # what a checkpoint holds: the adapter and its two moments, 12 bytes a parameter
    assert checkpoint_bytes(arch, lora) == 12 * sum(p.numel() for p in trainable)


def test_the_frozen_base_is_the_memory_models_base_term(built):
    recipe, model = built
    arch, lora = recipe.arch, recipe.model.lora
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == arch.params  # a tied embedding counted once
    # sharded, the model counts the base at 2 bytes a parameter
    adapter = 16 * adapter_params(arch, lora)
    assert trainer_state_bytes(arch, 2, lora) == pytest.approx((2 * arch.params + adapter) / 2)
    # on one rank the embedding stays fp32 (2 bytes more a parameter), and so do the norms,
    # which the model leaves out: a few hundred kB against tens of GB
    embedding = model.tok_embeddings.weight
    assert embedding.dtype == torch.float32
    norms = sum(p.numel() for p in frozen if p.dtype == torch.float32 and p is not embedding)
    stored = sum(p.numel() * p.element_size() for p in frozen)
    assert stored == trainer_state_bytes(arch, 1, lora) - adapter + 2 * norms
    assert norms < 1e-4 * arch.params
    # every other frozen weight is a bf16 projection
    others = [p for p in frozen if p.dtype != torch.float32]
    assert {p.dtype for p in others} == {torch.bfloat16}
    assert sum(p.numel() for p in others) == arch.params - embedding.numel() - norms


def test_a_published_version_is_what_the_planner_counts(built):
    recipe, model = built
    lora, spec = recipe.model.lora, build.model_spec(recipe)
    # the layout FSDPTrainer.hf_layout publishes: the adapter under PEFT's names, in bf16
    adapter = {k: torch.empty(v.shape, device="meta") for k, v in adapter_state(model).items()}
    published = {
        k: v.to(torch.bfloat16) for k, v in peft_state(adapter, spec.family, lora, spec).items()
    }
    assert len(published) == 2 * len(lora.modules) * spec.n_layers
    assert all(".lora_A." in k or ".lora_B." in k for k in published)
    nbytes = sum(v.numel() * v.element_size() for v in published.values())
    assert nbytes == version_bytes(recipe) == adapter_bytes(recipe.arch, lora)
