"""Spread (runtime/environments/nodes.py): the episodes over node 0's hosting and the CPU
nodes'. Here each CPU node's hosting is in this process, reached through a stand-in for its
Monarch actor (tests/test_env_nodes.py runs real nodes): which hosting an episode opens on,
that its steps and close go there, the counters summed, and a node that stops answering
dropping its episodes."""

from __future__ import annotations

import asyncio

from runtime.environments.api import ToolCall
from runtime.environments.host import Spec
from runtime.environments.local import LocalEnvironments
from runtime.environments.nodes import RemoteNode, Spread, served


def hosting(prefix: str) -> LocalEnvironments:
    return LocalEnvironments(Spec("tool_envs:ToolsEnv", {"prefix": prefix}))


class Endpoint:
    """An actor endpoint's `call_one`, run in this process; `broken`: the node is gone."""

    def __init__(self, node: Actorless, name: str) -> None:
        self.node, self.name = node, name

    async def call_one(self, *args):
        if self.node.broken:
            raise ConnectionError("node 1 stopped answering")
        return await served(self.node.hosting, self.name, *args)


class Actorless:
    """EnvironmentNode's endpoints on a hosting of this process, without Monarch."""

    def __init__(self, hosted: LocalEnvironments) -> None:
        self.hosting = hosted
        self.broken = False

    def __getattr__(self, name: str) -> Endpoint:
        return Endpoint(self, name)


def test_episodes_spread_by_workers_and_each_call_goes_where_its_episode_opened():
    node1 = Actorless(hosting("node1:"))
    remote = RemoteNode("node 1 (10.0.1.1)", node1, workers=2, call_timeout_s=5.0)
    spread = Spread(hosting("node0:"), 1, [remote])

    async def go():
        opened = [await spread.open({"key": "apple"}, seed=i) for i in range(6)]
        steps = [spread.step(o.episode, ToolCall("lookup", {"key": "apple"})) for o in opened]
        texts = [r.text for r in await asyncio.gather(*steps)]
        rewards = [await spread.close(o.episode, "17") for o in opened]
        await spread.shutdown()
        return texts, rewards

    texts, rewards = asyncio.run(go())
    # one worker on node 0, two on node 1: a third of the episodes on node 0
    assert sorted(texts) == ["node0:17"] * 2 + ["node1:17"] * 4
    assert rewards == [1.0] * 6
    counts = spread.counters()
    assert (counts["tool_calls"], counts["tool_errors"], counts["episodes_dropped"]) == (6, 0, 0)
    assert spread.open_episodes == 0


def test_a_cpu_node_that_stops_answering_drops_its_episodes_and_the_run_goes_on():
    node1 = Actorless(hosting("node1:"))
    remote = RemoteNode("node 1 (10.0.1.1)", node1, workers=2, call_timeout_s=5.0)
    spread = Spread(hosting("node0:"), 1, [remote])

    async def go():
        first, second = [await spread.open({"key": "apple"}, seed=i) for i in range(2)]
        node1.broken = True
        call = ToolCall("lookup", {"key": "apple"})
        a, b = await spread.step(first.episode, call), await spread.step(second.episode, call)
        again = await spread.step(second.episode, call)
        late = await spread.open({"key": "apple"}, seed=3)  # node 1's (1 of 2 workers' episodes)
        closed = [await spread.close(e.episode, "17") for e in (first, second, late)]
        await spread.shutdown()
        # node 1's hosting, which the run no longer reaches, still holds the episodes it
        # opened (their MCP sessions on its loop): a node's process ends with them
        await node1.hosting.shutdown()
        return a, b, again, closed

    a, b, again, closed = asyncio.run(go())
    assert a.text == "node0:17" and a.error is None
    assert (b.error, b.done, again.error) == ("crashed", True, "crashed")
    assert closed == [1.0, None, None]
    counts = spread.counters()
    assert counts["episodes_dropped"] == 2 and counts["tool_errors"] == 2
    assert counts["tool_calls"] == 3
