"""An SFT micro-batch through a trainer's model: packed rows, each attending only to itself,
and the summed cross-entropy of their trained tokens."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime.models.packing import attention_masks
from runtime.sft.data import token_losses


def packed_loss(model: Any, pack: Any, attention: str, device: torch.device) -> Tensor:
    """Summed cross-entropy of `pack`'s trained tokens (runtime.sft.data.Packed) under `model`."""
    tokens, positions = pack.tokens.to(device), pack.positions.to(device)
    logits = model(tokens, positions, attention_masks(model, positions, attention))
    return token_losses(logits, pack.targets.to(device))
