"""Losses for the fault tests: a `grpo.loss=failing_losses:NAME` recipe fails in the trainer on
purpose (the module is on the trainer procs' path in tests: tests/ is on PYTHONPATH)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
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
    _calls += 1
    if _calls == FAIL_AT and inputs.logprobs.is_cuda:
        if _compiled_gather is None:
            _compiled_gather = torch.compile(_gather, dynamic=False)
        values = inputs.logprobs.detach().contiguous()
        index = torch.full((4,), values.numel() + 2**36, device=values.device)
        _compiled_gather(values, index).sum().item()
    return -inputs.advantages[:, None] * inputs.logprobs, {}


# calls of `rank_1_killed_mid_publish` in this process so far; the publish after the call that
# reaches KILL_AT is the one rank 1 dies in (a few steps in, after a committed checkpoint)
_publish_calls = 0
KILL_AT = 8


def rank_1_killed_mid_publish(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE. On rank 1 of several, its `KILL_AT`-th call arms the trainer's next
    publish: once the first group of the version is gathered, rank 1 kills itself (SIGKILL),
    while rank 0 goes on into the next group's gather, a collective whose peer is gone. A line
    on stderr says when (CLOCK_MONOTONIC: comparable between processes of one host)."""
    global _publish_calls
    _publish_calls += 1
    if _publish_calls == KILL_AT and dist.is_initialized() and dist.get_rank() == 1:
        import os
        import signal

        from runtime.backends import fsdp_trainer

        gather = fsdp_trainer.FSDPTrainer.hf_groups

        def first_group_then_die(self: Any) -> Any:
            for index, group in enumerate(gather(self)):
                if index == 1:
                    print(
                        f"failing_losses: rank 1 killed mid-publish at {time.monotonic():.3f}",
                        file=sys.stderr,
                        flush=True,
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
                yield group

        fsdp_trainer.FSDPTrainer.hf_groups = first_group_then_die
    return -inputs.advantages[:, None] * inputs.logprobs, {}


# calls of `rank_1_out_of_memory_in_backward` in this process so far; the call whose backward
# fails (a few steps in, after a committed checkpoint)
_backward_calls = 0
OOM_AT = 8


class _AllocatesInBackward(torch.autograd.Function):
    """The identity, whose backward first asks the CUDA allocator for a whole GPU's memory."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> Any:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        print(
            f"failing_losses: rank 1 allocating in its backward at {time.monotonic():.3f}",
            file=sys.stderr,
            flush=True,
        )
        total = torch.cuda.get_device_properties(grad.device).total_memory
        torch.empty(total, dtype=torch.uint8, device=grad.device)
        return grad


def rank_1_out_of_memory_in_backward(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE. On rank 1 of several, the backward of its `OOM_AT`-th call asks the
    CUDA allocator for more than its GPU holds: a real out-of-memory error in the backward
    pass, while rank 0 goes on into the backward's reduce-scatter and waits there for rank 1.
    A line on stderr says when (CLOCK_MONOTONIC). On a CPU it allocates nothing."""
    global _backward_calls
    _backward_calls += 1
    logprobs = inputs.logprobs
    armed = _backward_calls == OOM_AT and dist.is_initialized() and dist.get_rank() == 1
    if armed and logprobs.is_cuda:
        logprobs = _AllocatesInBackward.apply(logprobs)
    return -inputs.advantages[:, None] * logprobs, {}


# calls of `nan_gradients` in this process so far; the call whose backward gives NaN (a step
# or two in, after the first checkpoint of a run with --checkpoint-every 1)
_nan_calls = 0
NAN_AT = 3


class _NanInBackward(torch.autograd.Function):
    """The identity, whose backward hands back NaN: the loss stays finite, the gradients do
    not (what a faulty kernel in the backward does)."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> Any:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return torch.full_like(grad, float("nan"))


def nan_gradients(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE, whose `NAN_AT`-th call's gradients are NaN while its loss is not."""
    global _nan_calls
    _nan_calls += 1
    logprobs = inputs.logprobs
    if _nan_calls == NAN_AT:
        logprobs = _NanInBackward.apply(logprobs)
    return -inputs.advantages[:, None] * logprobs, {}


# calls of the two losses below in this process so far; the call that fails
_peer_calls = 0
PEER_FAILS_AT = 2
# how far apart rank 0's failure and rank 1's come
APART_S = 1.5
# a gloo group of the two ranks, in which rank 0 waits for rank 1 (made by every rank at once)
_pair: Any = None


def rank_1_out_of_memory_after_its_peer_fails(inputs: Any, config: Any) -> Any:
    """Plain REINFORCE. At the `PEER_FAILS_AT`-th call of each rank of two, rank 0 waits for
    rank 1 in a collective (a barrier of a group of their own) and rank 1 leaves that group,
    closing its connections: rank 0's collective fails (`Connection closed by peer`), as a
    rank's does when its peer has run out of memory. `APART_S` s later, once rank 0's failure
    has reached the controller, rank 1 raises the error torch raises when a rank runs out of
    memory (on a CPU no allocator runs out: it is raised as the CUDA allocator raises it)."""
    return _out_of_memory_beside_a_failed_peer(inputs, peer_first=True)


def rank_1_out_of_memory_before_its_peer_fails(inputs: Any, config: Any) -> Any:
    """`rank_1_out_of_memory_after_its_peer_fails` the other way round: rank 1's error first,
    the group it leaves left `APART_S` s later."""
    return _out_of_memory_beside_a_failed_peer(inputs, peer_first=False)


def _out_of_memory_beside_a_failed_peer(inputs: Any, peer_first: bool) -> Any:
    global _peer_calls, _pair
    _peer_calls += 1
    if not dist.is_initialized() or dist.get_world_size() != 2:
        return -inputs.advantages[:, None] * inputs.logprobs, {}
    if _pair is None:
        _pair = dist.new_group(backend="gloo")
    if _peer_calls != PEER_FAILS_AT:
        return -inputs.advantages[:, None] * inputs.logprobs, {}
    if dist.get_rank() == 0:
        dist.barrier(group=_pair)  # until rank 1 leaves: fails then
        raise AssertionError("rank 1 left the group: rank 0's barrier cannot pass")

    def leave() -> None:
        global _pair
        dist.destroy_process_group(_pair)
        _pair = None  # the last reference: its connections close now

    if peer_first:
        leave()
        time.sleep(APART_S)
    else:
        import threading

        threading.Timer(APART_S, leave).start()
    print(f"failing_losses: rank 1 out of memory at {time.monotonic():.3f}", file=sys.stderr)
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 3.21 GiB. GPU 0 has a total capacity of 139.80 "
        "GiB of which 512.00 MiB is free. (failing_losses: rank 1, on purpose)"
    )
