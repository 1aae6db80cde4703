"""Rewards the benchmarks give runs on random weights, where a task's own reward is 0 for every
completion (nothing is ever correct), so every advantage is 0 and no weight would move.

A recipe names one as `bench.rewards:NAME` (with the checkout's root on the Python path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def distinct_share(prompt: str, completion: Sequence[Any], answer: str) -> float:
    """The share of distinct characters in the completion (one token a character with the
    shipped arith tokenizer; TRL's side of a side-by-side passes token ids): differs between
    completions of random weights, so GRPO's advantages are not all 0 and training changes the
    weights."""
    return len(set(completion)) / max(len(completion), 1)


def distinct_share_of_ids(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """`distinct_share` of each completion's token ids, as TRL calls a reward (a module-level
    function: TRL's async trainer scores in a process of its own and pickles it)."""
    return [distinct_share("", ids, "") for ids in completion_ids]


def verl_distinct_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> float:
    """`distinct_share` of a decoded completion, as verl calls a custom reward function
    (`reward.custom_reward_function.path=bench/rewards.py`, `name=verl_distinct_share`; verl
    loads it from the file by path): the characters ours scores, not TRL's token ids."""
    return distinct_share("", solution_str, ground_truth)
