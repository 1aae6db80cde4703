"""The TorchTitan decoder every family shares: GQA attention, SwiGLU feed-forward, RMSNorm, the
same initialisers as TorchTitan's own registries. A family supplies its block and model
classes, its RoPE and whether it normalises queries and keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import torch.nn as nn
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import (
    BaseQKVLinear,
    FlexAttention,
    QKVLinear,
    ScaledDotProductAttention,
)
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

# TorchTitan's inner attention, by name; "document" is SDPA under a dense same-row causal
# mask (runtime.models.packing), for packed rows where flex and varlen cannot run (the CPU)
Attention = Literal["sdpa", "flex", "varlen", "document"]


# Only used for random-init models.
_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBED_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


class SeparateQKVLinear(QKVLinear):
    """Queries, keys and values by three projections, each built from a config field of its own
    (`wq`, `wk`, `wv`). TorchTitan's unfused `QKVLinear` builds keys and values from one `wkv`
    field, so a converter matching field names (LoRA's) could not wrap one without the other."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseQKVLinear.Config):
        wq: Linear.Config
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config: Config):
        BaseQKVLinear.__init__(self, config)
        self.wq = config.wq.build()
        self.wk = config.wk.build()
        self.wv = config.wv.build()


def inner_attention(attention: Attention) -> Any:
    # TorchTitan's LM registries reject "sdpa" because their data loaders pack documents; our
    # batches are one right-padded sequence per row, so plain causal SDPA is exact (padding
    # only ever follows the tokens that matter). It is also the only backend that trains on CPU.
    if attention == "sdpa":
        return ScaledDotProductAttention.Config()
    if attention == "flex":
        return FlexAttention.Config()
    if attention == "varlen":
        from runtime.models.packing import TorchVarlenAttention

        return TorchVarlenAttention.Config()
    if attention == "document":
        from runtime.models.packing import DocumentAttention

        return DocumentAttention.Config()
    raise ValueError(f"unknown attention backend {attention!r}")


def decoder_config(
    spec: Any,
    attention: Attention,
    *,
    block: Any,
    model: Any,
    rope: Any,
    qk_norm: bool,
    fuse_qkv: bool = True,
) -> Any:
    """The decoder config of `spec` with the family's `block` and `model` classes and `rope`.

    `fuse_qkv` False gives q, k and v projections of their own (`SeparateQKVLinear`), which a
    LoRA adapter needs: each target wraps one projection. Checkpoints name them alike either way.
    """

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=width, eps=spec.norm_eps, param_init=_NORM_INIT)

    def attention_config() -> Any:
        config = make_gqa_config(
            dim=spec.dim,
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            wqkv_param_init=_LINEAR_INIT,
            wo_param_init=_LINEAR_INIT,
            inner_attention=inner_attention(attention),
            fuse_qkv=fuse_qkv,
            rope=rope,
            qk_norm=norm(spec.head_dim) if qk_norm else None,
        )
        if fuse_qkv:
            return config
        qkv = config.qkv_linear
        separate = SeparateQKVLinear.Config(
            head_dim=qkv.head_dim, wq=qkv.wq, wk=replace(qkv.wkv), wv=replace(qkv.wkv)
        )
        return replace(config, qkv_linear=separate)

    layers = [
        block.Config(
            attention_norm=norm(spec.dim),
            ffn_norm=norm(spec.dim),
            attention=attention_config(),
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
