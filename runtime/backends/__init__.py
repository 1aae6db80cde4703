"""Backends the actors wrap: generator, trainer and reference (CPU and GPU variants), each in a
module of its own, loaded on first use (a generator proc never imports the trainer's code)."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Completion": "runtime.backends.base",
    "GeneratorBackend": "runtime.backends.base",
    "LossFn": "runtime.backends.base",
    "ScoringBackend": "runtime.backends.base",
    "TrainerBackend": "runtime.backends.base",
    "token_logprobs": "runtime.backends.base",
    "TokenBatch": "runtime.backends.batch",
    "collate": "runtime.backends.batch",
    "HFGenerator": "runtime.backends.hf_generator",
    "OptimizerConfig": "runtime.backends.titan_trainer",
    "TitanReference": "runtime.backends.titan_trainer",
    "TitanTrainer": "runtime.backends.titan_trainer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
