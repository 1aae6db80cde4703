"""Compiling a step's graphs before the first step, while the generator starts.

A compiled trainer (or reference) makes its graphs the first time a step runs them: on a fresh
node a minute or two of the first step (qwen3-8b-lora on one H200: its training took 104 s, 5.8 s
in later steps) while the generator waited; and before that, during the generator's own start
(vLLM's compile and CUDA graphs, 1-3 minutes), the trainer sat idle, ready. `compile_ahead` runs the step's own
passes once on a made-up micro-batch during that wait, so the first step finds its graphs made.

The micro-batch is one of the step's: the run's widest rows (prompt and completion at the
recipe's caps) and as many as the micro-batch's token budget holds, so that the kernels
torch.compile tunes on first use are tuned at the sizes the steps run. Its sizes avoid what
would make a step compile again: a size of 1 (torch.compile specializes it) and two dynamic
sizes that happen to be equal (it would give them one symbol, which a real batch then breaks).
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
    """Random tokens `[rows, width]` and their response mask (each row's second half): as many
    rows as `budget` tokens hold, at least 3, never `width` of them. With 3 or more rows, the
    response tokens predicted (rows x half the width) outnumber the width too."""
    width = max(4, width)
    rows = max(3, budget // width)
    if rows == width:
        rows += 1
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, width // 2 :] = True
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
