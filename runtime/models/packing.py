"""Packed rows: several samples in one sequence, each attending only to itself.

A packed sequence carries `positions` that restart at 0 where each sample starts (TorchTitan's
convention for packed documents: RoPE takes them, and its masks are derived from them). Which
attention keeps samples apart:

- varlen (GPUs, the default there): TorchTitan's `VarlenAttention` on torch's own flash
  attention (`TorchVarlenAttention` below), over each sample, from the sample boundaries its
  decoder finds in the positions (`model.get_attention_masks`).
- flex (GPUs): TorchTitan's `FlexAttention` with the block mask its decoder builds from the
  positions. In torch 2.13 flex attention runs forward on the CPU (compiled) but has no backward
  there.
- document (CPU): `DocumentAttention` below, SDPA with a dense boolean mask that allows a query
  the keys of its own sample up to itself. L x L booleans a row: for short rows, as on the CPU.

`attention_masks(model, positions, attention)` gives what the model's forward takes for either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenAttention
from torchtitan.protocols.module import Module


def sample_ids(positions: Tensor) -> Tensor:
    """`[B, L]` positions -> the index of the sample each token belongs to within its row."""
    return torch.cumsum((positions == 0).int(), dim=-1)


def document_mask(positions: Tensor) -> Tensor:
    """`[B, 1, L, L]` booleans: query t may attend key s when both are in one sample and s <= t."""
    ids = sample_ids(positions)
    same = ids[:, :, None] == ids[:, None, :]
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


class DocumentAttention(ScaledDotProductAttention):
    """TorchTitan's SDPA inner attention, taking a dense mask (`document_mask`) where one is
    given; without one, causal as the original."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        if attention_masks is None:
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


@functools.cache
def _varlen_arguments() -> frozenset[str]:
    """The arguments the installed torch's varlen_attn takes (read once, not every layer's call)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


class TorchVarlenAttention(VarlenAttention):
    """TorchTitan's variable-length attention on torch's own flash attention kernel (FA2).
    TorchTitan's class switches torch to the FA3 (Hopper) or FA4 (Blackwell) kernels, which need
    the `flash_attn_interface` package the nodes' stack does not have
    (bench/results/gpu_h200_2026-11-29-runtime/sft_step_varlen.log); the forward is TorchTitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        Module.__init__(self)
        self.window_size = config.window_size
        # read here, not in forward: the compiled forward would trace into the cache's wrapper
        self.groups_heads = "enable_gqa" in _varlen_arguments()

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        from torch.nn.attention.varlen import varlen_attn

        # the nodes' torch 2.11 takes neither num_splits nor, maybe, enable_gqa: pass what it
        # takes, and give keys and values the queries' heads where it cannot group them
        b, length, heads, dim = q_BLNH.shape
        k, v = k_BLNH, v_BLNH
        extra: dict[str, Any] = {}
        if k.shape[2] != heads:
            if self.groups_heads:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(heads // k.shape[2], dim=2)
                v = v.repeat_interleave(heads // v.shape[2], dim=2)
        t = b * length
        out = varlen_attn(
            q_BLNH.reshape(t, heads, dim).to(torch.bfloat16),
            k.reshape(t, k.shape[2], dim).to(torch.bfloat16),
            v.reshape(t, v.shape[2], v.shape[-1]).to(torch.bfloat16),
            attention_masks.cu_seq_q,
            attention_masks.cu_seq_k,
            attention_masks.max_q,
            attention_masks.max_k,
            scale=scale,
            window_size=self.window_size,
            **extra,
        )
        return out.view(b, length, heads, v.shape[-1]).to(q_BLNH.dtype)


def attention_masks(model: Any, positions: Tensor, attention: str) -> Any:
    """What `model(tokens, positions, masks)` takes to keep each row's samples apart."""
    if attention == "document":
        return document_mask(positions)
    return model.get_attention_masks(positions)
