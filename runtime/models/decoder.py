"""The TorchTitan decoder every family shares: GQA attention, SwiGLU feed-forward, RMSNorm, the
same initialisers as TorchTitan's own registries. A family supplies its block and model
classes, its RoPE and whether it normalises queries and keys."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch.nn as nn
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
)
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

# TorchTitan's inner attention, by name
Attention = Literal["sdpa", "flex", "varlen"]


# Only used for random-init models.
_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBED_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


def inner_attention(attention: Attention) -> Any:
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


def decoder_config(
    spec: Any,
    attention: Attention,
    *,
    block: Any,
    model: Any,
    rope: Any,
    qk_norm: bool,
) -> Any:
    """The decoder config of `spec` with the family's `block` and `model` classes and `rope`."""

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=spec.norm_eps, param_init=_NORM_INIT)

    layers = [
        block.Config(
            attention_norm=norm(spec.dim),
            ffn_norm=norm(spec.dim),
            attention=make_gqa_config(
                dim=spec.dim,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_LINEAR_INIT,
                inner_attention=inner_attention(attention),
                fuse_qkv=True,
                rope=rope,
                qk_norm=norm(spec.head_dim) if qk_norm else None,
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
    return model.Config(
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
