"""TorchTitan model definitions (qwen3, llama3) built from a `ModelSpec`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
import torch.nn as nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
)
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from runtime.models.spec import ModelSpec

Attention = Literal["sdpa", "flex", "varlen"]

# Same initialisers as TorchTitan's own registries; only used for random-init models.
_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBED_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


def _inner_attention(attention: Attention):
    # TorchTitan's LM registries reject "sdpa" because their data loaders pack documents; our
    # batches are one right-padded sequence per row, so plain causal SDPA is exact (padding
    # only ever follows the tokens that matter). It is also the only backend that trains on CPU.
    if attention == "sdpa":
        return ScaledDotProductAttention.Config()
    if attention == "flex":
        return FlexAttention.Config()
    if attention == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"unknown attention backend {attention!r}")


def _rope(spec: ModelSpec):
    if spec.family == "qwen3":
        return CosSinRoPE.Config(
            dim=spec.head_dim, max_seq_len=spec.max_seq_len, theta=spec.rope_theta
        )
    scaling = spec.rope_scaling
    if scaling is None:
        return ComplexRoPE.Config(
            dim=spec.head_dim, max_seq_len=spec.max_seq_len, theta=spec.rope_theta
        )
    return ComplexRoPE.Config(
        dim=spec.head_dim,
        max_seq_len=spec.max_seq_len,
        theta=spec.rope_theta,
        scaling="llama",
        scaling_factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def titan_config(spec: ModelSpec, attention: Attention = "sdpa") -> Decoder.Config:
    """The TorchTitan model config for `spec` (what `.build()` turns into the nn.Module)."""
    block_cls = Qwen3TransformerBlock if spec.family == "qwen3" else Llama3TransformerBlock
    model_cls = Qwen3Model if spec.family == "qwen3" else Llama3Model

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=spec.norm_eps, param_init=_NORM_INIT)

    layers = [
        block_cls.Config(
            attention_norm=norm(spec.dim),
            ffn_norm=norm(spec.dim),
            attention=make_gqa_config(
                dim=spec.dim,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_LINEAR_INIT,
                inner_attention=_inner_attention(attention),
                fuse_qkv=True,
                rope=_rope(spec),
                qk_norm=norm(spec.head_dim) if spec.family == "qwen3" else None,
            ),
            feed_forward=make_ffn_config(
                dim=spec.dim,
                hidden_dim=spec.ffn_dim,
                w1_param_init=_LINEAR_INIT,
                w2w3_param_init=_LINEAR_INIT,
            ),
        )
        for _ in range(spec.n_layers)
    ]
    return model_cls.Config(
        dim=spec.dim,
        vocab_size=spec.vocab_size,
        norm=norm(spec.dim),
        enable_weight_tying=spec.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=spec.vocab_size, embedding_dim=spec.dim, param_init=_EMBED_INIT
        ),
        lm_head=Linear.Config(
            in_features=spec.dim, out_features=spec.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )


def build_model(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    attention: Attention = "sdpa",
) -> Decoder:
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
