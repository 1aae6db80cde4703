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


# calls of `cuda_error_in_compiled_code` in this process so far
_calls = 0
# the call that fails: a few steps in (a micro-batch or two a step), after checkpoints
FAIL_AT = 12


def _gather(values: Any, index: Any) -> Any:
    return values.flatten()[index]


_compiled_gather = None


def cuda_error_in_compiled_code(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE, whose `FAIL_AT`-th call runs a torch.compile'd gather (a Triton kernel
    on a GPU) with an index far past the end of its tensor: the kernel faults on the GPU (an
    illegal address, or inductor's bounds assert), a CUDA error raised where the result is
    read. On a CPU it raises nothing."""
    global _calls, _compiled_gather
    import torch

    _calls += 1
    if _calls == FAIL_AT and inputs.logprobs.is_cuda:
        if _compiled_gather is None:
            _compiled_gather = torch.compile(_gather, dynamic=False)
        values = inputs.logprobs.detach().contiguous()
        index = torch.full((4,), values.numel() + 2**36, device=values.device)
        _compiled_gather(values, index).sum().item()
    return -inputs.advantages[:, None] * inputs.logprobs, {}
