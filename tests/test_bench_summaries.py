"""The GPU benchmark's derived numbers, from metric records (no GPU needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_grpo  # noqa: E402


def test_idle_share_uses_the_controllers_busy_share():
    records = [{"generator/busy_share": 0.8}, {"generator/busy_share": 0.6}]
    assert gpu_grpo.idle_share(records, generate_s=1.0, step_s=2.0) == pytest.approx(0.3)


def test_idle_share_falls_back_to_one_call_per_step():
    assert gpu_grpo.idle_share([{}], generate_s=1.0, step_s=4.0) == pytest.approx(0.75)
    assert gpu_grpo.idle_share([{}], generate_s=None, step_s=4.0) is None
    # a generation longer than the step (overlap) is not a negative idle share
    assert gpu_grpo.idle_share([{}], generate_s=5.0, step_s=4.0) == 0.0


def test_mfu_counts_every_trainer_gpu_once():
    rows = [
        {"service": "generator", "replica": 0, "node": 0, "gpus": [0]},
        {"service": "trainer", "replica": 0, "node": 0, "gpus": [2, 3]},
        {"service": "trainer", "replica": 0, "node": 1, "gpus": [0, 1]},
        {"service": "reward", "replica": 0, "node": 0, "gpus": []},
    ]
    assert gpu_grpo.trainer_gpus(rows) == 4
    # a CPU-only plan still divides by one
    assert gpu_grpo.trainer_gpus([{"service": "trainer", "node": 0, "gpus": []}]) == 1


def test_merge_keeps_sections_and_refuses_another_gpu(tmp_path):
    device = {"name": "NVIDIA H200", "gpus": 4}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"device": device, "versions": {}, "grpo_3gpu": {"step_s": 3.0}}))
    b.write_text(json.dumps({"device": device, "versions": {}, "trl": {"step_s": 8.8}}))
    c.write_text(json.dumps({"device": {"name": "NVIDIA H100"}, "trl": {}}))
    merged = gpu_grpo.merge(tmp_path / "out.json", [a, b])
    assert merged["grpo_3gpu"] == {"step_s": 3.0} and merged["trl"] == {"step_s": 8.8}
    with pytest.raises(SystemExit, match="NVIDIA H100, not NVIDIA H200"):
        gpu_grpo.merge(tmp_path / "out.json", [a, c])


def test_compare_sets_ratios_to_trl_and_standalone_vllm():
    result = {
        "standalone_vllm": {
            "recipe": "qwen3-1.7b",
            "generation_tokens_per_s": 20000.0,
            "sequences_per_call": 128,
        },
        "trl": {"samples_per_s_per_gpu": 10.0},
        "one_gpu": {
            "records": [],
            "recipe": "qwen3-1.7b",
            "samples_per_s_per_gpu": 15.0,
            "sequences_per_generate_call": 128,
            "generation_tokens_per_s": 19000.0,
        },
        "two_steps_a_call": {
            "records": [],
            "recipe": "qwen3-1.7b",
            "samples_per_s_per_gpu": 20.0,
            "sequences_per_generate_call": 256,
            "generation_tokens_per_s": 30000.0,
        },  # fmt: skip
        "eight_b": {
            "records": [],
            "recipe": "qwen3-8b",
            "samples_per_s_per_gpu": 4.0,
            "generation_tokens_per_s": 9000.0,
        },  # fmt: skip
    }
    gpu_grpo.compare(result)
    assert result["one_gpu"]["samples_per_s_to_trl"] == pytest.approx(1.5)
    assert result["one_gpu"]["generation_to_standalone"] == pytest.approx(0.95)
    # a bigger batch than vLLM alone ran is not compared with it
    assert result["two_steps_a_call"]["samples_per_s_to_trl"] == pytest.approx(2.0)
    assert result["two_steps_a_call"]["generation_to_standalone"] is None
    # other models are not compared with a 1.7B baseline
    assert "samples_per_s_to_trl" not in result["eight_b"]
    assert "generation_to_standalone" not in result["eight_b"]


def test_a_committed_result_resummarizes_to_its_own_numbers():
    path = Path(__file__).resolve().parents[1] / "bench/results/gpu_grpo_h200x4.json"
    committed = json.loads(path.read_text())
    again = json.loads(path.read_text())
    for section in again.values():
        if isinstance(section, dict) and "records" in section:
            del section["mfu"], section["step_s"]
    gpu_grpo.resummarize(again)
    for name in ("grpo_3gpu", "grpo_qwen3_8b_4gpu"):
        for key in ("mfu", "step_s", "samples_per_s_per_gpu", "trainer_gpus"):
            assert again[name][key] == pytest.approx(committed[name][key]), (name, key)
    assert committed["grpo_qwen3_8b_4gpu"]["trainer_gpus"] == 2


def test_trainer_configs_parse_with_defaults_and_refuse_unknown_keys():
    assert gpu_grpo.parse_config("ac=0,compile=1") == {"ac": 0, "compile": 1, "mb": 8192}
    assert gpu_grpo.parse_config("mb=16384")["mb"] == 16384
    for bad in ("ac=yes", "remat=1", "mb"):
        with pytest.raises(SystemExit, match="expected ac=0|1"):
            gpu_grpo.parse_config(bad)


def test_attention_flops_of_qwen3_1p7b_at_2048_tokens():
    from recipes import load_recipe
    from runtime.services import model_spec

    spec = model_spec(load_recipe("qwen3-1.7b"))
    # 28 layers x 16 heads x 128 dims: 6 * 28 * 2048 * 2048 per token, ~7 % of 6 * 1.72e9
    per_token = gpu_grpo.attention_flops_per_token(spec, 2048)
    assert per_token == 6 * 28 * 2048 * 16 * 128
    assert 0.06 < per_token / (6 * spec.num_params()) < 0.08


def test_trainer_mode_times_real_train_steps_on_cpu():
    import argparse

    args = argparse.Namespace(
        recipe="tiny", device="cpu", sequences=4, seq_len=24, response_share=0.5, warmup=1,
        steps=2, config=["ac=1,compile=0,mb=48", "ac=0,compile=0,mb=96"],
    )  # fmt: skip
    section = gpu_grpo.run_train(args)
    assert [c["config"] for c in section["configs"]] == args.config
    for c in section["configs"]:
        assert c["tokens"] == 96 and c["step_s"] > 0
        assert c["tokens_per_s"] == pytest.approx(96 / c["step_s"])
        assert c["mfu"] is None  # no peak FLOP/s for a CPU
