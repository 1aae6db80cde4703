"""TorchTitan models built from a `ModelSpec`, whatever the family (runtime/models/<family>/)."""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.decoder import Attention
from runtime.models.families import family
from runtime.models.spec import ModelSpec


def titan_config(spec: ModelSpec, attention: Attention = "sdpa") -> Any:
    """The TorchTitan model config for `spec` (what `.build()` turns into the nn.Module)."""
    return family(spec.family).titan_config(spec, attention)


def build_model(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    attention: Attention = "sdpa",
) -> Any:
    """A TorchTitan decoder with freshly initialised weights (deterministic in `seed`).

    Parameters take `dtype`; buffers (RoPE tables) stay float32 so positions keep full precision.
    The forward is `model(tokens[B, T]) -> logits[B, T, vocab]`.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = titan_config(spec, attention).build()
    model.to_empty(device=device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            model.init_states(buffer_device=device)
    finally:
        torch.random.set_rng_state(generator_state)
    if dtype != torch.float32:
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model
