"""A multi-turn run's episodes through the controller (tests/fake_services.py stands in for the
generator and trainer): their environments are the recipe's worker processes, started with the
run and stopped with it; a worker lost mid-run drops its episodes (counted) and the run goes on;
losing every worker ends the run in one line."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_services import FakeMetrics, FakeServices
from runtime_helpers import ROOT, metrics
from runtime_helpers import finish as finish_run
from runtime_helpers import start as start_run

from recipes import apply_overrides, load_recipe, plan
from recipes.loader import validate_recipe
from runtime.control.config import RunConfig
from runtime.control.controller import Controller
from runtime.environments.workers import EnvironmentsLost, Workers
from runtime.tasks.tiny_tools import tokenizer
from runtime.tasks.tiny_tools.tokenization import call_text


@dataclass
class ToolPolicy(FakeServices):
    """A generator that has learnt tiny-tools' first half: it looks key `a` up, then answers 7.
    Each completion is one token (the recipe's env.max_turn_tokens)."""

    has_reference: bool = False
    turns: list[int] = field(default_factory=list)  # prompts per continue_tokens call

    def __post_init__(self) -> None:
        super().__post_init__()
        tok = tokenizer()
        self.call = tok(call_text("a"), add_special_tokens=False)["input_ids"]
        self.seven = tok("7", add_special_tokens=False)["input_ids"]
        self.response = tok.convert_tokens_to_ids("<tool_response>")

    async def continue_tokens(
        self, replica: int, prompts: list[list[int]], seed: int, max_new_tokens: int
    ) -> list[dict[str, Any]]:
        self.turns.append(len(prompts))
        version = self.loaded[replica]
        out = []
        for ids in prompts:
            turn = self.seven if self.response in ids else self.call
            out.append(
                {
                    "response_ids": turn,
                    "response_logprobs": [-0.5] * len(turn),
                    "policy_version": version,
                    "finish_reason": "length",
                }
            )
        return out


def config(tmp_path: Path, *overrides: str, args: dict | None = None) -> RunConfig:
    base = [
        "grpo.group_size=2",
        "grpo.prompts_per_step=4",
        "grpo.steps=3",
        "grpo.checkpoint_interval=0",
        "env.workers_per_node=2",
        *overrides,
    ]
    recipe = apply_overrides(load_recipe("tiny-tools"), base)
    if args is not None:
        data = recipe.model_dump(mode="json")
        data["env"]["args"] = args
        recipe = validate_recipe(data, "test")
    return RunConfig(recipe=recipe, plan=plan(recipe, 0), run_dir=tmp_path / "run")


async def start(cfg: RunConfig, services: ToolPolicy) -> Controller:
    controller = Controller(cfg, services, asyncio.Event())
    await controller.prepare()
    controller.metrics = FakeMetrics()
    controller.start_rollouts()
    return controller


async def finish(controller: Controller) -> None:
    """The end of a run as runtime/control/run.py has it: the rollouts, then (registered with
    the run's lifecycle) the environment workers."""
    await asyncio.wait_for(controller.stop_rollouts(), 30)
    await controller.stop_environments()


def test_a_runs_episodes_step_their_environments_in_worker_processes(tmp_path):
    cfg = config(tmp_path, "env.name=tool_envs:TinyToolsPid")
    services = ToolPolicy()
    tok = tokenizer()
    seen: list[str] = []

    async def go() -> tuple[Controller, list[int]]:
        controller = await start(cfg, services)
        workers = controller.episodes.environments
        pids = list(workers.pids)
        groups = controller.episodes.groups

        async def kept(*args):  # what the tools answered, as the trainer's tokens hold it
            out = await groups(*args)
            for gr in out:
                for tokens, mask in zip(gr.responses, gr.response_masks, strict=True):
                    seen.append(tok.decode([t for t, m in zip(tokens, mask, strict=True) if not m]))
            return out

        controller.episodes.groups = kept
        try:
            await asyncio.wait_for(controller.train(), 60)
        finally:
            await finish(controller)
        assert isinstance(workers, Workers) and workers.pids == [None, None]
        return controller, pids

    controller, pids = asyncio.run(go())
    assert controller.step == 3 and not services.failures, services.failures
    assert len(pids) == 2 and os.getpid() not in pids and None not in pids
    answered = {int(text.split("<tool_response>\n")[1].split("\n")[0]) for text in seen}
    assert answered and answered <= set(pids), (answered, pids)
    for pid in pids:  # stopped with the run
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    record = controller.metrics.records[-1]
    assert record["episode/turns_mean"] == 2.0
    assert record["episode/tool_calls"] == 8 and record["episode/tool_errors"] == 0
    assert record["episode/dropped"] == 0 and record["episode/workers_lost"] == 0
    assert 0 < record["episode/env_wait_s"] <= record["episode/generator_idle_s"]
    assert 0 < record["episode/generator_idle_share"] <= 1
    assert services.turns[:2] == [8, 8]  # every episode of a call in each turn's one call


def test_a_replicas_lanes_sample_one_calls_turns_while_anothers_tools_run(tmp_path):
    """env.batches_in_flight 2, one step off: the replica's two lanes each run an episode call,
    and turns of one are sampled while the other's episodes wait on their (slow) tools; with 1
    the calls follow one another. Either way every step trains on whole groups, and the idle
    metrics count a replica's overlapping calls once."""

    async def go(lanes: int) -> tuple[Controller, ToolPolicy, list[int]]:
        cfg = config(
            tmp_path / f"lanes{lanes}",
            "env.name=tool_envs:SlowTinyTools",
            "grpo.max_policy_age=1",
            f"env.batches_in_flight={lanes}",
            args={"seconds": 0.3},
        )
        services = ToolPolicy()
        controller = await start(cfg, services)
        assert controller.rollouts.lanes == lanes
        groups = controller.episodes.groups
        open_calls = [0]
        seen: list[int] = []  # the episode calls open at each turn
        turn = services.continue_tokens

        async def counted(*args):
            open_calls[0] += 1
            try:
                return await groups(*args)
            finally:
                open_calls[0] -= 1

        async def watched(*args):
            seen.append(open_calls[0])
            return await turn(*args)

        controller.episodes.groups = counted
        services.continue_tokens = watched
        try:
            await asyncio.wait_for(controller.train(), 60)
        finally:
            await finish(controller)
        return controller, services, seen

    controller, services, seen = asyncio.run(go(2))
    assert controller.step == 3 and not services.failures, services.failures
    assert max(seen) == 2, seen  # a turn sampled while the other lane's call was open
    assert services.turns.count(8) == len(services.turns)  # every turn a whole call's episodes
    records = controller.metrics.records
    # a step's record holds the episodes of the calls that ended since the last one (with two
    # lanes a step may see none end: its counts 0, no mean)
    assert {r["episode/turns_mean"] for r in records if "episode/turns_mean" in r} == {2.0}
    assert all(r["episode/dropped"] == 0 for r in records)
    assert sum(r["episode/tool_calls"] for r in records) > 0
    assert sum(r["episode/sampling_s"] for r in records) > 0
    for r in records:
        assert r["episode/sampling_s"] >= 0 and r["episode/generator_idle_s"] >= 0
        if "episode/generator_idle_share" in r:
            assert 0 <= r["episode/generator_idle_share"] <= 1
    controller, services, seen = asyncio.run(go(1))
    assert controller.step == 3 and not services.failures, services.failures
    assert set(seen) == {1}, seen


def test_a_worker_lost_mid_run_drops_its_episodes_and_the_run_goes_on(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "crash").touch()  # the first lookup ends its worker (once)
    cfg = config(
        tmp_path,
        "env.name=tool_envs:FragileTinyTools",
        "grpo.steps=2",
        args={"flags": str(flags)},
    )
    services = ToolPolicy()

    async def go() -> Controller:
        controller = await start(cfg, services)
        try:
            await asyncio.wait_for(controller.train(), 60)
        finally:
            await finish(controller)
        return controller

    controller = asyncio.run(go())
    assert controller.step == 2 and not services.failures, services.failures
    records = controller.metrics.records
    lost = sum(r["episode/workers_lost"] for r in records)
    dropped = sum(r["episode/dropped"] for r in records)
    assert lost >= 1 and dropped >= 1 and sum(r["episode/dropped_groups"] for r in records) >= 1
    assert records[-1]["episode/tool_errors"] == 0  # the fresh worker serves what follows


def test_losing_every_worker_ends_the_run_in_one_line(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "crash").touch()  # a lookup ends its worker, and no worker can start again
    cfg = config(
        tmp_path,
        "env.name=tool_envs:FragileTinyTools",
        args={"flags": str(flags), "once": False},
    )
    services = ToolPolicy()

    async def go() -> Controller:
        controller = await start(cfg, services)
        try:
            async with asyncio.timeout(60):
                while not services.failures:
                    await asyncio.sleep(0.05)
        finally:
            controller.stopping.set()
            await finish(controller)
        return controller

    controller = asyncio.run(go())
    (failure,) = services.failures
    assert isinstance(failure, EnvironmentsLost) and controller.step == 0
    line = str(failure)
    assert "\n" not in line
    assert line.startswith(
        "environment actor failed: every environment worker is lost (2 of 2, each failed to "
        "start 3 times in a row); the last: environment tool_envs:FragileTinyTools: building it"
    )
    assert "RuntimeError: the lookup table is gone" in line


@pytest.mark.parametrize(
    ("override", "words"),
    [("env.name=tool_envs:CannotBuild", "no database here")],
)
def test_an_environment_the_workers_cannot_host_ends_the_start_in_one_line(
    tmp_path, override, words
):
    cfg = config(tmp_path, override)

    async def go() -> None:
        controller = Controller(cfg, ToolPolicy(), asyncio.Event())
        try:
            await controller.prepare()
        finally:
            await controller.stop_environments()

    with pytest.raises(EnvironmentsLost) as info:
        asyncio.run(go())
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_a_tiny_tools_run_steps_its_episodes_in_workers_and_leaves_nothing(tmp_path, nothing_left):
    run_dir = tmp_path / "run"
    proc = start_run(["--recipe", "tiny-tools", "--run-dir", str(run_dir), "--set", "grpo.steps=3"])
    code, out = finish_run(proc, timeout=600)
    assert code == 0, out
    nothing_left(out, proc.pid)  # the environment workers too
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["episode/tool_calls"] > 0 and r["episode/workers_lost"] == 0 for r in rows)
    assert all(0 < r["episode/generator_idle_share"] < 1 for r in rows)


