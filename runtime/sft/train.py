"""An SFT micro-batch through a trainer's model: packed rows, each attending only to itself,
and the summed cross-entropy of their trained tokens. The one-process CPU trainer's model ends
in its output projection; the FSDP2 trainer's stops at the final norm (`_skip_lm_head`) and
projects only the positions whose next token is trained (runtime.backends.scoring)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime.models.packing import attention_masks
from runtime.sft.data import IGNORE, token_losses


def packed_loss(model: Any, pack: Any, attention: str, device: torch.device) -> Tensor:
    """Summed cross-entropy of `pack`'s trained tokens (runtime.sft.data.Packed) under `model`."""
    tokens, positions = pack.tokens.to(device), pack.positions.to(device)
    targets = pack.targets.to(device)
    out = model(tokens, positions, attention_masks(model, positions, attention))
    if not getattr(model, "_skip_lm_head", False):
        return token_losses(out, targets)
    from runtime.backends.blocks import head_logprobs

    trained = targets != IGNORE
    head = getattr(model, "_head_logprobs", head_logprobs)
    return -head(model.lm_head, out[trained], targets[trained], 1.0).float().sum()


def filler(like: Any) -> Any:
    """A micro-batch that trains nothing: what a rank with no micro-batch of its own runs, so
    every rank takes part in as many forward and backward passes (FSDP's collectives)."""
    from runtime.sft.data import Packed

    tokens = torch.zeros_like(like.tokens[:, :1])
    return Packed(tokens, torch.zeros_like(tokens), torch.full_like(tokens, IGNORE), 0, [1])
