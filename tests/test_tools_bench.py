"""The tool-use throughput bench (bench/gpu_tools.py): its tokenizer makes a random policy's turns
calls in Qwen3's format, its environment's tool takes the time asked, its figures come from the
run's records, and its whole path (`python -m runtime` on the recipe's plan) runs on the CPU."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_tools import bench_tokenizer, idle_share, summarize  # noqa: E402

from runtime.environments.api import ToolCall  # noqa: E402
from runtime.environments.host import Spec  # noqa: E402
from runtime.environments.local import LocalEnvironments  # noqa: E402
from runtime.episodes.formats import tool_format  # noqa: E402
from runtime.tasks.arith.tokenization import CHARACTERS  # noqa: E402


def test_a_random_turn_reads_as_one_call_of_the_benchs_tool_in_qwen3s_format():
    tok = bench_tokenizer(151936, CHARACTERS)
    assert len(tok) == 151936
    fmt = tool_format("qwen3", tok)
    rng = random.Random(0)
    turn = [rng.randrange(len(tok)) for _ in range(96)]
    parsed = fmt.parse(tok.decode(turn, skip_special_tokens=False))
    assert parsed.malformed is None and parsed.calls == (ToolCall("wait", {}),)
    # the characters and the chat markers are tokens of their own, as a real tokenizer's
    prompt = fmt.prompt_ids([{"role": "user", "content": "What is 3 + 4?"}], [])
    assert (
        tok.decode(prompt) == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn of the model's own characters is an answer, no call
    answer = tok("#### 7", add_special_tokens=False)["input_ids"]
    assert fmt.parse(tok.decode(answer)).calls == ()


def test_the_bench_environment_takes_its_time_a_call_and_scores_apart():
    envs = LocalEnvironments(Spec("bench.tools_env:WaitEnvironment", {"tool_s": 0.05}))

    async def episodes():
        opened = [await envs.open({"question": "q"}, seed=7) for _ in range(4)]
        start = time.perf_counter()
        steps = await asyncio.gather(*(envs.step(o.episode, ToolCall("wait", {})) for o in opened))
        took = time.perf_counter() - start
        rewards = [await envs.close(o.episode, "") for o in opened]
        await envs.shutdown()
        return opened, steps, took, rewards

    opened, steps, took, rewards = asyncio.run(episodes())
    assert [t["function"]["name"] for t in opened[0].tools] == ["wait"]
    assert [s.text for s in steps] == ["done"] * 4 and not any(s.error for s in steps)
    assert took >= 0.05  # the calls ran side by side, each its 50 ms
    assert envs.counters()["tool_s"] >= 4 * 0.05
    # the synthetic reward differs between a group's episodes (the same seed), within [0, 1)
    assert len(set(rewards)) == 4 and all(0 <= r < 1 for r in rewards)


def record(step, step_s, busy, idle_s, tool_s, calls):
    return {
        "step": step,
        "time/step_s": step_s,
        "generator/busy_share": busy,
        "episode/generator_idle_s": idle_s,
        "episode/generator_idle_share": idle_s / (busy * step_s),
        # the replica's turns in flight: its calls' time less their idle time
        "episode/sampling_s": busy * step_s - idle_s,
        "episode/tool_s": tool_s,
        "episode/tool_calls": calls,
        "episode/turns_mean": 4.0,
    }


def test_the_figures_come_from_the_measured_steps_records():
    rows = [
        record(1, 50.0, 0.2, 1.0, 40.0, 300),
        *(record(s, 4.0, 0.75, 0.5, 38.4, 384) for s in (2, 3)),
    ]
    out = summarize(rows, warmup=1, gpus=1, episodes_per_step=128)
    assert out["measured_steps"] == 2 and out["step_s"] == 4.0
    assert out["samples_per_s_per_gpu"] == 32.0
    assert out["tool_s_per_step"] == 38.4 and out["tool_calls_per_episode"] == 3.0
    assert out["tool_s_per_call"] == pytest.approx(0.1)
    # a step: 3 s in the episode call, 0.5 s of it waiting on the tools -> sampling 2.5 of 4 s
    assert out["generator_idle_share"] == pytest.approx(1 - 2.5 / 4)
    assert out["generator_idle_share_in_calls"] == pytest.approx(0.5 / 3)
    assert idle_share([{"step": 1, "time/step_s": 4.0}]) is None  # no generator figures
    # two replicas: their sampling seconds add up against twice the wall time
    two = summarize(rows, warmup=1, gpus=2, episodes_per_step=128, replicas=2)
    assert two["generator_idle_share"] == pytest.approx(1 - 2.5 / 8)


@pytest.mark.slow
def test_the_bench_runs_its_whole_path_on_the_cpu(tmp_path):
    """`--dry-cpu`: the tiny-tools recipe through `python -m runtime` with the bench's
    environment, tokenizer and settings, as the GPU run gets them (a few small steps)."""
    out = tmp_path / "tools.json"
    args = ["--dry-cpu", "--steps", "3", "--warmup", "1", "--out", str(out)]
    args += ["--work", str(tmp_path / "work"), "--set", "grpo.prompts_per_step=8"]
    args += ["--set", "trainer.profile_step=2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_tools.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["dry_cpu"]
    assert result["exit_code"] == 0 and result["measured_steps"] == 2
    assert "env.name=bench.tools_env:WaitEnvironment" in result["set_by_hand"]
    # the profiled step's summary, kept from the run's folder before the bench deletes it
    assert result["profiles"]["step_2_rank_0"]["step"] == 2
    # the random policy's turns called the tool, each call its 100 ms, between turns
    assert result["tool_calls_per_episode"] > 0 and result["turns_mean"] > 1
    assert result["tool_s_per_call"] >= 0.1
    assert result["samples_per_s_per_gpu"] > 0 and 0 <= result["generator_idle_share"] <= 1
    # each turn's seconds, and the generator's engine's own within them
    assert 0 < result["turn_engine_s"] <= result["turn_s"]
    # of the seconds waiting on the environments, opening and closing: the rest the rounds
    opening, closing = result["open_s_per_step"], result["close_s_per_step"]
    assert opening > 0 and closing > 0
    assert opening + closing < result["env_wait_s_per_step"]
