"""Rewards that fail on purpose, for the runtime's failure tests (`module:function` rewards)."""

import os


def explode(prompt: str, completion: str, answer: str) -> float:
    calls = int(os.environ.get("FAULTY_REWARD_AFTER", "0"))
    explode.calls = getattr(explode, "calls", 0) + 1
    if explode.calls > calls:
        return 1 / 0
    return 0.0
