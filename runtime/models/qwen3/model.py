"""Qwen3 as a TorchTitan decoder."""

from __future__ import annotations

from typing import Any

from torchtitan.models.common import CosSinRoPE
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from runtime.models.decoder import Attention, decoder_config


def titan_config(spec: Any, attention: Attention = "sdpa", fuse_qkv: bool = True) -> Any:
    rope = CosSinRoPE.Config(dim=spec.head_dim, max_seq_len=spec.max_seq_len, theta=spec.rope_theta)
    return decoder_config(
        spec,
        attention,
        block=Qwen3TransformerBlock,
        model=Qwen3Model,
        rope=rope,
        qk_norm=True,
        fuse_qkv=fuse_qkv,
    )
