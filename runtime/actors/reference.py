"""The reference actor: a frozen copy of the initial policy that scores tokens for the KL term."""

from __future__ import annotations

import time
from typing import Any

import torch
from monarch.actor import Actor, endpoint

from runtime.backends import build
from runtime.backends.scoring import response_lists
from runtime.procs.failures import ranked
from runtime.procs.mps import client_sm_percent


class ReferenceActor(Actor):
    def __init__(self) -> None:
        self.backend: Any = None

    @endpoint
    @ranked
    async def setup(self, recipe: Any, settings: Any) -> dict[str, Any]:
        """Build the frozen model (`settings`: the plan's recipes.settings.Settings)."""
        self.backend = build.ReferenceConfig(recipe, settings.reference).build()
        return {
            "device": str(build.device()),
            "backend": type(self.backend).__name__,
            "mps_sm_percent": client_sm_percent(),
        }

    @endpoint
    @ranked
    async def warm_up(self, width: int) -> dict[str, float] | None:
        """A compiled reference's graphs made before the first step, on a micro-batch of
        made-up rows `width` tokens wide (runtime.backends.warm_up); None where nothing
        compiles."""
        warm = getattr(self.backend, "warm_up", None)
        return None if warm is None else warm(width)

    @endpoint
    @ranked
    async def logprobs(self, tokens: torch.Tensor, response_mask: torch.Tensor) -> dict[str, Any]:
        """The reference's log-prob of every response token, one list per row (in order).

        With several ranks (one proc per reference GPU, the model sharded over them) every
        rank is called, scores its share of the rows (`first`: where it starts) and answers
        for those; `runtime.control.services` puts the shares back together."""
        start = time.perf_counter()
        rows_of = getattr(self.backend, "my_rows", None)
        share = rows_of(tokens.shape[0]) if rows_of else slice(0, tokens.shape[0])
        rows = response_lists(self.backend.logprobs(tokens, response_mask), response_mask[share])
        return {"logprobs": rows, "first": share.start, "seconds": time.perf_counter() - start}
