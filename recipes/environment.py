"""The recipe's `env` section: multi-turn episodes with tool calls, the environment they call
tools in, and how the run hosts it (worker processes beside the generator, docs/tools.md).

    env:
      name: builtin:python            # or mypkg.envs:MyEnvironment (an OpenEnv Environment)
      args: {}                        # keyword arguments the class is built with
      workers_per_node: 4             # CPU worker processes hosting the episodes, per node
      max_turns: 4                    # model turns an episode may take
      max_turn_tokens: null           # tokens the model may sample in one turn
      max_episode_tokens: null        # tokens an episode may hold, its opening prompt included
      turn_rewards: false             # add the rewards of tool calls to the episode's reward
      call_timeout_s: 30              # one tool call; past it the worker is replaced
      episode_timeout_s: 300          # a whole episode; past it the episode is dropped
      sandbox: {cpu_seconds: 5, memory_mb: 512, wall_seconds: 10, disk_mb: 16}

A recipe without the section has single-turn rollouts. With it, each completion is an episode
that alternates the model's turns with the tools' results, in the model family's chat format,
and the environment gives the reward (the dataset then needs none). Every number is > 0; the
class is found and checked without importing it (recipes/references.py), the way a custom
reward is.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from recipes.fields import Strict
from recipes.names import BUILTIN_ENVIRONMENTS

_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class Sandbox(Strict):
    """What one run of model-written code may use (runtime/environments/sandbox.py)."""

    cpu_seconds: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, gt=0)
    wall_seconds: float = Field(default=10.0, gt=0)
    disk_mb: int = Field(default=16, gt=0)
    output_chars: int = Field(default=4000, gt=0)
    # namespaces: user + network + mount namespaces and rlimits; rlimits: the limits alone, for
    # machines that permit no user namespaces (the network and filesystem are then not isolated)
    isolation: Literal["namespaces", "rlimits"] = "namespaces"


class Environment(Strict):
    """Where a multi-turn episode's tools come from and the bounds it runs within."""

    name: str
    args: dict[str, Any] = {}
    workers_per_node: int = Field(default=4, gt=0)
    max_turns: int = Field(default=4, gt=0)
    # default: grpo.max_response_tokens (what is left of the episode's budget bounds it too)
    max_turn_tokens: int | None = Field(default=None, gt=0)
    # default: grpo.max_prompt_tokens + grpo.max_response_tokens, the longest sequence the plan
    # sizes the trainer for; the tokens after the opening prompt are at most
    # grpo.max_response_tokens either way
    max_episode_tokens: int | None = Field(default=None, gt=0)
    turn_rewards: bool = False
    call_timeout_s: float = Field(default=30.0, gt=0)
    episode_timeout_s: float = Field(default=300.0, gt=0)
    sandbox: Sandbox = Sandbox()

    @field_validator("name")
    @classmethod
    def _a_class(cls, name: str) -> str:
        if name.startswith("builtin:"):
            short = name.removeprefix("builtin:")
            if short not in BUILTIN_ENVIRONMENTS:
                raise PydanticCustomError(
                    "environment",
                    "no shipped environment named '{name}' (shipped: {known}); or name your own "
                    "as module:Class",
                    {"name": short, "known": ", ".join(BUILTIN_ENVIRONMENTS)},
                )
        elif not _CLASS.fullmatch(name):
            raise PydanticCustomError(
                "environment",
                "'{name}' is neither builtin:<name> ({known}) nor module:Class (an OpenEnv "
                "Environment, e.g. mypkg.envs:LookupEnv)",
                {"name": name, "known": ", ".join(BUILTIN_ENVIRONMENTS)},
            )
        return name

    @property
    def builtin(self) -> bool:
        return self.name.startswith("builtin:")

    def episode_tokens(self, grpo: Any) -> int:
        """The tokens an episode may hold, its opening prompt included."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return grpo.max_prompt_tokens + grpo.max_response_tokens


def env_words(recipe: Any) -> str:
    """The plan's line on a multi-turn run (empty for a single-turn one)."""
    env = getattr(recipe, "env", None)
    if env is None:
        return ""
    sandbox = ""
    if env.name == "builtin:python":
        s = env.sandbox
        sandbox = (
            f"; sandbox {s.cpu_seconds:g} CPU s, {s.memory_mb} MB, {s.wall_seconds:g} s wall"
            + (", rlimits only" if s.isolation == "rlimits" else "")
        )
    return (
        f"environment {env.name}: {env.workers_per_node} CPU worker"
        f"{'' if env.workers_per_node == 1 else 's'} a node, up to {env.max_turns} turn"
        f"{'' if env.max_turns == 1 else 's'} and {env.episode_tokens(recipe.grpo)} tokens an episode, "
        f"timeouts {env.call_timeout_s:g} s a call, {env.episode_timeout_s:g} s an episode"
        f"{sandbox}"
    )
