"""bench/verl_grpo.py's parts that run without verl's own environment or a GPU: the parquet it
writes, its Hydra overrides, the tokenizer fix verl's prompt builder needs, and the figures it
reads from verl's step records, written here by verl's own loggers (verl 0.9.1 is in the CPU
stack; its trainers need GPUs, bench/verl_grpo.py --check-config checks the rest in verl's
environment)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import rewards  # noqa: E402
import verl_grpo  # noqa: E402


def bench_args(**given):
    """The bench's own defaults (its parser, no arguments), with `given` changed."""
    values = vars(verl_grpo.parser().parse_args([]))
    values.update(given)
    return argparse.Namespace(**values)


def as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_parquet_rows_are_one_user_message_of_the_prompt_length(tmp_path):
    import pandas as pd

    path = tmp_path / "train.parquet"
    assert verl_grpo.write_data(path, count=5, prompt_tokens=40) == 5
    frame = pd.read_parquet(path)
    assert list(frame["data_source"]) == ["builtin:arith"] * 5
    for messages in frame["prompt"]:
        assert len(messages) == 1 and messages[0]["role"] == "user"
        assert len(messages[0]["content"]) == 39  # + <bos> from the chat template: 40 tokens
    assert [e["index"] for e in frame["extra_info"]] == list(range(5))
    assert len(set(frame["prompt"].map(lambda m: m[0]["content"]))) == 5


