"""The `tiny` recipe's world: a counting task, its reward and a local character tokenizer.

Importing this package registers prompt source "tiny" (dataset.path "builtin:tiny") and reward
"tiny" ("builtin:tiny"). It stays light (no torch, no transformers) for reward procs;
`tokenizer()` imports transformers when called.
"""

from __future__ import annotations

from typing import Any

from runtime.tasks.tiny.task import DIGITS, TinyTask, tiny_reward

TASK = TinyTask()


def tokenizer() -> Any:
    """The tiny tokenizer: <pad>=0, <bos>=1, <eos>=2, then the digits (13 ids)."""
    from runtime.tasks.tiny.tokenization import build_tokenizer

    return build_tokenizer(DIGITS)


def rows(task: TinyTask = TASK) -> list[dict[str, str]]:
    """Every distinct prompt of the task with its answer (question/answer columns)."""
    return [{"question": q, "answer": a} for q, a in task.all_prompts()]


def _prompt_source(dataset: Any, *, seed: int = 0) -> Any:
    from runtime.tasks.data import PromptSource

    return PromptSource.for_dataset(rows(), dataset, seed=seed)


def _register() -> None:
    from runtime.tasks.data import register_prompt_source
    from runtime.tasks.rewards import register_reward

    register_reward("tiny", tiny_reward)
    register_prompt_source("tiny", _prompt_source)


_register()

__all__ = ["DIGITS", "TASK", "TinyTask", "rows", "tiny_reward", "tokenizer"]
