"""`tiny-tools`: a task the tiny model can solve only by calling its tool.

Each episode has its own table of secret digits, one per key (a to c), drawn from the episode's
seed. The prompt names a key; the tool `lookup(key)` returns that key's digit; the answer must
be that digit. Nothing in the prompt tells the digit: a policy that does not call the tool is
right 1 time in 10 at best by guessing. Solving it takes two turns: the call, then the answer
copied from the tool's result. Reward: 0.2 for looking the prompt's key up, plus 0.8 times the
answer's prefix credit (environment.py): 1.0 only for the right digit after the right lookup,
about 0.08 for guessing.

`environment:LookupEnvironment` is an OpenEnv Environment, hosted by the run's environment
workers like any other (env.name `builtin:tiny-tools`); this package does not import it, so that
reading the task's rows and tokenizer does not import OpenEnv. `tokenizer()` is the task's own:
Qwen3's tool-call format with the few pieces the task uses as single tokens.
"""

from __future__ import annotations

from typing import Any

from runtime.tasks.shipped import ShippedTask
from runtime.tasks.tiny_tools.tokenization import KEYS


def tokenizer() -> Any:
    from runtime.tasks.tiny_tools.tokenization import build_tokenizer

    return build_tokenizer()


def rows(split: str = "train") -> list[dict[str, str]]:
    """One prompt per key; the answer depends on the episode's table, not on the row."""
    return [{"question": key, "answer": ""} for key in KEYS]


SHIPPED = ShippedTask("tiny-tools", rows=rows, tokenizer=lambda _vocab: tokenizer())

__all__ = ["KEYS", "SHIPPED", "rows", "tokenizer"]
