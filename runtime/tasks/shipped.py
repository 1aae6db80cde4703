"""What a task forgesky ships is made of (runtime/tasks/registry.py finds them by name)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShippedTask:
    """One task forgesky ships.

    `rows(split)`: every prompt of a split ("train", or "test": held out for evaluation), as
    {"question", "answer"} rows (the columns the recipe's dataset section names by default). `reward(prompt, completion, answer)`: its score, if the task has
    its own. `tokenizer(vocab_size)`: its tokenizer, if it has one (sized to the model's
    vocabulary where the task pads it).
    """

    name: str
    rows: Callable[[str], list[dict[str, str]]]
    reward: Callable[[str, str, str], float] | None = None
    tokenizer: Callable[[int], Any] | None = None
