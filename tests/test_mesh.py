"""runtime.procs.mesh: proc meshes pinned per proc, and Monarch failures as one line (real procs)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from monarch.actor import Actor, endpoint
from runtime_helpers import alive

from runtime.procs.failures import ActorFailure, failure_of, lost_a_peer, ranked, root_cause
from runtime.procs.host import host_gpu_ids
from runtime.procs.mesh import (
    PROBE_SUFFIX,
    ServiceMesh,
    given_name,
    proc_env,
    threads_per_proc,
)

# Procs unpickle the actor classes below by module name, so they need this directory on their path.
TEST_ENV = {"PYTHONPATH": str(Path(__file__).parent)}


def test_threads_share_the_cores_among_busy_procs():
    assert threads_per_proc(5, cores=2) == 1
    assert threads_per_proc(3, cores=16) == 5
    assert threads_per_proc(1, cores=8) == 8
    assert threads_per_proc(0, cores=8) == 8


def test_proc_env_pins_gpus_threads_and_identity(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = proc_env("trainer", 1, (2, 3), 4, {"HF_HOME": "/data/hf"}, procs=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert env["FORGESKY_SERVICE"] == "trainer" and env["FORGESKY_PROC_RANK"] == "1"
    assert env["FORGESKY_PROCS"] == "2"
    assert env["HF_HOME"] == "/data/hf"
    # A CPU proc on a GPU host sees no GPU at all.
    assert proc_env("reward", 0, (), 1)["CUDA_VISIBLE_DEVICES"] == ""


def test_plan_gpus_map_through_the_hosts_visible_gpus(monkeypatch):
    # A run started with CUDA_VISIBLE_DEVICES=2,3 numbers those GPUs 0 and 1 in its plan.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert proc_env("generator", 0, (1,), 1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert proc_env("trainer", 0, (0, 1), 1)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert proc_env("reward", 0, (), 1)["CUDA_VISIBLE_DEVICES"] == ""
    assert host_gpu_ids((0,), "GPU-a1b2, GPU-c3d4") == ["GPU-a1b2"]
    with pytest.raises(ValueError, match="uses GPU 2 but CUDA_VISIBLE_DEVICES=2,3 lists 2"):
        proc_env("trainer", 0, (2,), 1)


def test_an_mps_client_names_its_gpus_as_the_runs_daemon_numbers_them(monkeypatch):
    # The run's MPS daemon sees the run's GPUs (CUDA_VISIBLE_DEVICES=2,3) as 0 and 1 and its
    # clients name them so: a client given "3" would find no GPU (a run beside another on a
    # shared host, 2026-11-27).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    mps = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/forgesky-mps-x/pipe"}
    assert proc_env("generator", 0, (1,), 1, mps)["CUDA_VISIBLE_DEVICES"] == "1"
    assert proc_env("trainer", 0, (0, 1), 1, mps)["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(ValueError, match="uses GPU 2 but CUDA_VISIBLE_DEVICES=2,3 lists 2"):
        proc_env("trainer", 0, (2,), 1, mps)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert proc_env("generator", 0, (1,), 1, mps)["CUDA_VISIBLE_DEVICES"] == "1"


def test_gpus_go_through_the_gpus_argument_not_env():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        proc_env("generator", 0, (0,), 1, {"CUDA_VISIBLE_DEVICES": "5"})


class Scorer(Actor):
    @endpoint
    async def score(self, x: float) -> float:
        return _divide(x, 0.0)

    @endpoint
    async def ping(self) -> None:
        return None


def _divide(a: float, b: float) -> float:
    return a / b


class RankedScorer(Actor):
    """A service of several procs whose endpoints say which proc raised (`ranked`)."""

    @endpoint
    @ranked
    async def score(self, x: float) -> float:
        return _divide(x, 0.0) if os.environ["FORGESKY_PROC_RANK"] == "1" else x


@pytest.mark.slow
def test_each_proc_starts_with_its_gpus_and_thread_budget():
    async def scenario():
        mesh = await ServiceMesh.spawn(
            "generator", 2, gpus=[(0,), (1, 2)], env={"FORGESKY_TEST": "yes"}, threads=1
        )
        try:
            infos = await mesh.describe(with_torch=True)
        finally:
            await mesh.stop()
        return mesh, infos

    mesh, infos = asyncio.run(scenario())
    assert [i["env"]["CUDA_VISIBLE_DEVICES"] for i in infos] == ["0", "1,2"]
    assert [i["env"]["FORGESKY_PROC_RANK"] for i in infos] == ["0", "1"]
    assert all(i["env"]["OMP_NUM_THREADS"] == "1" for i in infos)
    assert all(i["env"]["FORGESKY_TEST"] == "yes" for i in infos)
    assert all(i["torch_threads"] == 1 for i in infos)
    assert sorted(mesh.pids) == sorted(i["pid"] for i in infos)
    assert os.getpid() not in mesh.pids
    assert not [p for p in mesh.pids if psutil.pid_exists(p) and alive(p)]


class FailingRanks(Actor):
    """A service of several procs whose `step` fails on each as `plan[rank]` says, after a
    delay: torch's out-of-memory error (what a trainer rank raises, texts from 2 x H200), the
    error of a gloo collective whose peer left, or an answer."""

    @endpoint
    @ranked
    async def step(self, plan: dict[str, tuple[float, str]]) -> str:
        delay, outcome = plan[os.environ["FORGESKY_PROC_RANK"]]
        await asyncio.sleep(delay)
        if outcome == "out of memory":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 188.00 MiB. GPU 0 has a total capacity "
                "of 139.80 GiB of which 19.94 MiB is free."
            )
        if outcome == "peer left":
            raise RuntimeError(
                "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                "Connection closed by peer [127.0.0.1]:21915. This is typically caused by a "
                "remote worker crashing."
            )
        return outcome


async def _score_raises(service: str, procs: int, actor: type) -> BaseException:
    """What calling `score` on every proc of a fresh `service` mesh of `actor` raises, each
    proc called on its own as the controller calls the trainer's ranks (`each_rank`: a slice
    of the mesh a call, in which Monarch numbers every proc 0 of 1)."""
    from runtime.control.services import each_rank

    mesh = await ServiceMesh.spawn(service, procs, env=TEST_ENV, threads=1)
    try:
        scorer = mesh.spawn_actor(actor)
        with pytest.raises(Exception) as raised:
            await each_rank(scorer, "score", 1.0)
    finally:
        await mesh.stop()
    return raised.value


@pytest.mark.slow
def test_root_cause_names_the_exception_and_the_users_line():
    error = asyncio.run(_score_raises("reward", 1, Scorer))
    line = _divide.__code__.co_firstlineno + 1
    assert (
        root_cause(error)
        == f"ZeroDivisionError: float division by zero (in test_mesh.py:{line} _divide)"
    )


@pytest.mark.slow
def test_a_failure_on_one_proc_of_several_names_that_proc_and_its_gpu():
    """Trainer rank 1 of 2 raises (on a GPU: out of memory, which torch reports as its
    process sees the GPU, "GPU 0"): the run's line names proc 1/2 and the GPU it was given."""
    from runtime.procs.lifecycle import RunLifecycle

    error = asyncio.run(_score_raises("trainer", 2, RankedScorer))
    line = _divide.__code__.co_firstlineno + 1
    cause = root_cause(error)
    assert cause == (
        f"ZeroDivisionError: float division by zero (in test_mesh.py:{line} _divide) (proc 1/2)"
    )
    life = RunLifecycle()
    life.places["trainer"] = "node 0 GPUs 0,1"
    assert life.failure_line(ActorFailure("trainer", cause)).endswith(
        "(proc 1/2) (on node 0 GPUs 0,1)"
    )
    life.proc_places["trainer"] = ["node 0 GPU 0", "node 0 GPU 1"]
    failure = ActorFailure("trainer", cause)
    assert life.failure_line(failure) == f"trainer actor failed: {cause} (on node 0 GPU 1)"


