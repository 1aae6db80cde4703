"""Monarch actors: thin shells that build a backend in `setup` and expose it as endpoints.

Every endpoint is `async` (Monarch forbids mixing sync and async endpoints in one class). Plain
`@endpoint`s run one message at a time, which is what makes a generator's weight update wait for
the generation in flight: no sequence ever mixes two policy versions.

Each actor lives in a module of its own, imported only where it runs: a reward proc unpickles
`runtime.actors.reward.RewardActor` and never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GeneratorActor": "runtime.actors.generator",
    "ReferenceActor": "runtime.actors.reference",
    "RewardActor": "runtime.actors.reward",
    "TrainerActor": "runtime.actors.trainer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.actors' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
