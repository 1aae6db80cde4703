"""TorchTitan models built from a `ModelSpec`, whatever the family (runtime/models/<family>/)."""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.decoder import Attention
from runtime.models.families import family
from runtime.models.spec import ModelSpec


def titan_config(spec: ModelSpec, attention: Attention = "sdpa", lora: Any = None) -> Any:
    """The TorchTitan model config for `spec` (what `.build()` turns into the nn.Module); with
    `lora` (a recipe's model.lora), q, k and v unfused and the targets wrapped by TorchTitan's
    LoRA, every other parameter frozen (runtime.models.lora)."""
    if lora is None:
        return family(spec.family).titan_config(spec, attention)
    from runtime.models.lora import converter

    config = family(spec.family).titan_config(spec, attention, fuse_qkv=False)
    return converter(lora).convert(config)


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


def meta_model(spec: ModelSpec, attention: Attention = "sdpa", lora: Any = None) -> Any:
    """The TorchTitan decoder of `spec` on the meta device: shapes, no storage; with `lora`, its
    adapter the only trainable parameters (checked).

    Shard it (FSDP2) while it is on meta, then `materialize` it: each rank allocates only its
    shards, and `runtime.models.loading.load_into` fills them (`as_source` with the same
    `lora` adds the adapter's first weights to the base's).
    """
    with torch.device("meta"):
        model = titan_config(spec, attention, lora).build()
    _retie(model)
    if lora is not None:
        from runtime.models.lora import check_converted

        check_converted(model, spec, lora)
    return model


def _retie(model: Any) -> None:
    """A tied model's embedding and output projection as one parameter (on meta the
    constructor's tying may not hold; TorchTitan re-ties the same way before its init)."""
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight


def materialize(model: Any, device: str | torch.device) -> Any:
    """Storage on `device` for a `meta_model` (sharded or not), parameters left uninitialised;
    the buffers (RoPE tables) computed as `build_model` computes them, in float32."""
    device = torch.device(device)
    model.to_empty(device=device)
    _retie(model)  # to_empty gives each module a new Parameter when the device type changes
    with torch.no_grad():
        for module in model.modules():
            if module._buffers and hasattr(module, "_init_self_buffers"):
                module._init_self_buffers(buffer_device=device)
    return model
