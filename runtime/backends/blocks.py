"""What the trainers do to a TorchTitan model's blocks and batches, on any device: micro-batches
of a token budget, activation checkpointing and torch.compile around each block."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def head_logprobs(
    lm_head: torch.nn.Module, hidden: Tensor, target: Tensor, temperature: float
) -> Tensor:
    """`log softmax(lm_head(hidden) / T)[target]` per row of `hidden` `[N, D]`, in fp32.

    Eager, this materialises fp32 logits `[N, vocab]` several times over (the cast, the scaled
    copy, logsumexp's pass, and their gradients). `wrap_blocks(compile=True)` swaps in a
    compiled copy: one kernel reads the projection's bf16 output and reduces it.
    """
    return head_outputs(lm_head, hidden, target, temperature, 0)[0]


def head_outputs(
    lm_head: torch.nn.Module, hidden: Tensor, target: Tensor, temperature: float, entropy: int
) -> tuple[Tensor, Tensor | None]:
    """`head_logprobs`, and with `entropy` 1 the entropy of each row's distribution (no graph:
    a metric), with 2 the entropy with its graph (the recipe's entropy bonus)."""
    logits = lm_head(hidden).float()  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, target[:, None]).squeeze(-1) - lse
    if entropy == 0:
        return lp, None
    if entropy == 1:
        with torch.no_grad():
            z = logits.detach()
            return lp, lse.detach() - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return lp, lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def micro_batches(tokens: Tensor, budget: int) -> list[slice]:
    """Row slices of at most `budget` tokens each (at least one row per slice), as few as that
    allows and of sizes that differ by one row at most: 128 rows of 25 a slice are 22, 22, 21,
    21, 21, 21, not five of 25 and one of 3. The compiled blocks were made for slices of two rows
    or more: a slice of one row (a remainder) would compile them again (torch.compile
    specializes a size of 1), and a small last slice is a step's least efficient work."""
    batch, width = tokens.shape
    size = max(1, budget // max(1, width))
    count = -(-batch // size)
    base, extra = divmod(batch, count) if batch else (0, 0)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def wrap_blocks(
    model: torch.nn.Module, *, checkpointing: bool, compile: bool, compile_head: bool = True
) -> None:
    """Activation checkpointing and/or torch.compile around each transformer block's forward
    (with `compile` and `compile_head`, the output projection plus log-softmax too).

    The forward is wrapped rather than the module, so parameter names (the HF conversion's
    input) stay as they are. Compile goes outside the checkpoint: `checkpoint` refuses to be the
    first frame torch.compile traces (it is `_disable_dynamo`), and inside a traced function it
    becomes one region the compiler recomputes.
    """
    for block in model.layers.values():
        forward = block.forward
        if checkpointing:
            forward = _checkpointed(forward)
        if compile:
            forward = torch.compile(forward, dynamic=True)
        block.forward = forward
    if compile and compile_head:
        model._head_logprobs = torch.compile(head_logprobs, dynamic=True)
        model._head_outputs = torch.compile(head_outputs, dynamic=True)


def _checkpointed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
