"""Llama 3 as a TorchTitan decoder."""

from __future__ import annotations

from typing import Any

from torchtitan.models.common import ComplexRoPE
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock

from runtime.models.decoder import Attention, decoder_config


def _rope(spec: Any) -> Any:
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


def titan_config(spec: Any, attention: Attention = "sdpa", fuse_qkv: bool = True) -> Any:
    return decoder_config(
        spec,
        attention,
        block=Llama3TransformerBlock,
        model=Llama3Model,
        rope=_rope(spec),
        qk_norm=False,
        fuse_qkv=fuse_qkv,
    )
