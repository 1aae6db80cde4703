"""Environments hosted beside the generator (runtime/environments): OpenEnv environments in real
worker processes and in-process, with tools that answer, raise, hang and kill their worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from runtime.environments.api import ToolCall
from runtime.environments.host import EnvironmentProblem, Host, Spec
from runtime.environments.local import LocalEnvironments
from runtime.environments.workers import EnvironmentsLost, Workers

TOOLS = Spec("tool_envs:ToolsEnv")


def run(coro):
    return asyncio.run(coro)


async def _workers(spec=TOOLS, count=2, **kw) -> Workers:
    envs = Workers(spec, count, **kw)
    await envs.start()
    return envs


def test_an_episode_through_a_worker_gives_tools_results_and_the_reward():
    async def go():
        envs = await _workers(count=1)
        try:
            opening = await envs.open({"key": "pear"}, seed=0)
            names = [t["function"]["name"] for t in opening.tools]
            assert names == ["lookup", "slow", "boom", "die", "segv", "pid"]
            lookup = opening.tools[0]["function"]
            assert lookup["parameters"]["properties"]["key"]["type"] == "string"
            assert lookup["description"] == "The value stored under a key."
            got = await envs.step(opening.episode, ToolCall("lookup", {"key": "pear"}))
            assert (got.text, got.error, got.done) == ("4", None, False)
            assert await envs.close(opening.episode, "4") == 1.0
            other = await envs.open({"key": "apple"}, seed=1)
            assert await envs.close(other.episode, "4") == 0.0
            return envs.counters()
        finally:
            await envs.shutdown()

    counters = run(go())
    assert counters["tool_calls"] == 1 and counters["tool_errors"] == 0
    assert counters["episodes_dropped"] == 0 and counters["workers_lost"] == 0


def test_malformed_calls_are_error_observations_never_exceptions():
    async def go():
        envs = await _workers(count=1)
        try:
            ep = (await envs.open({}, seed=0)).episode
            unknown = await envs.step(ep, ToolCall("search", {"q": "x"}))
            missing = await envs.step(ep, ToolCall("lookup", {}))
            wrong_type = await envs.step(ep, ToolCall("slow", {"seconds": "soon"}))
            not_a_dict = await envs.step(ep, ToolCall("lookup", ["apple"]))  # type: ignore[arg-type]
            after = await envs.step(ep, ToolCall("lookup", {"key": "apple"}))
            reward = await envs.close(ep, "17")
            return unknown, missing, wrong_type, not_a_dict, after, reward, envs.counters()
        finally:
            await envs.shutdown()

    unknown, missing, wrong_type, not_a_dict, after, reward, counters = run(go())
    assert unknown.error == "unknown_tool" and "lookup" in unknown.text and not unknown.done
    assert missing.error == "malformed" and "'key' is a required property" in missing.text
    assert wrong_type.error == "malformed" and "seconds" in wrong_type.text
    assert not_a_dict.error == "malformed"
    # the episode goes on after each: same worker, same environment
    assert (after.text, after.error, reward) == ("17", None, 1.0)
    assert counters["tool_calls"] == 5 and counters["tool_errors"] == 4
    assert counters["episodes_dropped"] == 0


def test_a_tool_that_raises_is_an_error_observation_and_the_episode_goes_on():
    async def go():
        envs = await _workers(count=1)
        try:
            ep = (await envs.open({"key": "apple"}, seed=0)).episode
            raised = await envs.step(ep, ToolCall("boom", {}))
            after = await envs.step(ep, ToolCall("lookup", {"key": "apple"}))
            return raised, after, await envs.close(ep, "17"), envs.counters()
        finally:
            await envs.shutdown()

    raised, after, reward, counters = run(go())
    assert raised.error == "raised" and "boom went the tool" in raised.text
    assert after.text == "17" and reward == 1.0
    assert counters["tool_errors"] == 1 and counters["workers_lost"] == 0


def test_a_slow_tool_holds_only_its_own_episode_on_a_shared_worker():
    async def go():
        envs = await _workers(count=1)
        try:
            slow_ep = (await envs.open({}, seed=0)).episode
            fast_ep = (await envs.open({}, seed=1)).episode
            slow = asyncio.ensure_future(envs.step(slow_ep, ToolCall("slow", {"seconds": 8})))
            await asyncio.sleep(0.2)  # the slow call is in the worker first
            fast = await envs.step(fast_ep, ToolCall("lookup", {"key": "pear"}))
            still_running = not slow.done()
            return fast, still_running, await slow, envs.counters()
        finally:
            await envs.shutdown()

    fast, still_running, slow, counters = run(go())
    assert fast.text == "4" and still_running  # answered while the other call still ran
    assert slow.text == "waited 8.0" and counters["tool_s"] >= 8


def test_a_hung_tool_times_out_its_worker_is_replaced_and_its_episodes_dropped():
    async def go():
        envs = await _workers(count=2, call_timeout_s=1.0)
        try:
            a = (await envs.open({}, seed=0)).episode  # worker 0
            b = (await envs.open({}, seed=1)).episode  # worker 1
            c = (await envs.open({}, seed=2)).episode  # worker 0, beside a
            pid_a = (await envs.step(a, ToolCall("pid", {}))).text
            pid_b = (await envs.step(b, ToolCall("pid", {}))).text
            assert (await envs.step(c, ToolCall("pid", {}))).text == pid_a != pid_b
            # a's tool hangs while b's slow tool (other worker) finishes undisturbed
            hung, slow_b = await asyncio.gather(
                envs.step(a, ToolCall("slow", {"seconds": 60})),
                envs.step(b, ToolCall("slow", {"seconds": 0.3})),
            )
            c_next = await envs.step(c, ToolCall("lookup", {"key": "apple"}))
            rewards = [await envs.close(x, "17") for x in (a, b, c)]
            await envs.ready()  # the replacement of a's worker
            d = (await envs.open({}, seed=3)).episode  # on the fresh worker or worker 1
            d_pid = (await envs.step(d, ToolCall("pid", {}))).text
            return hung, slow_b, c_next, rewards, pid_a, d_pid, envs.pids, envs.counters()
        finally:
            await envs.shutdown()

    hung, slow_b, c_next, rewards, pid_a, d_pid, pids, counters = run(go())
    assert hung.error == "timeout" and hung.done and "1 s" in hung.text
    assert slow_b.error is None and slow_b.text == "waited 0.3"
    assert c_next.error == "crashed" and c_next.done  # c shared the killed worker
    assert rewards == [None, 1.0, None]
    assert str(pid_a) not in [str(p) for p in pids] and all(pids)  # replaced
    assert d_pid != pid_a
    assert counters["workers_lost"] == 1 and counters["episodes_dropped"] == 2


@pytest.mark.parametrize("tool", ["die", "segv"])
def test_a_crashed_worker_drops_its_episodes_and_is_restarted(tool):
    async def go():
        envs = await _workers(count=1)
        try:
            ep = (await envs.open({}, seed=0)).episode
            before = envs.pids[0]
            crashed = await envs.step(ep, ToolCall(tool, {}))
            again = await envs.step(ep, ToolCall("lookup", {"key": "apple"}))
            reward = await envs.close(ep, "17")
            fresh = await envs.open({}, seed=1)
            answer = await envs.step(fresh.episode, ToolCall("lookup", {"key": "apple"}))
            return before, crashed, again, reward, answer, envs.pids[0], envs.counters()
        finally:
            await envs.shutdown()

    before, crashed, again, reward, answer, after, counters = run(go())
    assert crashed.error == "crashed" and crashed.done
    assert again.error == "crashed" and reward is None
    assert answer.text == "17" and after not in (None, before)
    assert counters["workers_lost"] == 1 and counters["episodes_dropped"] == 1


def test_a_worker_killed_from_outside_is_replaced():
    async def go():
        envs = await _workers(count=1)
        try:
            ep = (await envs.open({}, seed=0)).episode
            os.kill(envs.pids[0], signal.SIGKILL)
            result = await envs.step(ep, ToolCall("slow", {"seconds": 5}))
            fresh = await envs.open({}, seed=1)
            answer = await envs.step(fresh.episode, ToolCall("lookup", {"key": "pear"}))
            return result, answer, envs.counters()
        finally:
            await envs.shutdown()

    result, answer, counters = run(go())
    assert result.error == "crashed" and answer.text == "4"
    assert counters["workers_lost"] == 1


def test_an_episode_past_its_time_is_dropped_without_killing_its_worker():
    async def go():
        envs = await _workers(count=1, call_timeout_s=30, episode_timeout_s=0.5)
        try:
            ep = (await envs.open({}, seed=0)).episode
            cut = await envs.step(ep, ToolCall("slow", {"seconds": 3}))
            other = await envs.open({}, seed=1)
            return cut, await envs.close(ep, "17"), other, envs.counters()
        finally:
            await envs.shutdown()

    cut, reward, other, counters = run(go())
    assert cut.error == "timeout" and reward is None
    assert counters["workers_lost"] == 0 and counters["episodes_dropped"] == 1


def test_workers_that_cannot_start_end_the_run_in_one_line():
    async def go():
        envs = Workers(Spec("tool_envs:CannotBuild"), 2, max_failed_starts=2)
        try:
            await envs.start()
        finally:
            await envs.shutdown()

    with pytest.raises(EnvironmentsLost) as e:
        run(go())
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("environment actor failed: every environment worker is lost (2 of 2")
    assert "RuntimeError: no database here" in line


def test_losing_every_worker_while_running_ends_the_run():
    """Workers that die and then cannot start again: the calls after that raise, in one line."""

    async def go(tmp_flag: str):
        envs = await _workers(Spec("tool_envs:ToolsEnv", {}), count=1, max_failed_starts=1)
        try:
            ep = (await envs.open({}, seed=0)).episode
            envs.spec = Spec("tool_envs:CannotBuild")  # what a restart now finds
            crashed = await envs.step(ep, ToolCall("die", {}))
            assert crashed.error == "crashed"
            for _ in range(200):
                if envs.fatal is not None:
                    break
                await asyncio.sleep(0.05)
            await envs.open({}, seed=1)
        finally:
            await envs.shutdown()

    with pytest.raises(EnvironmentsLost, match="every environment worker is lost"):
        run(go(""))


def test_in_process_hosting_converts_the_same_way():
    async def go():
        envs = LocalEnvironments(TOOLS, call_timeout_s=0.5)
        try:
            ep = (await envs.open({"key": "pear"}, seed=0)).episode
            ok = await envs.step(ep, ToolCall("lookup", {"key": "pear"}))
            raised = await envs.step(ep, ToolCall("boom", {}))
            unknown = await envs.step(ep, ToolCall("nope", {}))
            reward = await envs.close(ep, "4")
            slow = (await envs.open({}, seed=1)).episode
            timed_out = await envs.step(slow, ToolCall("slow", {"seconds": 2}))
            return ok, raised, unknown, reward, timed_out, await envs.close(slow, "17"), envs
        finally:
            await envs.shutdown()

    ok, raised, unknown, reward, timed_out, dropped, envs = run(go())
    assert ok.text == "4" and raised.error == "raised" and unknown.error == "unknown_tool"
    assert reward == 1.0 and timed_out.error == "timeout" and dropped is None
    assert envs.counters()["episodes_dropped"] == 1


def test_the_reward_without_score_is_the_last_observations():
    async def go():
        envs = LocalEnvironments(Spec("tool_envs:RewardOnStep"))
        ep = (await envs.open({}, seed=0)).episode
        step = await envs.step(ep, ToolCall("done", {"value": 3}))
        return step, await envs.close(ep, "")

    step, reward = run(go())
    assert (step.text, step.reward, step.done, reward) == ("3", 0.25, True, 0.25)


def test_an_mcp_episode_holds_one_session_from_open_to_close_and_a_step_override_is_kept():
    """An MCPEnvironment's episode connects its MCP client once and steps on the host's loop;
    a class that overrides step (RewardOnStep, above) keeps the step path, plain ones too."""
    from tool_envs import CountedSessions, RewardOnStep, ToolsEnv

    from runtime.environments.sessions import awaitable
    from runtime.tasks.tiny_tools.environment import LookupEnvironment

    assert awaitable(ToolsEnv) and awaitable(CountedSessions)
    assert not awaitable(RewardOnStep) and not awaitable(LookupEnvironment)
    host = Host(Spec("tool_envs:CountedSessions"))
    try:
        host.probe()
        start = CountedSessions.connects
        host.open("a", {"key": "pear"}, 0)
        texts = [host.step("a", "lookup", {"key": "pear"})["text"] for _ in range(3)]
        slow = host.step("a", "slow", {"seconds": 0.01})
        assert texts == ["4"] * 3 and slow["text"] == "waited 0.01" and slow["error"] is None
        assert CountedSessions.connects == start + 1 and CountedSessions.open_now == 1
        assert host.close("a", "4") == 1.0 and CountedSessions.open_now == 0
        host.open("b", {}, 1)
        host.drop("b")  # a dropped episode's session ends without the host waiting for it
        for _ in range(100):
            if CountedSessions.open_now == 0:
                break
            time.sleep(0.05)
        assert CountedSessions.open_now == 0 and CountedSessions.connects == start + 2
    finally:
        host.stop()


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("tool_envs:NotAnEnvironment", "not an OpenEnv Environment subclass"),
        ("tool_envs:Missing", "cannot import it: AttributeError"),
        ("no_such_module:Env", "cannot import it: ModuleNotFoundError"),
        ("tool_envs:BadName", "tool 'has space': a tool name is 1-64 letters"),
        ("tool_envs:CannotBuild", "raised RuntimeError: no database here"),
    ],
)
def test_environments_that_cannot_be_hosted_say_why_in_one_line(target, words):
    with pytest.raises(EnvironmentProblem) as e:
        Host(Spec(target)).probe()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_worked_example_of_docs_tools_md_runs(tmp_path, monkeypatch):
    """The environment docs/tools.md shows, as written there, hosted in a worker."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    example = text.split("## A worked example", 1)[1].split("```python\n", 1)[1].split("```")[0]
    (tmp_path / "myenvs").mkdir()
    (tmp_path / "myenvs" / "__init__.py").write_text("")
    (tmp_path / "myenvs" / "lookup.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))

    async def go():
        envs = await _workers(Spec("myenvs.lookup:LookupEnv", {"table": "capitals"}), count=1)
        try:
            ep = await envs.open({"question": "Capital of Peru?", "answer": "Lima"}, seed=0)
            got = await envs.step(ep.episode, ToolCall("lookup", {"key": "Peru"}))
            return ep.tools, got, await envs.close(ep.episode, f"It is {got.text}.")
        finally:
            await envs.shutdown()

    tools, got, reward = run(go())
    assert [t["function"]["name"] for t in tools] == ["lookup"]
    assert (got.text, reward) == ("Lima", 1.0)


def test_start_environments_builds_the_hosting_a_recipe_names():
    from recipes.environment import Environment
    from recipes.errors import UserError
    from runtime.environments.start import start_environments

    section = Environment(
        name="builtin:python", call_timeout_s=20, sandbox={"isolation": "rlimits", "cpu_seconds": 2}
    )

    async def go():
        envs = await start_environments(section, in_process=True)
        ep = await envs.open({"answer": "#### 6"}, seed=0)
        got = await envs.step(ep.episode, ToolCall("python", {"code": "print(2 * 3)"}))
        return envs, got, await envs.close(ep.episode, "#### 6")

    envs, got, reward = run(go())
    assert (got.text, reward) == ("6\n", 1.0)
    assert envs.call_timeout_s == 20 and envs.host.spec.args["limits"]["cpu_seconds"] == 2
    with pytest.raises(UserError, match=r"^env.name tool_envs:CannotBuild: environment .* raised"):
        run(start_environments(Environment(name="tool_envs:CannotBuild"), in_process=True))


def test_a_start_stopped_midway_leaves_no_worker_behind():
    """A run stopped while its workers start (they are still building their environment)."""
    import psutil

    from recipes.environment import Environment
    from runtime.environments.start import start_environments

    section = Environment(name="tool_envs:SlowToBuild", workers_per_node=2)

    def workers() -> list[psutil.Process]:
        servers = [
            p
            for p in psutil.Process().children()
            if "multiprocessing.forkserver" in " ".join(p.cmdline())
        ]
        return [w for s in servers for w in s.children()]

    async def go():
        task = asyncio.ensure_future(start_environments(section))
        async with asyncio.timeout(60):
            while len(workers()) < 2:
                await asyncio.sleep(0.05)
        started = workers()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return started

    started = run(go())
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert not alive and len(gone) == 2
