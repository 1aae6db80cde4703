"""Rewards that fail on purpose, for the runtime's failure tests (`module:function` rewards)."""

import os
import time


def explode(prompt: str, completion: str, answer: str) -> float:
    calls = int(os.environ.get("FAULTY_REWARD_AFTER", "0"))
    explode.calls = getattr(explode, "calls", 0) + 1
    if explode.calls > calls:
        return 1 / 0
    return 0.0


def hang(prompt: str, completion: str, answer: str) -> float:
    """Answers FAULTY_REWARD_AFTER times, then never again (a stuck service that is alive)."""
    calls = int(os.environ.get("FAULTY_REWARD_AFTER", "0"))
    hang.calls = getattr(hang, "calls", 0) + 1
    if hang.calls > calls:
        time.sleep(24 * 3600)
    return 0.0
