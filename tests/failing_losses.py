"""Losses for the fault tests: a `grpo.loss=failing_losses:NAME` recipe fails in the trainer on
purpose (the module is on the trainer procs' path in tests: tests/ is on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_0_raises(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE on every rank but rank 0, which raises before its backward: the other
    ranks go on into the backward's collectives and wait there for rank 0."""
    if dist.is_initialized() and dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails on purpose (failing_losses.rank_0_raises)")
    return -inputs.advantages[:, None] * inputs.logprobs, {}
