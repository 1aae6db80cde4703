"""Monarch actors: thin shells that build a backend in `setup` and expose it as endpoints.

Every endpoint is `async` (Monarch forbids mixing sync and async endpoints in one class). Plain
`@endpoint`s run one message at a time, which is what makes a generator's weight update wait for
the generation in flight: no sequence ever mixes two policy versions.
"""

from runtime.actors.generator import GeneratorActor
from runtime.actors.reference import ReferenceActor
from runtime.actors.reward import RewardActor
from runtime.actors.trainer import TrainerActor

__all__ = ["GeneratorActor", "ReferenceActor", "RewardActor", "TrainerActor"]