@pytest.mark.slow
@pytest.mark.monarch_faults
def test_root_cause_of_a_killed_proc_says_how_it_died(monarch_faults):

    async def scenario():
        mesh = await ServiceMesh.spawn("reward", 1, env=TEST_ENV, threads=1)
        scorer = mesh.spawn_actor(Scorer)
        await scorer.ping.call_one()
        os.kill(mesh.pids[0], signal.SIGKILL)
        try:
            with pytest.raises(Exception) as raised:
                await asyncio.wait_for(_forever(scorer), 60)
        finally:
            await mesh.stop()
        return raised.value

    error = asyncio.run(scenario())
    killed = "process killed by SIGKILL (proc 0/1)"
    # The call's own error says how the proc died, or (a loaded host: Monarch's query of the
    # proc's agent timed out first) that it likely crashed, which the run's lifecycle takes as
    # a cue to wait for the proc's ending (tests/test_peer_grace.py).
    if "likely crashed" in root_cause(error):
        assert lost_a_peer(failure_of(error, "reward")), root_cause(error)
    else:
        assert root_cause(error) == killed
    # Monarch reports each mesh on the dead proc: its own logger, the service's probe, the
    # scorer; all of them before this test ends
    meshes = {"logger", "reward" + PROBE_SUFFIX, "reward"}
    reports = monarch_faults.wait_for_meshes(meshes)
    assert {given_name(r.mesh_name) for r in reports} == meshes, [r.mesh_name for r in reports]
    assert any(root_cause(f.report()) == killed for f in reports), reports


