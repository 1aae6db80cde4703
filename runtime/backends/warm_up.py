"""Compiling a step's graphs before the first step, while the generator starts.

A compiled trainer (or reference) makes its graphs the first time a step runs them: on a fresh
node a minute or two of the first step (qwen3-8b-lora on one H200: its training took 104 s,
5.8 s in later steps) while the generator waited; and before that, during the generator's own
start (vLLM's compile and CUDA graphs, 1-3 minutes), the trainer sat idle, ready.
`compile_ahead` runs the step's own passes once on a made-up micro-batch during that wait, so
the first step finds its graphs made.

The micro-batch is one of the step's: the run's widest rows (prompt and completion at the
recipe's caps) and as many as the micro-batch's token budget holds, so that the kernels
torch.compile tunes on first use are tuned at the sizes the steps run. Its sizes avoid what
would make a step compile again: a size of 1 (torch.compile specializes it), and a size equal
to another, which torch.compile gives one symbol: two of its own, or one of its own and a
model's dimension (a width of 2,048 beside qwen3-1.7b's hidden size of 2,048 would be fixed at
2,048 by the first matrix product, and every later width compile again). The rows, the width,
each row's response tokens and all of them are odd; the hidden and head dimensions of the
models forgesky runs are even.

Nothing it does stays: gradients are dropped, no optimizer step is taken, and the made-up
tokens come from a generator of their own (the run's seeded ones draw nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from runtime.backends.gpu_memory import StepEvents


def synthetic_rows(vocab: int, width: int, budget: int) -> tuple[Tensor, Tensor]:
    """Random tokens `[rows, width]` and their response mask (about each row's second half):
    as many rows as `budget` tokens hold, at least 3, all three sizes odd (the width at most one
    less than asked, the rows at most one less than the budget holds) and the rows never as
    many as the width."""
    width = max(5, width - 1 + width % 2)
    rows = max(3, budget // width)
    rows -= 1 - rows % 2
    if rows == width:
        rows -= 2
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    # position t-1 predicts token t: a row's mask from `start` on predicts width - start tokens
    start = width // 2
    start += 1 - (width - start) % 2
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, start:] = True
    return tokens, mask


def compile_ahead(run: Callable[[], None], device: torch.device) -> dict[str, float]:
    """Run `run` (a step's passes on `synthetic_rows`): the graphs torch.compile made
    meanwhile and the seconds it took."""
    events = StepEvents(device)
    before = events.read()
    start = time.perf_counter()
    run()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    return {
        "graphs": events.since(before)["compile/graphs"],
        "seconds": time.perf_counter() - start,
    }
