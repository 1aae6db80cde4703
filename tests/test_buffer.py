import asyncio

import pytest

from runtime.control.buffer import Group, RolloutBuffer


def group(version: int, pid: int = 0) -> Group:
    return Group(pid, "p", "a", [1], [[2]], [[-0.1]], ["x"], policy_version=version)


def run(coro):
    return asyncio.run(coro)


def test_take_returns_oldest_fresh_groups_first():
    async def go():
        buf = RolloutBuffer(max_policy_age=1, capacity=8)
        for i in range(3):
            await buf.put(group(0, pid=i))
        got = await buf.take(2, trainer_version=0)
        return [g.prompt_id for g in got], len(buf)

    assert run(go()) == ([0, 1], 1)


def test_stale_groups_are_dropped_not_trained_on():
    async def go():
        buf = RolloutBuffer(max_policy_age=1, capacity=8)
        await buf.put(group(0, pid=0))
        await buf.put(group(2, pid=1))
        await buf.put(group(3, pid=2))
        got = await buf.take(2, trainer_version=3)
        return [g.prompt_id for g in got], buf.dropped_stale

    assert run(go()) == ([1, 2], 1)


def test_take_waits_for_enough_fresh_groups_and_full_buffer_blocks_producers():
    async def go():
        buf = RolloutBuffer(max_policy_age=0, capacity=2)
        await buf.put(group(0, 0))
        await buf.put(group(0, 1))
        producer = asyncio.create_task(buf.put(group(1, 2)))
        await asyncio.sleep(0.01)
        assert not producer.done()  # full
        # trainer moved to version 1: both version-0 groups are stale, which frees room
        taker = asyncio.create_task(buf.take(1, trainer_version=1))
        got = await asyncio.wait_for(taker, 1)
        await asyncio.wait_for(producer, 1)
        return [g.prompt_id for g in got], buf.dropped_stale

    assert run(go()) == ([2], 2)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RolloutBuffer(max_policy_age=0, capacity=0)


def test_restore_keeps_order_beyond_capacity_and_full_waiters_are_visible():
    async def go():
        buf = RolloutBuffer(max_policy_age=0, capacity=1)
        buf.restore([group(0, 0), group(0, 1)])
        producer = asyncio.create_task(buf.put(group(0, 2)))
        await asyncio.sleep(0.01)
        blocked = buf.full_waiters(producer)
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        return [g.prompt_id for g in buf.groups()], blocked, buf.full_waiters(producer)

    assert run(go()) == ([0, 1], True, False)