async def _forever(scorer) -> None:
    while True:
        await scorer.ping.call_one()
        await asyncio.sleep(0.1)


@pytest.mark.slow
def test_the_rank_out_of_memory_is_named_though_its_peers_collective_failed_first():
    """Rank 1 runs out of memory while rank 0 waits for it in a collective, which then fails:
    whichever error reaches the controller first, `each_rank` raises rank 1's. A collective
    error alone is raised once the other ranks have had `grace` s to fail, not later."""
    from runtime.control.services import each_rank

    async def raised(ranks, plan, grace: float = 5.0) -> tuple[str, float]:
        began = time.monotonic()
        with pytest.raises(Exception) as error:
            await each_rank(ranks, "step", plan, grace=grace)
        return root_cause(error.value), time.monotonic() - began

    async def scenario():
        mesh = await ServiceMesh.spawn("trainer", 2, env=TEST_ENV, threads=1)
        try:
            ranks = mesh.spawn_actor(FailingRanks)
            assert await each_rank(ranks, "step", {"0": (0.0, "a"), "1": (0.0, "b")}) == ["a", "b"]
            collective_first = await raised(
                ranks, {"0": (0.0, "peer left"), "1": (1.5, "out of memory")}
            )
            memory_first = await raised(
                ranks, {"0": (1.5, "peer left"), "1": (0.0, "out of memory")}
            )
            alone = await raised(ranks, {"0": (0.0, "peer left"), "1": (8.0, "c")}, grace=1.0)
        finally:
            await mesh.stop()
        return collective_first, memory_first, alone

    collective_first, memory_first, alone = asyncio.run(scenario())
    for cause, _ in (collective_first, memory_first):
        assert cause.startswith("OutOfMemoryError: CUDA out of memory."), cause
        assert cause.endswith("(proc 1/2)"), cause
    assert 1.5 <= collective_first[1] < 5.0, collective_first  # rank 1's error, not the grace
    assert memory_first[1] < 1.5, memory_first  # a cause first: no wait for the others
    assert alone[0].startswith("RuntimeError: [/__w/pytorch"), alone
    assert alone[0].endswith("(proc 0/2)") and 1.0 <= alone[1] < 5.0, alone
