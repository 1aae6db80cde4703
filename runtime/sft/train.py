"""An SFT micro-batch through a trainer's model: packed rows, each attending only to itself,
and the summed cross-entropy of their trained tokens. The one-process CPU trainer's model ends
in its output projection; the FSDP2 trainer's stops at the final norm (`_skip_lm_head`) and
projects only the positions whose next token is trained (runtime.backends.scoring)."""

from __future__ import annotations

from collections.abc import Sequence
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
        loss = token_losses(out, targets)
    else:
        from runtime.backends.blocks import head_logprobs

        trained = targets != IGNORE
        head = getattr(model, "_head_logprobs", head_logprobs)
        loss = -head(model.lm_head, out[trained], targets[trained], 1.0).float().sum()
    return loss * 0.0 if getattr(pack, "filler", False) else loss


def filler(like: Any) -> Any:
    """A micro-batch that trains nothing: what a rank with no micro-batch of its own runs, so
    every rank takes part in as many forward and backward passes (FSDP's collectives). It is
    `like` (a real micro-batch) with its loss counted zero times: of the shapes the compiled
    blocks and output projection were made for. A stand-in of one token would compile them
    again on that rank (torch.compile specializes a size of 1, and no trained token is a size
    of 0), seconds to a minute at 8B that every other rank waits for at the next collective;
    the rank's time is the same either way (the ranks go in step, the others on real ones)."""
    from dataclasses import replace

    return replace(like, rows=0, filler=True)


def rank_share(packs: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Rank `rank`'s part of a step's micro-batches over `world` ranks: micro-batches rank,
    rank + world, ..., and fillers (copies of the first) where it has fewer than another:
    FSDP's collectives need every rank in every pass. On several ranks the step's last
    micro-batch, the packing's leftover and often far shorter than the rest, is padded to the
    longest beside it in its round: free, as the ranks go in step, and a length that short
    makes torch.compile specialize the blocks again (qwen3-8b-sft on two H200s: rank 1
    compiled again at step 3, given the last micro-batch, under 5,120 tokens, 22 s that every
    rank waited for)."""
    from runtime.sft.data import padded

    packs = list(packs)
    rounds = -(-len(packs) // world)
    if world > 1 and packs:
        last = packs[(rounds - 1) * world :]
        beside = [p.tokens.shape[1] for p in last[:-1]]
        if len(last) < world:
            beside.append(packs[0].tokens.shape[1])
        if beside:
            packs[-1] = padded(packs[-1], max(beside))
    mine = packs[rank::world]
    return mine + [filler(packs[0])] * (rounds - len(mine))
