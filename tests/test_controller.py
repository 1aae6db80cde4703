"""The controller without a cluster: the rollout loops, the freshness rule, stops, checkpoints
and resumes, driven against services in plain Python (tests/fake_services.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from fake_services import FakeMetrics, FakeServices

from recipes import apply_overrides, load_recipe, plan
from runtime.control.batching import collate_groups, train_batch
from runtime.control.buffer import Group
from runtime.control.config import RunConfig
from runtime.control.controller import Controller, publish_stage, room_warning
from runtime.tasks.data import PromptSource

ROWS = [{"question": f"prompt {i}", "answer": str(i)} for i in range(40)]


def config(tmp_path: Path, *overrides: str) -> RunConfig:
    base = ["grpo.group_size=4", "grpo.prompts_per_step=4", "grpo.steps=8", *overrides]
    recipe = apply_overrides(load_recipe("tiny"), base)
    return RunConfig(recipe=recipe, plan=plan(recipe, 0), run_dir=tmp_path)


def source(cfg: RunConfig) -> PromptSource:
    return PromptSource(ROWS, prompt_template="{question}", seed=cfg.recipe.grpo.seed)


async def run(
    cfg: RunConfig, services: FakeServices, stop_after: int | None = None, eval_prompts=None
) -> Controller:
    """A run to its end (or a stop after `stop_after` steps), as runtime/control/run.py does."""
    stopping = asyncio.Event()
    controller = Controller(cfg, services, stopping)
    await controller.prepare(source(cfg), eval_prompts=eval_prompts)
    metrics = controller.metrics = FakeMetrics()
    if stop_after is not None:
        real_log = metrics.log

        def log(step, record):
            real_log(step, record)
            if step >= stop_after:
                stopping.set()

        metrics.log = log
    controller.start_rollouts()
    await asyncio.wait_for(controller.train(), 60)
    await asyncio.wait_for(controller.stop_rollouts(), 60)
    if controller.step > (controller.resumed_from or 0) or stopping.is_set():
        await controller.save_checkpoint()
    assert not services.failures, services.failures
    return controller


@pytest.mark.parametrize("age", [0, 1, 2])
@pytest.mark.parametrize("generators", [1, 2])
def test_no_group_is_trained_on_staler_than_max_policy_age(tmp_path, age, generators):
    cfg = config(tmp_path, f"grpo.max_policy_age={age}", f"layout.generator.replicas={generators}")
    services = FakeServices(generators=generators, jitter=0.01, load_s=0.005, seed=age)
    controller = asyncio.run(run(cfg, services))
    assert controller.step == 8 and len(services.trained_prompts) == 8
    assert max(services.staleness) <= age
    # the freshness rule holds calls back instead of generating groups that would be dropped
    assert controller.rollouts.buffer.dropped_stale == 0
    rows = controller.metrics.records
    assert all(r["policy/staleness_mean"] <= age for r in rows)
    if age > 0:  # rollouts overlap training: some groups were one version old
        assert any(s > 0 for s in services.staleness)


def test_each_load_takes_its_own_versions_manifest_from_the_publish(tmp_path):
    # the publish's `direct` entry goes to every generator with the load of that version,
    # the first version's at the start included: no receiver fetches it from the store
    cfg = config(tmp_path, "grpo.max_policy_age=1", "layout.generator.replicas=2")
    services = FakeServices(generators=2, jitter=0.01, load_s=0.005)
    asyncio.run(run(cfg, services))
    assert {(r, v) for r, v, _ in services.handed} == {(r, v) for r in (0, 1) for v in range(9)}
    assert all(direct == version for _, version, direct in services.handed)


def test_ready_time_spans_the_publish_and_the_slowest_load(tmp_path):
    """sync/ready_s: from a step's end until every generator holds its version, so at least
    the slowest load; logged from the switch that ended last."""
    cfg = config(tmp_path, "grpo.max_policy_age=0")
    services = FakeServices(generators=2, load_s=0.05)
    rows = asyncio.run(run(cfg, services)).metrics.records
    assert rows[0]["sync/ready_s"] == 0.0  # step 1 logs before any switch ended
    assert all(r["sync/ready_s"] >= 0.05 for r in rows[1:]), [r["sync/ready_s"] for r in rows]


def test_a_lora_versions_load_is_logged_in_parts_from_the_slowest_generator(tmp_path):
    cfg = config(tmp_path, "grpo.max_policy_age=0")
    services = FakeServices(generators=2, adapter_s=0.25)
    rows = asyncio.run(run(cfg, services)).metrics.records
    # generator 1 builds its adapter in 0.5 s, generator 0 in 0.25: the step waits on the first
    assert all(r["time/adapter_build_s"] == 0.5 for r in rows), rows
    assert all(r["time/adapter_activate_s"] == 0.125 for r in rows)
    assert all(r["time/receive_manifest_s"] == 0.05 for r in rows)  # the slowest's receipt
    assert not any("time/adapter_build_s" in r for r in asyncio.run(
        run(config(tmp_path / "full", "grpo.max_policy_age=0"), FakeServices(generators=2))
    ).metrics.records)  # fmt: skip


def test_lock_step_trains_every_prompt_once_in_order(tmp_path):
    cfg = config(tmp_path, "grpo.max_policy_age=0")
    services = FakeServices()
    asyncio.run(run(cfg, services))
    assert set(services.staleness) == {0}
    trained = [pid for step in services.trained_prompts for pid in step]
    assert trained == [p.id for p in source(cfg).take(32)]


def test_stale_groups_are_dropped_when_taken(tmp_path):
    """Groups a checkpoint saved that are too old for the resumed trainer (here: made three
    versions old by hand) are dropped, counted, and never trained on."""
    from runtime.control import checkpoint
    from runtime.control.state import ControllerState

    cfg = config(tmp_path, "grpo.max_policy_age=1", "grpo.steps=5")
    asyncio.run(run(cfg, FakeServices()))
    ckpt = checkpoint.latest(cfg.checkpoint_dir)
    state = ControllerState.load(ckpt.path)
    state.buffer = [group(prompt_id=90 + i, version=2, responses=((5,),) * 4) for i in range(3)]
    partial = checkpoint.begin(cfg.checkpoint_dir, ckpt.step)  # rewritten, committed again
    for f in ckpt.path.iterdir():
        if f.name != checkpoint.MARKER:
            shutil.copy(f, partial / f.name)
    state.save(partial)
    checkpoint.commit(cfg.checkpoint_dir, partial, ckpt.step)

    services = FakeServices()
    resumed = asyncio.run(run(config(tmp_path, "grpo.max_policy_age=1", "grpo.steps=7"), services))
    assert resumed.resumed_from == 5 and resumed.step == 7
    assert resumed.rollouts.buffer.dropped_stale == 3
    assert resumed.metrics.records[-1]["buffer/dropped_stale"] == 3
    assert all(pid < 90 for step in services.trained_prompts for pid in step)
    assert max(services.staleness) <= 1


def test_a_stop_while_calls_are_in_flight_ends_promptly(tmp_path):
    cfg = config(tmp_path, "grpo.max_policy_age=1", "grpo.steps=100")
    services = FakeServices(generators=2, generate_s=0.2, reference_s=0.1)

    async def main():
        stopping = asyncio.Event()
        controller = Controller(cfg, services, stopping)
        await controller.prepare(source(cfg))
        controller.metrics = FakeMetrics()
        controller.start_rollouts()
        train = asyncio.ensure_future(controller.train())
        while services.version < 2 or not services.in_flight:
            await asyncio.sleep(0.01)
        stopping.set()  # a generate call is running now
        await asyncio.wait_for(train, 5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(controller.stop_rollouts(), 5)
        return controller, loop.time() - start

    controller, seconds = asyncio.run(main())
    assert controller.step < 100 and seconds < 2
    assert all(t.done() for t in controller.rollouts._tasks)
    assert not services.failures


def test_a_checkpoint_with_groups_in_flight_resumes_where_it_stood(tmp_path):
    """Stop at step 3 with calls in flight and groups queued; a new controller resumes from
    the checkpoint: the saved groups are trained on first, and no prompt is skipped or seen
    twice."""
    cfg = config(tmp_path, "grpo.max_policy_age=1", "grpo.steps=8")
    first = FakeServices(generate_s=0.02, reference_s=0.03)

    stopped = asyncio.run(run(cfg, first, stop_after=3))
    assert stopped.step == 3
    saved = stopped.rollouts.buffer.groups()
    assert saved, "the stop left no groups queued: the test would show nothing"
    # the trainer's state in the checkpoint, then a new run on the same directory
    second = FakeServices(generate_s=0.02, reference_s=0.03)
    resumed = asyncio.run(run(cfg, second))
    assert resumed.resumed_from == 3 and resumed.step == 8
    next_trained = [pid for step in second.trained_prompts for pid in step]
    assert next_trained[: len(saved)] == [gr.prompt_id for gr in saved]
    everything = [pid for step in first.trained_prompts + second.trained_prompts for pid in step]
    assert len(everything) == len(set(everything)) == 32
    order = [p.id for p in source(cfg).take(40)]
    assert everything == order[: len(everything)]  # one generator: calls take prompts in order


def test_a_disk_without_room_for_a_checkpoint_skips_it_and_the_run_goes_on(
    tmp_path, monkeypatch, capsys
):
    """A checkpoint the disk cannot hold (after older ones are deleted) is not started: a
    write that fills the disk half-way ends the run with nothing resumable. The run trains on
    with a warning for each skipped write, so that its end still writes the model; once the
    disk has room again the next checkpoint is written."""
    import os

    from recipes.memory import checkpoint_bytes
    from runtime.control import checkpoint

    cfg = config(tmp_path, "grpo.checkpoint_interval=2", "grpo.steps=6")
    need = checkpoint_bytes(cfg.recipe.arch)
    room = {"free": int(need * 0.5)}

    def disk(path):
        return os.statvfs_result((1, 1, 10 * need, room["free"], room["free"], 0, 0, 0, 0, 255))

    monkeypatch.setattr(checkpoint.os, "statvfs", disk)
    # what run.py says at start-up, before the services start
    assert room_warning(cfg.checkpoint_dir, need) == (
        f"forgesky: warning: {cfg.checkpoint_dir} has room for "
        f"{checkpoint.approx_size(need * 0.5).lstrip('~')} of checkpoints and one needs "
        f"{checkpoint.approx_size(need)}: checkpoints are skipped while it has no room (free "
        "that disk, or give the run a larger one: resources.disk_gb)"
    )
    controller = asyncio.run(run(cfg, FakeServices()))
    assert controller.step == 6 and checkpoint.committed(cfg.checkpoint_dir) == []
    warnings = [x for x in capsys.readouterr().err.splitlines() if "not written" in x]
    size = checkpoint.approx_size(need)
    assert len(warnings) == 3, warnings
    for step, warning in zip((2, 4, 6), warnings, strict=True):
        start = f"forgesky: warning: checkpoint of step {step} not written: {cfg.checkpoint_dir}"
        assert warning.startswith(start), warning
    assert f"has {checkpoint.approx_size(need * 0.5).lstrip('~')} free" in warnings[0]
    assert f"a checkpoint needs {size}" in warnings[0] and "resources.disk_gb" in warnings[0]
    room["free"] = 10 * need
    assert room_warning(cfg.checkpoint_dir, need) is None
    cfg = config(tmp_path, "grpo.checkpoint_interval=2", "grpo.steps=8")
    asyncio.run(run(cfg, FakeServices()))
    assert [c.step for c in checkpoint.committed(cfg.checkpoint_dir)][-1] == 8


@pytest.mark.parametrize("sharing", ["turns", "mps"])
def test_services_on_one_gpu_take_turns_unless_they_share_it_under_mps(tmp_path, capsys, sharing):
    """layout.sharing turns: a generate call, a scoring and a train step on one GPU hold its
    lock in turn (their records count the turns); mps: no lock, no turns, and the start-up
    line says the calls go at once."""
    import dataclasses

    cfg = config(tmp_path, "grpo.steps=4", f"layout.sharing={sharing}")
    on_gpu0 = tuple(
        dataclasses.replace(p, gpus=(0,)) if p.service != "reward" else p
        for p in cfg.plan.placements
    )
    assert cfg.plan.sharing == sharing
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, placements=on_gpu0))
    services = FakeServices(generate_s=0.02, reference_s=0.02)
    controller = asyncio.run(run(cfg, services))
    assert controller.step == 4
    rows = controller.metrics.records
    out = capsys.readouterr().out
    units = "generator0 + reference + trainer (node 0 GPU 0)"
    if sharing == "turns":
        assert f"services sharing a GPU take turns: {units}" in out
        assert all(r["gpu/turns_trainer"] == 1 for r in rows)
    else:
        line = "services sharing a GPU call it at once under NVIDIA MPS (layout.sharing mps)"
        assert f"{line}: {units}" in out
        assert not any(k.startswith("gpu/") for r in rows for k in r)


def test_resume_refuses_a_checkpoint_whose_parts_disagree(tmp_path):
    cfg = config(tmp_path, "grpo.max_policy_age=0", "grpo.steps=2")
    asyncio.run(run(cfg, FakeServices()))
    services = FakeServices()
    services.restore = _returns(7)
    with pytest.raises(RuntimeError, match="trainer step 7, controller step 2"):
        asyncio.run(Controller(cfg, services, asyncio.Event()).prepare(source(cfg)))


def _returns(value):
    async def call(*_):
        return value

    return call


# --- batching -------------------------------------------------------------------------------


def group(prompt_id=0, version=0, responses=((5, 6), (), (7,)), ref=True) -> Group:
    gr = Group(
        prompt_id=prompt_id,
        prompt="p",
        answer="a",
        prompt_tokens=[1, 2, 3],
        responses=[list(r) for r in responses],
        response_logprobs=[[-0.1 * (i + 1)] * len(r) for i, r in enumerate(responses)],
        texts=["x"] * len(responses),
        policy_version=version,
    )
    gr.rewards = [1.0, 0.0, 0.5][: len(responses)]
    if ref:
        gr.ref_logprobs = [[-1.0 * (i + 1)] * len(r) for i, r in enumerate(responses)]
    return gr


def test_one_collate_lays_out_tokens_and_both_logprobs():
    b = collate_groups([group(), group(prompt_id=1, responses=((8, 9, 10),))], pad_id=0)
    assert b.tokens.tolist() == [
        [1, 2, 3, 5, 6, 0],
        [1, 2, 3, 0, 0, 0],  # an empty response: prompt only
        [1, 2, 3, 7, 0, 0],
        [1, 2, 3, 8, 9, 10],
    ]
    assert b.response_mask.sum(dim=1).tolist() == [2, 0, 1, 3]
    assert b.old_logprobs[0, 3:5].tolist() == pytest.approx([-0.1, -0.1])
    assert b.old_logprobs[2, 3].item() == pytest.approx(-0.3)
    assert b.ref_logprobs[2, 3].item() == -3.0 and b.ref_logprobs[0, :3].abs().sum() == 0
    assert collate_groups([group(ref=False)], pad_id=0).ref_logprobs is None
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probs"):
        bad = group()
        bad.response_logprobs[0] = [-1.0]
        collate_groups([bad], pad_id=0)


def test_train_batch_has_group_relative_advantages_and_the_step_metrics():
    groups = [group(version=3), group(prompt_id=1, version=2)]
    batch, info = train_batch(groups, pad_id=0, group_size=3, loss="grpo", version=4)
    adv = batch["advantages"].view(2, 3)
    assert adv.mean(dim=1).abs().max() < 1e-6 and adv[0, 0] > adv[0, 2] > adv[0, 1]
    assert info["policy/staleness_mean"] == 1.5 and info["reward/mean"] == pytest.approx(0.5)
    # mean lengths: 3 prompt tokens, completions of 2, 0 and 1 tokens
    assert (info["prompt/len_mean"], info["response/len_mean"]) == (3.0, 1.0)
    dr, _ = train_batch(groups, pad_id=0, group_size=3, loss="dr_grpo", version=4)
    assert dr["advantages"].view(2, 3)[0].tolist() == pytest.approx([0.5, -0.5, 0.0])


# --- DAPO's sampling and shaping ----------------------------------------------------------------


def test_dynamic_sampling_trains_only_on_groups_that_teach_something(tmp_path):
    cfg = config(tmp_path, "grpo.loss=dapo", "grpo.max_policy_age=1", "grpo.steps=6")
    services = FakeServices(flat_every=3)  # a third of the prompts: every completion scores 0
    controller = asyncio.run(run(cfg, services))
    trained = [pid for step in services.trained_prompts for pid in step]
    assert trained and all(pid % 3 for pid in trained)
    assert all(any(a != 0 for a in step) for step in services.advantages)
    dropped = sum(r["rollout/dropped_uninformative"] for r in controller.metrics.records)
    assert dropped > 0
    assert max(services.staleness) <= 1  # dropping groups never makes the rest staler


def test_dynamic_sampling_keeps_groups_past_its_cap(tmp_path):
    """When nothing teaches (a policy that never earns a reward), each step drops at most
    (max_draws - 1) x prompts_per_step groups and then trains on what comes."""
    cfg = config(
        tmp_path,
        "grpo.loss=dapo",
        "grpo.max_policy_age=0",
        "grpo.steps=3",
        "grpo.dynamic_sampling_max_draws=2",
    )
    services = FakeServices(flat_every=1)
    controller = asyncio.run(run(cfg, services))
    assert controller.step == 3
    rows = controller.metrics.records
    assert all(r["rollout/dropped_uninformative"] <= 4 for r in rows)  # (2 - 1) x 4
    assert sum(r["rollout/dropped_uninformative"] for r in rows) >= 4


def test_overlong_punishment_and_kl_in_the_reward_shape_a_groups_rewards():
    from recipes import apply_overrides, load_recipe
    from runtime.control.rollouts import shape_rewards

    grpo = apply_overrides(
        load_recipe("tiny"),
        [
            "grpo.max_response_tokens=8",
            "grpo.overlong_buffer_tokens=4",
            "grpo.kl_beta=0.5",
            "grpo.kl_placement=reward",
            "grpo.kl_estimator=k1",
        ],
    ).grpo
    gr = group(responses=((5,) * 4, (5,) * 6, (5,) * 8))  # within the limit, in the buffer, at it
    gr.rewards = [1.0, 1.0, 1.0]
    gr.response_logprobs = [[-1.0] * 4, [-1.0] * 6, [-1.0] * 8]
    gr.ref_logprobs = [[-1.5] * 4, [-1.0] * 6, [-1.0] * 8]  # k1 = lp - ref = 0.5 a token
    shape_rewards(gr, grpo)
    assert gr.reward_parts["overlong_penalty"] == [0.0, -0.5, -1.0]
    assert gr.reward_parts["kl_penalty"] == [-0.5 * 0.5 * 4, 0.0, 0.0]
    assert gr.rewards == [1.0 - 1.0, 0.5, 0.0]


def test_truncated_completions_can_carry_no_loss():
    gr = group(responses=((5, 6), (7,), (8, 9)))
    gr.truncated = [True, False, False]
    batch, info = train_batch(
        [gr], pad_id=0, group_size=3, loss="dapo", version=0, mask_truncated=True
    )
    assert batch["loss_mask"].sum(dim=1).tolist() == [0, 1, 2]
    assert info["response/truncated_share"] == pytest.approx(1 / 3)
    plain, _ = train_batch([gr], pad_id=0, group_size=3, loss="dapo", version=0)
    assert "loss_mask" not in plain


# --- evaluation -----------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimate():
    from itertools import combinations

    from runtime.control.evaluation import pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([True] * c + [False] * (n - c), k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("generators", [1, 2])
def test_evaluation_runs_every_n_steps_and_at_the_end_on_the_version_it_names(tmp_path, generators):
    """The fake's greedy answer to prompt i is right from version i % 8 on, and one of its 4
    sampled answers is always right: pass@1 = (min(v, 7) + 1) / 8 and pass@2 = 1 - C(3,2)/C(4,2)
    tell which version each evaluation saw."""
    cfg = config(
        tmp_path,
        "eval.enabled=true",
        "eval.every=3",
        "eval.k=2",
        "eval.samples=4",
        f"layout.generator.replicas={generators}",
    )
    services = FakeServices(generators=generators, jitter=0.005, seed=generators)
    prompts = [source(cfg).prompt(i) for i in range(8)]
    controller = asyncio.run(run(cfg, services, eval_prompts=prompts))
    evals = [r for r in controller.metrics.records if "eval/pass@1" in r]
    versions = [int(r["eval/version"]) for r in evals]
    assert versions[-1] == 8 and evals[-1]["step"] == 8  # the final one joins the last record
    # the initial policy's, one after step 3 (of version 3 or, when a generator has moved on,
    # newer), one after step 6 unless it was still running when the final one superseded it
    assert versions == sorted(versions) and versions[:1] == [0] and versions[1] >= 3
    assert len(evals) in (3, 4)
    for r in evals:
        v = int(r["eval/version"])
        assert r["eval/pass@1"] == pytest.approx((min(v, 7) + 1) / 8)
        assert r["eval/pass@2"] == pytest.approx(0.5)
        assert r["eval/prompts"] == 8 and r["eval/seconds"] >= 0
    # each evaluation went through every generator replica, greedy and sampled
    assert len(services.greedy_calls) >= len(evals) * generators


def test_a_stop_with_an_evaluation_in_flight_ends_promptly(tmp_path):
    cfg = config(tmp_path, "eval.enabled=true", "eval.every=1", "grpo.steps=50")
    services = FakeServices(generate_s=0.02)
    prompts = [source(cfg).prompt(i) for i in range(8)]
    controller = asyncio.run(run(cfg, services, stop_after=3, eval_prompts=prompts))
    assert 3 <= controller.step < 50


def test_after_three_steps_a_run_names_a_layout_its_own_lengths_make_faster(capsys):
    """Controller._hint_layout: the mean lengths of this process's first three steps, one
    line then (recipes.planner.layout_hint), and nothing more after it."""
    from types import SimpleNamespace

    r = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_response_tokens=512"])
    run = SimpleNamespace(recipe=r, config=SimpleNamespace(plan=plan(r, 2, accelerator="H200")))
    run.lengths, said = [], []
    for step, prompt in zip((1, 2, 3, 4), (200.0, 207.0, 214.0, 207.0), strict=True):
        run.step = step
        Controller._hint_layout(run, {"prompt/len_mean": prompt, "response/len_mean": 512.0})
        said.append(capsys.readouterr().out)
    assert said[0] == said[1] == said[3] == ""
    assert said[2].startswith(
        "forgesky: note: at this run's mean lengths (207-token prompts, 512-token completions) "
        "layout.share trainer_reference is predicted at 2.93 s a step"
    )
    assert run.lengths is None


@pytest.mark.parametrize("outcome", ["written", "lost", "no_wait"])
def test_a_checkpoint_being_written_when_the_run_ends_early_is_committed_if_it_lands(
    tmp_path, capsys, outcome
):
    """The run failed while the checkpoint of step 2 was on its way to disk (started, not yet
    committed): at shutdown it is committed if the trainer says its files landed in time,
    else left uncommitted (a resume takes the one before); `grpo.checkpoint_finish_s=0`
    does not wait at all."""
    from runtime.control import checkpoint

    finish = "0" if outcome == "no_wait" else "30"
    cfg = config(tmp_path, "grpo.steps=2", f"grpo.checkpoint_finish_s={finish}")
    services = FakeServices()
    asked: list[tuple[float, float]] = []

    async def written_after_failure(probe_s: float, wait_s: float) -> bool:
        asked.append((probe_s, wait_s))
        return outcome == "written"

    services.written_after_failure = written_after_failure

    async def scenario() -> Controller:
        controller = Controller(cfg, services, asyncio.Event())
        await controller.prepare(source(cfg))
        controller.metrics = FakeMetrics()
        controller.step = 2
        # what the loop does after a step it checkpoints: the write starts, the commit waits
        await controller.save_checkpoint(wait=False)
        assert controller.pending_checkpoint is not None
        await controller.finish_checkpoint()  # the lifecycle's shutdown, after a failure
        return controller

    controller = asyncio.run(scenario())
    assert controller.pending_checkpoint is None
    steps = [c.step for c in checkpoint.committed(cfg.checkpoint_dir)]
    out = capsys.readouterr().out
    if outcome == "no_wait":
        assert asked == [] and steps == []
        return
    assert asked == [(5.0, 30.0)]
    assert "the checkpoint of step 2 was still in flight: waiting up to 30 s" in out
    if outcome == "written":
        assert steps == [2] and "checkpoint step 2 -> " in out
    else:
        assert steps == [] and "the checkpoint of step 2 was not finished" in out
        # left as it was: a resume ignores it and starts from the last committed one
        assert (cfg.checkpoint_dir / f"{checkpoint.step_dir_name(2)}.partial").is_dir()


def test_a_publish_records_its_staging_apart_from_its_manifest():
    # the direct paths' one stage, the store's, or several paths' summed; nothing where a
    # publish says no stage (a trainer rank other than 0)
    assert publish_stage({"seconds": 0.025, "stage_direct_s": 0.018}) == {
        "time/publish_stage_s": 0.018
    }
    both = publish_stage({"seconds": 0.5, "stage_ipc_s": 0.1, "stage_store_s": 0.3})
    assert both["time/publish_stage_s"] == pytest.approx(0.4)
    assert publish_stage({"bytes": 0, "seconds": 0.0}) == {}
