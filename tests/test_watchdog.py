"""The watchdog's deadlines: from the recipe's settings and what calls of a kind took."""

from __future__ import annotations

import asyncio

import pytest

from recipes import apply_overrides, load_recipe
from runtime.control.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdog(*overrides: str, places=None) -> tuple[Watchdog, Clock]:
    settings = apply_overrides(load_recipe("tiny"), list(overrides)).watchdog
    clock = Clock()
    return Watchdog(settings, places=places, clock=clock), clock


def test_a_first_call_gets_the_first_call_bound_and_later_ones_their_history():
    w, _ = watchdog("watchdog.first_call_s=900", "watchdog.factor=4", "watchdog.min_s=30")
    assert w.bound("train_step") == 900
    w.answered("trainer", "train_step", 50.0)  # the first step compiles
    w.answered("trainer", "train_step", 2.0)
    assert w.bound("train_step") == 200  # 4 x the slowest so far
    w.answered("generator0", "generate", 1.0)
    assert w.bound("generate") == 30  # never below min_s
    assert w.bound("publish") == 900  # a kind not seen yet


def test_the_silence_line_names_the_call_the_bound_and_the_last_answers():
    places = {"reference": "node 0 GPU 2"}
    w, clock = watchdog("watchdog.factor=5", "watchdog.min_s=15", places=places)
    w.answered("reference", "logprobs", 0.5)
    clock.now += 3
    w.answered("trainer", "train_step", 1.0)
    clock.now += 20
    assert w.silence("reference", "logprobs", w.bound("logprobs")) == (
        "stopped answering (node 0 GPU 2): logprobs gave no answer within 15 s (5 x the slowest "
        "of 1 earlier logprobs call, 0.5 s, at least watchdog.min_s 15 s); last answers: "
        "trainer train_step 20.0 s ago, reference logprobs 23.0 s ago"
    )
    first = w.silence("generator0", "generate", 1800)
    assert "(watchdog.first_call_s for a first generate call)" in first


def test_a_call_past_its_bound_fails_the_run_with_the_silence_line():
    from runtime.procs.failures import ActorFailure

    class Life:
        """The one RunLifecycle method the watchdog uses, with its timeout semantics."""

        async def call(self, service, awaitable, *, timeout, silence):
            try:
                return await asyncio.wait_for(awaitable, timeout)
            except TimeoutError:
                raise ActorFailure(service, silence()) from None

    w, _ = watchdog("watchdog.first_call_s=0.2")

    async def main():
        assert await w.call(Life(), "reward", "score", asyncio.sleep(0, result=7)) == 7
        with pytest.raises(ActorFailure) as info:
            await w.call(Life(), "reward", "publish", asyncio.sleep(5))
        return str(info.value)

    line = asyncio.run(main())
    assert line.startswith("reward actor failed: stopped answering: publish gave no answer")
    assert "last answers: reward score" in line


def test_bad_watchdog_settings_are_refused():
    from recipes import UserError

    for bad in ("watchdog.factor=0.5", "watchdog.min_s=0", "watchdog.first_call_s=-1"):
        with pytest.raises(UserError, match="watchdog"):
            apply_overrides(load_recipe("tiny"), [bad])
