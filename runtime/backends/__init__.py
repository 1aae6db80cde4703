"""Backends the actors wrap: generator, trainer and reference (CPU variants here)."""

from runtime.backends.base import (
    Completion,
    GeneratorBackend,
    LossFn,
    ScoringBackend,
    TrainerBackend,
    token_logprobs,
)
from runtime.backends.batch import TokenBatch, collate
from runtime.backends.hf_generator import HFGenerator
from runtime.backends.titan_trainer import OptimizerConfig, TitanReference, TitanTrainer

__all__ = [
    "Completion",
    "GeneratorBackend",
    "HFGenerator",
    "LossFn",
    "OptimizerConfig",
    "ScoringBackend",
    "TitanReference",
    "TitanTrainer",
    "TokenBatch",
    "TrainerBackend",
    "collate",
    "token_logprobs",
]
