"""The `tiny` recipe's world: a counting task, its reward and a local character tokenizer.

`SHIPPED` is what `builtin:tiny` stands for in a recipe (runtime/tasks/registry.py): its prompts,
its reward and its tokenizer. It stays light (no torch, no transformers) for reward procs;
`tokenizer()` imports transformers when called.
"""

from __future__ import annotations

from typing import Any

from runtime.tasks.shipped import ShippedTask
from runtime.tasks.tiny.task import DIGITS, TinyTask, tiny_reward

TASK = TinyTask()


def tokenizer() -> Any:
    """The tiny tokenizer: <pad>=0, <bos>=1, <eos>=2, the digits, then <unk>=13 (14 ids)."""
    from runtime.tasks.tiny.tokenization import build_tokenizer

    return build_tokenizer(DIGITS)


# Held out: the same rule shown four digits at a time (training shows three), so none of these
# prompts is ever trained on; a policy that learned to continue from the last digit solves them.
TEST = TinyTask(context=4)


def rows(split: str = "train", task: TinyTask = TASK) -> list[dict[str, str]]:
    """Every distinct prompt of a split with its answer (question/answer columns)."""
    pairs = (task if split == "train" else TEST).all_prompts()
    return [{"question": q, "answer": a} for q, a in pairs]


SHIPPED = ShippedTask("tiny", rows=rows, reward=tiny_reward, tokenizer=lambda _vocab: tokenizer())

__all__ = ["DIGITS", "SHIPPED", "TASK", "TinyTask", "rows", "tiny_reward", "tokenizer"]