@pytest.mark.slow
def test_losing_every_environment_worker_ends_a_run_in_one_line(tmp_path, nothing_left):
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "crash").touch()
    recipe = yaml.safe_load((ROOT / "recipes/catalog/tiny-tools.yaml").read_text())
    recipe["name"] = "tiny-tools-fragile"
    recipe["env"].update(
        name="tool_envs:FragileTinyTools", args={"flags": str(flags), "once": False}
    )
    path = tmp_path / "fragile.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = start_run(["--recipe", str(path), "--run-dir", str(tmp_path / "run")])
    code, out = finish_run(proc, timeout=600)
    assert code == 1, out
    failed = [line for line in out.splitlines() if "every environment worker is lost" in line]
    assert failed == [
        "forgesky: environment actor failed: every environment worker is lost (2 of 2, each "
        "failed to start 3 times in a row); the last: environment tool_envs:FragileTinyTools: "
        "building it with env.args "
        + json.dumps({"flags": str(flags), "once": False})[:80]
        + " raised RuntimeError: the lookup table is gone"
    ], out
    nothing_left(out, proc.pid)


@pytest.mark.slow
def test_an_environment_that_cannot_be_built_ends_the_run_before_any_service(
    tmp_path, nothing_left
):
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "broken").touch()
    recipe = yaml.safe_load((ROOT / "recipes/catalog/tiny-tools.yaml").read_text())
    recipe["name"] = "tiny-tools-broken"
    recipe["env"].update(name="tool_envs:FragileTinyTools", args={"flags": str(flags)})
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = start_run(["--recipe", str(path), "--run-dir", str(tmp_path / "run")])
    code, out = finish_run(proc, timeout=600)
    assert code == 1, out
    assert "starting environment workers" in out
    assert "starting services" not in out  # the workers start first: no service was started
    assert sum("the lookup table is gone" in line for line in out.splitlines()) == 1, out
    nothing_left(out, proc.pid)