def test_overrides_hold_the_bench_shape_and_verls_speed_settings(tmp_path):
    o = as_dict(verl_grpo.overrides(bench_args(), tmp_path))
    assert o["data.train_batch_size"] == "16" and o["actor_rollout_ref.rollout.n"] == "8"
    assert o["data.max_prompt_length"] == "207" and o["data.max_response_length"] == "512"
    assert o["actor_rollout_ref.rollout.ignore_eos"] == "True"
    assert o["actor_rollout_ref.actor.ppo_mini_batch_size"] == "16"  # one optimizer step
    assert o["actor_rollout_ref.actor.use_dynamic_bsz"] == "True"
    assert o["actor_rollout_ref.model.enable_gradient_checkpointing"] == "False"
    assert o["actor_rollout_ref.model.use_remove_padding"] == "False"  # no padding to remove
    assert o["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    assert o["actor_rollout_ref.actor.kl_loss_coef"] == "0.1"
    assert (o["actor_rollout_ref.actor.clip_ratio_low"], o["actor_rollout_ref.actor.clip_ratio_high"]) == ("0.2", "0.28")  # fmt: skip
    assert o["reward.custom_reward_function.name"] == "verl_distinct_share"
    assert Path(o["reward.custom_reward_function.path"]) == Path(rewards.__file__).resolve()
    assert "actor_rollout_ref.hybrid_engine" not in o
    # verl's fused log-prob kernels (without flash-attn its plain path loops over every token)
    assert o["actor_rollout_ref.model.use_fused_kernels"] == "True"
    assert o["actor_rollout_ref.model.fused_kernel_options.impl_backend"] == "torch"
    assert o["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"] == "36864"
    assert o["actor_rollout_ref.rollout.disable_log_stats"] == "True"  # verl's default
    stats = as_dict(verl_grpo.overrides(bench_args(vllm_stats="on"), tmp_path))
    assert stats["actor_rollout_ref.rollout.disable_log_stats"] == "False"
    assert stats["+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_LOGGING_LEVEL"] == "INFO"
    # Ray takes string values only: quoted, or Hydra composes an int
    assert stats["+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_LOG_STATS_INTERVAL"] == "'1'"
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_LOGGING_LEVEL" not in o
    # vLLM without a tokenizer: verl's server detokenizes by default, and with the arith
    # tokenizer's empty filler that re-decodes whole sequences (most likely most of the 20 s of
    # generation in a 27 s step on an H200)
    assert o["+actor_rollout_ref.rollout.engine_kwargs.vllm.skip_tokenizer_init"] == "True"
    assert "none in vLLM" in verl_grpo.differences(bench_args())["detokenization"]
    text = as_dict(verl_grpo.overrides(bench_args(detokenize="on"), tmp_path))
    assert not any("skip_tokenizer_init" in key for key in text)
    plain = as_dict(verl_grpo.overrides(bench_args(fused_kernels="off"), tmp_path))
    assert plain["actor_rollout_ref.model.use_fused_kernels"] == "False"
    assert "row by row" in verl_grpo.differences(bench_args(fused_kernels="off"))["log_probs"]


def test_one_step_off_splits_the_gpus_and_refuses_one(tmp_path, capsys):
    o = as_dict(verl_grpo.overrides(bench_args(gpus=2, policy="off"), tmp_path))
    assert o["actor_rollout_ref.hybrid_engine"] == "False"
    assert (o["trainer.n_gpus_per_node"], o["rollout.n_gpus_per_node"]) == ("1", "1")
    assert "colocate" in verl_grpo.differences(bench_args(policy="colocate-async"))["layout"]
    with pytest.raises(SystemExit) as stop:
        verl_grpo.overrides(bench_args(gpus=1, policy="off"), tmp_path)
    assert stop.value.code == 2
    assert "2 GPUs or more" in capsys.readouterr().err


def test_verls_reward_is_the_bench_reward_of_the_decoded_text():
    assert rewards.verl_distinct_share("builtin:arith", "aab", "") == pytest.approx(2 / 3)
    assert rewards.verl_distinct_share("x", "", "", extra_info={"num_turns": 2}) == 0.0


def test_im_end_names_the_last_filler_and_keeps_the_vocabulary(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from runtime.tasks.arith.tokenization import build_tokenizer

    build_tokenizer(200).save_pretrained(tmp_path)
    token_id = verl_grpo.name_chatml_end(tmp_path)
    assert token_id == 199
    assert verl_grpo.name_chatml_end(tmp_path) == 199  # once only
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert len(tokenizer) == 200
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 199
    ids = tokenizer("ab")["input_ids"]
    assert tokenizer.decode([*ids, 199, 150], skip_special_tokens=True) == "ab"


def verl_records(tmp_path, monkeypatch) -> tuple[str, str]:
    """Four steps as verl's file and console loggers write them (verl/utils/tracking.py,
    verl/utils/logger/aggregate_logger.py), the file cut mid-line as a killed run leaves it."""
    from verl.utils.logger.aggregate_logger import LocalLogger
    from verl.utils.tracking import FileLogger

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    files = FileLogger("forgesky-bench", "verl-on-1gpu")
    console = LocalLogger(print_to_console=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for step, seconds in enumerate([40.0, 9.0, 8.0, 6.0], start=1):
            data = {"timing_s/step": seconds, "timing_s/gen": seconds / 2,
                    "prompt_length/mean": 207.0, "response_length/mean": 512.0,
                    "perf/throughput": 1000.0 + step, "actor/pg_loss": -0.01}  # fmt: skip
            files.log(data, step)
            console.log(data, step)
    files.finish()
    text = path.read_text()
    return text + text.splitlines()[-1][:20], "ray init kwargs: {}\n" + printed.getvalue()


def test_step_figures_from_verls_loggers_leave_the_warmup_out(tmp_path, monkeypatch):
    file_text, console_text = verl_records(tmp_path, monkeypatch)
    from_file = verl_grpo.parse_file_log(file_text)
    from_console = verl_grpo.parse_console(console_text)
    assert [r["step"] for r in from_file] == [1, 2, 3, 4]
    assert from_console == from_file
    figures = verl_grpo.step_figures(from_file, warmup=2, completions=128, gpus=2)
    assert figures["step_times_s"] == [40.0, 9.0, 8.0, 6.0]
    assert (figures["warmup_steps"], figures["measured_steps"]) == (2, 2)
    assert figures["step_s"] == pytest.approx(7.0)
    assert figures["samples_per_s_per_gpu"] == pytest.approx(128 / 7.0 / 2)
    assert figures["tokens_per_s_per_gpu"] == pytest.approx(128 * 719 / 7.0 / 2)
    assert figures["generate_s"] == pytest.approx(3.5)
    assert figures["timings_s"] == {"timing_s/step": 7.0, "timing_s/gen": 3.5}
    assert figures["verl_throughput_tokens_per_s_per_gpu"] == pytest.approx(1003.5)


def test_a_run_without_step_records_has_no_figure():
    figures = verl_grpo.step_figures([], warmup=2, completions=128, gpus=1)
    assert figures["steps"] == 0 and figures["samples_per_s_per_gpu"] is None


def test_the_section_is_one_pairs_reads_as_a_run(tmp_path, monkeypatch):
    import pairs

    file_text, _ = verl_records(tmp_path, monkeypatch)
    figures = verl_grpo.step_figures(verl_grpo.parse_file_log(file_text), 2, 128, 1)
    out = tmp_path / "pairs.json"
    out.write_text(json.dumps({"pair1_ours": {"samples_per_s_per_gpu": 20.0, "exit_code": 0}}))
    verl_grpo.merge(out, {"exit_code": 0, "device": {}, "date": "2026-11-29", **figures},
                    "pair1_peer")  # fmt: skip
    assert pairs.next_run(json.loads(out.read_text()), pairs=3) == (2, "ours")


def test_device_run_pairs_against_verl_run_the_verl_bench_in_its_environment(tmp_path):
    root = Path(__file__).resolve().parents[1]
    tag = f"_verl{os.getpid()}"
    json_path = Path(f"/tmp/bench/pairs{tag}.json")
    env = {**os.environ, "TAG": tag, "OUT": str(tmp_path / "out"), "PAIRS_PEER": "verl"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(root / "scripts/gpu/device_run.sh"), "pairs", "--dry-run", *args],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )  # fmt: skip

    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        done = {"samples_per_s_per_gpu": 8.0, "exit_code": 0}
        json_path.write_text(json.dumps({"pair1_ours": done}))
        for args, policy in [
            (("on", "1"), "on"),
            (("off", "1"), "colocate-async"),
            (("off", "2", "--max-token-len", "8192"), "off"),
        ]:
            peer = run(*args)
            assert peer.returncode == 0, peer.stderr
            assert "pair 1, peer" in peer.stdout
            assert "/tmp/verl-env/bin/python bench/verl_grpo.py" in peer.stdout
            assert f"--gpus {args[1]} --steps 6 --warmup 2 --policy {policy} " in peer.stdout
            assert f"--section pair1_peer{' --max-token-len 8192' * (len(args) > 2)}" in (
                peer.stdout
            )
        refused = run("sft", "1")
        assert refused.returncode == 2 and "not an SFT one" in refused.stderr
    finally:
        json_path.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpus", "0"], "--gpus must be 1 or more"),
        (["--policy", "off"], "needs 2 GPUs or more"),
        (["--max-token-len", "1000"], "under twice a sequence (1438)"),
        (["actor_rollout_ref"], "Hydra overrides key=value"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, words):
    bench = Path(verl_grpo.__file__)
    done = subprocess.run(
        [sys.executable, str(bench), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and words in done.stderr


def test_detokenize_cost_times_both_kinds_of_completion(tmp_path, capsys):
    # bench/detokenize_cost.py: why verl's vLLM server detokenizing costs seconds on the
    # benches' random-weight completions (filler ids decode to nothing); the figures are the
    # host's, so only the run and what it drew are checked here
    import detokenize_cost

    out = tmp_path / "cost.json"
    assert detokenize_cost.main(["--completions", "2", "--tokens", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    kinds = result["kinds"]
    assert kinds["characters_only"]["visible_token_share"] == 1.0
    assert kinds["random_weights"]["visible_token_share"] < 0.2
    assert result["step_completions"] == 128 and result["completions_timed"] == 2
    assert all(kind["seconds"] > 0 for kind in kinds.values())
