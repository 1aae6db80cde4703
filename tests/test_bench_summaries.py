"""The GPU benchmark's derived numbers, from metric records (no GPU needed)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_grpo  # noqa: E402


def test_idle_share_uses_the_controllers_busy_share():
    records = [
        {"generator/busy_share": 0.8, "time/step_s": 2.0},
        {"generator/busy_share": 0.6, "time/step_s": 2.0},
    ]
    assert gpu_grpo.idle_share(records, generate_s=1.0, step_s=2.0) == pytest.approx(0.3)


def test_idle_share_weighs_steps_by_their_length():
    # A call counts in the step it ends in: a short step with none, a long one with two.
    # 2.5 + 2 * 2.4 generating seconds in 7 wall seconds, not the mean of 0, 1.2 and 1.0.
    records = [
        {"generator/busy_share": 0.0, "time/step_s": 2.0},
        {"generator/busy_share": 2 * 2.4 / 4.0, "time/step_s": 4.0},
        {"generator/busy_share": 2.5 / 2.5, "time/step_s": 2.5},
    ]
    expected = 1 - (2.5 + 4.8) / 8.5
    assert gpu_grpo.idle_share(records, generate_s=2.4, step_s=8.5 / 3) == pytest.approx(expected)


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
            "engine": "separate",
        },
        "trl": {"samples_per_s_per_gpu": 10.0},
        "one_gpu": {
            "records": [],
            "recipe": "qwen3-1.7b",
            "engine": "in-process",
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
    # the engine of each side named: the loop's in-process engine against vLLM's own default
    assert (result["one_gpu"]["engine"], result["one_gpu"]["standalone_engine"]) == (
        "in-process",
        "separate",
    )
    # a bigger batch than vLLM alone ran is not compared with it
    assert result["two_steps_a_call"]["samples_per_s_to_trl"] == pytest.approx(2.0)
    assert result["two_steps_a_call"]["generation_to_standalone"] is None
    # other models are not compared with a 1.7B baseline
    assert "samples_per_s_to_trl" not in result["eight_b"]
    assert "generation_to_standalone" not in result["eight_b"]


def test_a_file_with_a_verl_run_beside_ours_tables_both_and_compares_only_ours():
    # pairs against verl: the peer's section has records and steps but no recipe; printing the
    # table after pair 2's run of ours failed on it (KeyError 'recipe'), and the run was stamped
    # failed although its six steps were done
    path = (
        Path(__file__).resolve().parents[1]
        / "bench/results/gpu_h200_2026-12-01d-verl/pairs_verl1on.json"
    )
    result = json.loads(path.read_text())
    for section in result.values():
        if isinstance(section, dict):
            section.pop("generation_to_standalone", None)
    result["standalone_vllm"] = {"recipe": "qwen3-1.7b", "generation_tokens_per_s": 26000.0,
                                 "sequences_per_call": 128}  # fmt: skip
    gpu_grpo.compare(result)
    assert result["pair1_ours"]["generation_to_standalone"] == pytest.approx(
        result["pair1_ours"]["generation_tokens_per_s"] / 26000.0
    )
    assert "generation_to_standalone" not in result["pair1_peer"]
    rows = gpu_grpo.table(result).splitlines()
    names = [row.split("|")[1].strip() for row in rows[2:]]
    assert names == ["pair1_ours", "pair2_ours", "pair1_peer", "standalone_vllm"]
    verl = next(row for row in rows if row.startswith("| pair1_peer "))
    assert "verl verl.trainer.main_ppo" in verl and "| 27.01 | 4.7 |" in verl


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


def test_a_lora_runs_adapter_parts_resummarize_from_its_records():
    # qwen3-8b-lora's versions written in place: the write's mean over the steps that had one
    path = (
        Path(__file__).resolve().parents[1]
        / "bench/results/gpu_h200_2026-11-29-cpus-sync-tools/gpu_grpo_qwen3-8b-lora.json"
    )
    committed = json.loads(path.read_text())
    again = json.loads(path.read_text())
    del again["grpo"]["adapter_write_s"]
    gpu_grpo.resummarize(again)
    parts = {k: v for k, v in again["grpo"].items() if k.startswith(("adapter_", "receive_"))}
    assert parts == {"adapter_write_s": pytest.approx(committed["grpo"]["adapter_write_s"])}


def test_a_publish_s_staging_is_summarized_where_the_records_have_it():
    # runs before time/publish_stage_s have no such figure; a run with it, the measured
    # steps' mean
    path = (
        Path(__file__).resolve().parents[1]
        / "bench/results/gpu_h200_2026-11-29-cpus-sync-tools/gpu_grpo_qwen3-8b-lora.json"
    )
    again = json.loads(path.read_text())
    gpu_grpo.resummarize(again)
    assert "publish_stage_s" not in again["grpo"]
    for i, record in enumerate(again["grpo"]["records"]):
        record["time/publish_stage_s"] = 0.01 * (i + 1)
    gpu_grpo.resummarize(again)
    warmup = len(again["grpo"]["records"]) - again["grpo"]["measured_steps"]
    staged = [0.01 * (i + 1) for i in range(warmup, len(again["grpo"]["records"]))]
    assert again["grpo"]["publish_stage_s"] == pytest.approx(sum(staged) / len(staged))


def test_longer_prompts_reach_the_asked_mean_within_the_recipes_cap():
    # qwen3-8b at 1024-token prompts (the 4K work of docs/benchmarks.md): the filler takes the
    # arith prompts (~200 tokens) to 1,024 on average; those past the cap are cut to it
    recipe = gpu_grpo.load("qwen3-8b", 6, 3072, [], prompt_tokens_mean=1024)
    lengths = [len(p) for p in gpu_grpo.prompt_tokens(recipe, count=128)]
    assert 1000 <= sum(lengths) / len(lengths) <= 1024 and max(lengths) == 1024
    assert recipe.dataset.prompt_template.endswith(
        gpu_grpo.load("qwen3-8b", 6, 3072, []).dataset.prompt_template
    )
    with pytest.raises(SystemExit, match="max_prompt_tokens"):
        gpu_grpo.load("qwen3-8b", 6, 3072, [], prompt_tokens_mean=2048)


def test_trainer_configs_parse_with_defaults_and_refuse_unknown_keys():
    assert gpu_grpo.parse_config("ac=0,compile=1") == {
        "ac": 0, "compile": 1, "mb": 8192, "head": 1
    }  # fmt: skip
    assert gpu_grpo.parse_config("compile=1,head=0")["head"] == 0
    assert gpu_grpo.parse_config("mb=16384")["mb"] == 16384
    for bad in ("ac=yes", "remat=1", "mb"):
        with pytest.raises(SystemExit, match="expected ac=0|1"):
            gpu_grpo.parse_config(bad)


def test_attention_flops_of_qwen3_1p7b_at_2048_tokens():
    from recipes import load_recipe
    from runtime.backends.build import model_spec

    spec = model_spec(load_recipe("qwen3-1.7b"))
    # 28 layers x 16 heads x 128 dims: 6 * 28 * 2048 * 2048 per token, ~7 % of 6 * 1.72e9
    per_token = gpu_grpo.attention_flops_per_token(spec, 2048)
    assert per_token == 6 * 28 * 2048 * 16 * 128
    assert 0.06 < per_token / (6 * spec.num_params()) < 0.08


def test_training_flops_count_the_output_projection_on_response_positions_only():
    from recipes import load_recipe
    from runtime.backends.build import model_spec

    spec = model_spec(load_recipe("qwen3-1.7b"))  # tied: 151936 x 2048 embedding = projection
    head = 151936 * 2048
    body = spec.num_params() - head
    whole = gpu_grpo.training_flops(spec, sequences=2, seq_len=100, response_len=100)
    prompt_only = gpu_grpo.training_flops(spec, sequences=2, seq_len=100, response_len=0)
    assert whole["dense"] == 6 * (body + head) * 200
    assert prompt_only["dense"] == 6 * body * 200
    assert whole["attention"] == gpu_grpo.attention_flops_per_token(spec, 100) * 200

    untied = model_spec(load_recipe("llama3.1-8b"))
    assert not untied.tie_embeddings
    flops = gpu_grpo.training_flops(untied, sequences=1, seq_len=10, response_len=5)
    v_d = untied.vocab_size * untied.dim
    assert flops["dense"] == 6 * ((untied.num_params() - 2 * v_d) * 10 + v_d * 5)


def test_trainer_mode_times_real_train_steps_on_cpu():
    import argparse

    args = argparse.Namespace(
        recipe="tiny", device="cpu", sequences=4, seq_len=24, response_share=0.5, warmup=1,
        steps=2, config=["ac=1,compile=0,mb=48", "ac=0,compile=0,mb=96"], profile=False,
    )  # fmt: skip
    section = gpu_grpo.run_train(args)
    assert [c["config"] for c in section["configs"]] == args.config
    for c in section["configs"]:
        assert c["tokens"] == 96 and c["step_s"] > 0
        assert c["tokens_per_s"] == pytest.approx(96 / c["step_s"])
        assert c["mfu"] is None  # no peak FLOP/s for a CPU


def test_trainer_profile_splits_a_real_step_by_kind_of_op_on_cpu():
    import argparse

    args = argparse.Namespace(
        recipe="tiny", device="cpu", sequences=4, seq_len=24, response_share=0.5, warmup=1,
        steps=1, config=["ac=0,compile=0,mb=96"], profile=True,
    )  # fmt: skip
    profile = gpu_grpo.run_train(args)["configs"][0]["profile"]
    assert profile["kernel_s"] > 0 and profile["gpu_idle_share"] is None  # no GPU here
    assert profile["by_kind_s"]["attention"] > 0  # SDPA's CPU kernels, forward and backward
    assert profile["by_kind_s"]["optimizer"] > 0  # AdamW's step
    assert sum(profile["by_kind_s"].values()) == pytest.approx(profile["kernel_s"])
    assert profile["top_kernels_s"][0]["s"] >= profile["top_kernels_s"][-1]["s"]


def test_kernel_kinds_of_known_cuda_kernel_names():
    from runtime.backends.profiling import kernel_kind

    assert kernel_kind("void flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == ("attention")
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_knob_7") == "attention"
    assert kernel_kind("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize") == "matmul"
    assert kernel_kind("void at::native::(anonymous)::multi_tensor_apply_kernel") == ("optimizer")
    assert kernel_kind("triton_red_fused__log_softmax_gather_0") == "compiled"
    assert kernel_kind("triton_poi_fused__to_copy_add_mul_4") == "compiled"
    assert kernel_kind("void at::native::CatArrayBatchedCopy<float, 4>") == "copy"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("void at::native::elementwise_kernel<128, 4>") == "other"
    assert kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage)") == (
        "communication"
    )
    assert kernel_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "communication"
    )


def test_a_gpu_profile_counts_each_kernel_once_and_the_gpu_busy_for_their_union():
    """The 2026-11-30 two-rank SFT profile counted NCCL twice: its kernel and the range torch
    annotates around it on the GPU's timeline (`nccl:_all_gather_base`, same seconds). And a
    collective beside a matmul on another stream is busy time once, not twice."""
    from types import SimpleNamespace

    import torch

    from runtime.backends.profiling import summary

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name: str, start: float, end: float, device=cuda, annotation=False):
        return SimpleNamespace(
            name=name,
            device_type=device,
            is_user_annotation=annotation,
            device_time=end - start,
            time_range=SimpleNamespace(start=start, end=end),
        )

    events = [
        event("nvjet_sm90_tst_128x256_64x4", 0, 600_000),  # 0.6 s of matmul
        event("ncclDevKernel_AllGather_RING_LL", 400_000, 700_000),  # 0.3 s, 0.2 s beside it
        event("nccl:_all_gather_base", 400_000, 700_000, annotation=True),  # the same again
        event("aten::mm", 0, 600_000, device=cpu),  # the host's side of the matmul
        event("triton_poi_fused_add_0", 900_000, 1_000_000),  # 0.1 s after a gap
    ]
    s = summary(SimpleNamespace(events=lambda: events), wall=1.0, cuda=True)
    assert s["by_kind_s"] == pytest.approx({"matmul": 0.6, "communication": 0.3, "compiled": 0.1})
    assert s["kernel_s"] == pytest.approx(1.0)  # each kernel's seconds, summed
    assert s["busy_s"] == pytest.approx(0.8)  # 0-0.7 and 0.9-1.0
    assert s["gpu_idle_share"] == pytest.approx(0.2)
    assert [k["name"] for k in s["top_kernels_s"]] == [
        "nvjet_sm90_tst_128x256_64x4",
        "ncclDevKernel_AllGather_RING_LL",
        "triton_poi_fused_add_0",
    ]


def test_the_fault_table_reads_each_tests_exit_line_and_outcome(tmp_path: Path):
    import fault_table

    log = tmp_path / "gpu_faults.log"
    log.write_text(
        "python: error: GPU 0 (0) is in use: 0.8 of 86 GB free\n"
        "\n"
        "fault-exit occupied-gpu 0.8 s\n"
        ".tiny-gpu on 1 x H100\n"
        "forgesky: trainer actor failed: process killed by SIGKILL (proc 0/1) (on node 0 GPU 0)\n"
        "fault-exit trainer-killed 8.5 s\n"
        "Ftiny-gpu on 1 x H100\n"
        "forgesky: generator0 actor failed: stopped answering (node 0 GPU 0): ...\n"
        "fault-exit generator-silent 36.1 s\n"
    )
    rows = fault_table.read(log)
    assert [(r["fault"], r["seconds_to_exit"]) for r in rows] == [
        ("occupied-gpu", 0.8),
        ("trainer-killed", 8.5),
        ("generator-silent", 36.1),
    ]
    assert rows[0]["line"].startswith("python: error: GPU 0 (0) is in use")
    assert rows[1]["line"].startswith("forgesky: trainer actor failed: process killed")
    assert [r["test"].split()[0] for r in rows] == ["passed", "failed", "no"]
    empty = tmp_path / "empty.log"
    empty.write_text("2 passed\n")
    assert fault_table.main([str(empty)]) == 2  # no fault-exit line: one line, exit 2


def test_side_by_side_reads_a_log_and_a_json_section(tmp_path):
    import side_by_side

    log = tmp_path / "ours.log"
    lines = ["services ready in 100 s", "INFO noise | 3 s/step"]
    lines += [
        f"step {i}/5 | reward 0.3 | loss 0.01 | kl 0 | {t} s/step"
        for i, t in enumerate((40.0, 9.0, 8.0, 6.0, 7.0), 1)
    ]
    log.write_text("\n".join(lines) + "\n")
    trl = tmp_path / "trl.json"
    section = {"step_s": 10.5, "samples_per_s_per_gpu": 128 / 10.5, "tokens_per_s_per_gpu": 9000.4}
    trl.write_text(json.dumps({"trl_on": {**section, "step_times_s": [11, 10.5]}}))
    out = tmp_path / "side.json"
    side_by_side.main(
        ["--host", "h", "--date", "d", "--pair", "on", f"log:{log}", f"json:{trl}#trl_on"]
        + ["--staleness", "on=0,0", "--out", str(out)]
    )
    pair = json.loads(out.read_text())["h"]["pairs"]["on"]
    ours = pair["forgesky"]
    # the two warm-up steps left out, the INFO line's "s/step" not a step
    assert ours["step_times_s"] == [40.0, 9.0, 8.0, 6.0, 7.0]
    assert ours["step_s"] == 7.0
    assert ours["samples_per_s_per_gpu"] == pytest.approx(128 / 7.0, abs=0.01)
    assert pair["trl"]["tokens_per_s_per_gpu"] == 9000
    assert pair["forgesky_over_trl_samples_per_s_per_gpu"] == pytest.approx(1.5, abs=0.01)
    assert ours["policy_staleness_mean"] == 0.0
    assert "target_forgesky_over_trl" not in pair  # a pair name with no target


def test_side_by_side_says_how_far_a_pair_fell_short_of_its_target(tmp_path):
    import side_by_side

    runs = tmp_path / "runs.json"
    runs.write_text(
        json.dumps(
            {
                "ours": {"step_s": 5.0, "samples_per_s_per_gpu": 25.6},
                "trl": {"step_s": 8.0, "samples_per_s_per_gpu": 16.0},
                "trl_fast": {"step_s": 2.0, "samples_per_s_per_gpu": 8.0},
            }
        )
    )
    out = tmp_path / "side.json"
    side_by_side.main(
        ["--host", "h", "--date", "d", "--out", str(out)]
        + ["--pair", "on_policy", f"json:{runs}#ours", f"json:{runs}#trl"]
        + ["--pair", "one_step_off_policy", f"json:{runs}#ours", f"json:{runs}#trl_fast"]
    )
    pairs = json.loads(out.read_text())["h"]["pairs"]
    # 1.6x against 2x: 20 % short; 3.2x against 2.5x: met
    assert pairs["on_policy"]["target_forgesky_over_trl"] == 2.0
    assert pairs["on_policy"]["short_of_target"] == 0.2
    assert pairs["one_step_off_policy"]["target_forgesky_over_trl"] == 2.5
    assert pairs["one_step_off_policy"]["short_of_target"] == 0.0
    # --refresh adds them to a file written before they existed, reading nothing else
    for pair in pairs.values():
        del pair["target_forgesky_over_trl"], pair["short_of_target"]
    out.write_text(json.dumps({"h": {"pairs": pairs}}))
    runs.unlink()
    assert side_by_side.main(["--refresh", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["h"]["pairs"]["on_policy"]["short_of_target"] == 0.2


def test_side_by_side_refuses_a_log_without_measured_steps(tmp_path):
    import side_by_side

    log = tmp_path / "cut.log"
    log.write_text("step 1/6 | loss 0 | 43.4 s/step\nstep 2/6 | loss 0 | 8 s/step\n")
    trl = tmp_path / "trl.json"
    trl.write_text(json.dumps({"t": {"step_s": 1.0, "samples_per_s_per_gpu": 1.0}}))
    with pytest.raises(SystemExit, match="2 step lines"):
        side_by_side.main(
            ["--host", "h", "--date", "d", "--pair", "x", f"log:{log}", f"json:{trl}#t"]
            + ["--out", str(tmp_path / "o.json")]
        )


def test_memory_against_plan_adds_up_a_shared_gpu_and_keeps_each_peak():
    from recipes import apply_overrides, load_recipe, plan

    recipe = apply_overrides(load_recipe("qwen3-1.7b"), ["grpo.max_response_tokens=512"])
    one_gpu = plan(recipe, 1, accelerator="H100")
    records = [
        {"step": 1, "memory/startup_gb": 9.3, "memory/train_gb": 35.0},
        {"step": 2, "memory/train_gb": 36.5, "memory/publish_gb": 26.6},
    ]
    out = gpu_grpo.memory_against_plan(one_gpu, records, {0: 81.2})
    by_service = one_gpu.memory
    assert set(by_service) == {"generator", "reference", "trainer"}
    assert out["plan_gb_per_gpu"] == {"0": round(sum(by_service.values()), 1)}
    assert out["nvidia_smi_peak_gb_per_gpu"] == {"0": 81.2}
    assert out["trainer_allocator_peak_gb"] == {
        "memory/startup_gb": 9.3,
        "memory/train_gb": 36.5,
        "memory/publish_gb": 26.6,
    }


def test_product_path_overrides_pass_the_runtimes_checks(monkeypatch):
    # `python -m runtime` checks every module:function a recipe names before it starts (by
    # file: a package with an __init__.py on the path); the product bench's own reward must pass
    from recipes import apply_overrides, load_recipe
    from recipes.references import check, references, search_path
    from runtime.tasks.rewards import build_reward_fn

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    import product_path

    recipe = apply_overrides(load_recipe("qwen3-1.7b"), ["layout.share=all", *product_path.SHORT])
    roots = check(references(recipe), search_path())
    assert roots == {"bench": root / "bench"}
    mix = build_reward_fn(recipe.dataset.rewards)
    assert mix("q", "aaaa", "")[0] == 0.25 and mix("q", "abcd", "")[0] == 1.0


@pytest.mark.parametrize(
    ("name", "gpus"),
    [("qwen3-8b", 2), ("qwen3-14b-lora", 1), ("qwen3-32b-lora", 4), ("llama3.1-8b-lora", 1)],
)
def test_product_path_overrides_are_a_recipe_the_planner_takes(name, gpus, monkeypatch):
    # what run A and run B start with on the H200s scripts/gpu/README.md gives them
    # (bench/product_path.py runtime_args): a LoRA recipe's reference runs in the trainer's
    # processes and refuses a compile setting of its own
    from recipes import apply_overrides, load_recipe, plan

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    import product_path

    sets = ["layout.share=all", *product_path.short(name), "resources.accelerator=H200"]
    recipe = apply_overrides(load_recipe(name), sets)
    assert plan(recipe, gpus).total_gpus == gpus
    lora = name.endswith("-lora")
    assert ("reference.compile=false" in product_path.short(name)) is not lora
    if lora:  # the refusal the trimmed list avoids
        with pytest.raises(Exception, match="reference.compile"):
            apply_overrides(load_recipe(name), [*sets, "reference.compile=false"])


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_product_bench_writes_a_model_folder_both_loaders_read(tmp_path, monkeypatch, family):
    """bench/product_path.py's random HF folder (run on the GPU for qwen3-8b and llama3.1-8b),
    for a small model of each family: transformers loads it with its tokenizer, and the
    runtime's loading path reads the same weights back."""
    import dataclasses

    import product_path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes import architecture, load_recipe
    from runtime.backends import build
    from runtime.models import ModelSpec
    from runtime.models.loading import load_pretrained

    spec = ModelSpec.from_arch(architecture("qwen3", "tiny"), family=family)
    spec = dataclasses.replace(spec, vocab_size=512)  # room for the character tokenizer
    if family == "llama3":
        llama8b = ModelSpec.from_arch(architecture("llama3", "8b"), family="llama3")
        spec = dataclasses.replace(
            spec, tie_embeddings=False, norm_eps=1e-5, rope_scaling=llama8b.rope_scaling
        )
    monkeypatch.setattr(build, "model_spec", lambda recipe: spec)  # a small model of the family
    folder = tmp_path / "model"
    info = product_path.write_random_model(load_recipe("qwen3-1.7b"), folder, device="cpu")
    assert info["params_in_files"] > 0 and info["bytes"] > 0
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == {"qwen3": "qwen3", "llama3": "llama"}[family]
    assert len(tokenizer) <= spec.vocab_size
    weights = load_pretrained(str(folder), spec)
    embedding = weights["tok_embeddings.weight"].to(torch.bfloat16)
    assert torch.equal(embedding, model.model.embed_tokens.weight)
    assert all(t.abs().sum() > 0 for t in weights.values())


def test_the_grpo_bench_reads_a_random_model_folder_as_a_users_model(tmp_path, monkeypatch):
    """`gpu_grpo.py grpo --model-folder DIR`: the folder is written once and kept while it
    holds the recipe's architecture, and the run's recipe reads it as a user's model
    (model.hf_id, no seeded init), which its section's overrides say."""
    import dataclasses

    import product_path

    from recipes import architecture, load_recipe
    from runtime.backends import build
    from runtime.models import ModelSpec

    spec = ModelSpec.from_arch(architecture("qwen3", "tiny"), family="qwen3")
    monkeypatch.setattr(
        build, "model_spec", lambda recipe: dataclasses.replace(spec, vocab_size=512)
    )
    folder = tmp_path / "qwen3-1.7b-hf"
    recipe = load_recipe("qwen3-1.7b")
    first = product_path.random_model_once(recipe, folder, device="cpu")
    shard = next(folder.glob("*.safetensors"))
    written = shard.stat().st_mtime_ns
    again = product_path.random_model_once(recipe, folder, device="cpu")
    assert first["written_now"] and not again["written_now"]
    assert product_path.held_model(recipe, folder) == again
    assert gpu_grpo.model_folder("qwen3-1.7b", folder) == {"path": str(folder.resolve()), **again}
    assert shard.stat().st_mtime_ns == written
    assert {k: v for k, v in again.items() if k != "written_now"} == {
        k: v for k, v in first.items() if k != "written_now"
    }
    # another architecture in the same folder is written anew
    other = product_path.random_model_once(load_recipe("llama3.2-1b"), folder, device="cpu")
    assert other["written_now"]

    loaded = gpu_grpo.load("qwen3-1.7b", 3, 512, model_folder=str(folder))
    assert loaded.model.hf_id == str(folder) and loaded.model.init == "hub"
    assert loaded.model.tokenizer == "builtin:arith"
    assert gpu_grpo.load("qwen3-1.7b", 3, 512).model.init == "random"
    assert gpu_grpo.offline(str(folder))[0] == f"model.hf_id={folder}"
    assert gpu_grpo.offline() == gpu_grpo.OFFLINE


def test_product_path_times_run_b_by_its_own_steps(monkeypatch):
    """The resumed run appends to the metrics its first run wrote: its step times are the
    steps past its checkpoint, with what the checkpoint before each held up."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import product_path

    rows = [
        {"step": 1, "time/step_s": 11.5, "time/train_s": 3.4, "loss": 0.1},
        {"step": 2, "time/step_s": 1.7, "time/train_s": 0.9},
        {
            "step": 3,
            "time/step_s": 4.6,
            "time/checkpoint_staging_wait_s": 0.2,
            "response_tokens": 96,
        },
    ]
    line = "resumed from step 2 (/runs/x/checkpoints/step_000002)"
    assert product_path.resumed_step(line) == 2
    assert product_path.resumed_step(None) == 0
    assert product_path.step_times(rows, product_path.resumed_step(line)) == [
        {
            "step": 3,
            "time/step_s": 4.6,
            "time/checkpoint_staging_wait_s": 0.2,
            "response_tokens": 96,
        }
    ]
    assert [r["step"] for r in product_path.step_times(rows)] == [1, 2, 3]
    assert "loss" not in product_path.step_times(rows)[0]


def test_product_path_ranks_the_logprob_differences_before_taking_a_percentile(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import product_path

    diffs = [0.5] + [0.01] * 98 + [2.0]  # in the order the rows came: the largest at the end
    out = product_path.logprob_diffs(diffs)
    assert out["tokens_compared"] == 100
    assert out["p99_abs_logprob_diff"] == 0.5 and out["max_abs_logprob_diff"] == 2.0
    assert out["mean_abs_logprob_diff_vllm_vs_transformers"] == 0.0348  # 3.48 / 100


def test_trl_async_mode_serves_the_model_it_trains_and_scores_in_another_process(monkeypatch):
    """bench/trl_grpo.py --trainer async: the vllm serve command TRL's async trainer needs (its
    model folder by name, NCCL weight transfer, the lengths), the config's batch arithmetic, and
    a reward that survives pickling (TRL scores in a process of its own)."""
    import argparse
    import pickle

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import rewards
    import trl_grpo

    args = argparse.Namespace(
        prompts_per_step=16, group_size=8, micro_batch=16, response_tokens=512, steps=8,
        gradient_checkpointing="off", max_staleness=1, prompt_tokens=207, server_memory=0.9,
    )  # fmt: skip
    config = trl_grpo.async_settings(args, "http://127.0.0.1:8011")
    assert config["gradient_accumulation_steps"] * config["per_device_train_batch_size"] == 128
    assert config["max_staleness"] == 1 and config["vllm_server_base_url"].endswith(":8011")
    assert "beta" not in config  # no reference model in TRL's async trainer
    command = trl_grpo.server_command(Path("/m/model"), args, 8011)
    assert command[:3] == ["vllm", "serve", "/m/model"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags["--max-model-len"] == "719" and flags["--port"] == "8011"
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
    assert trl_grpo.server_env("1")["VLLM_SERVER_DEV_MODE"] == "1"
    reward = pickle.loads(pickle.dumps(rewards.distinct_share_of_ids))
    assert reward(completion_ids=[[1, 1, 2, 3], [5, 5]], prompts=["a", "b"]) == [0.75, 0.5]
    args.micro_batch = 48
    with pytest.raises(SystemExit):
        trl_grpo.async_settings(args, "http://127.0.0.1:8011")


def test_trl_async_prompts_render_to_the_same_tokens_as_the_plain_ones(monkeypatch):
    """TRL's async trainer takes prompts as chat messages through the tokenizer's chat
    template; the bench's template must give the tokens GRPOTrainer gets from the text."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import trl_grpo

    from runtime.tasks.arith.tokenization import build_tokenizer

    tokenizer = build_tokenizer(1024)
    tokenizer.chat_template = trl_grpo.PLAIN_CHAT_TEMPLATE
    for text in trl_grpo.prompts(3, 32):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        assert list(rendered) == tokenizer(text)["input_ids"], text
        assert len(rendered) == 32


def test_trl_async_mode_stops_at_once_without_its_hub_kernel(monkeypatch, capsys):
    """TRL's async trainer fetches its FlashAttention-3 kernel from the Hub at run time; where
    that cannot be done (no `kernels` package here, no Hub on the GPU machines) the bench says
    so before it starts a server."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import trl_grpo

    monkeypatch.setitem(sys.modules, "kernels", None)  # as on a machine without the package
    with pytest.raises(SystemExit):
        trl_grpo.check_attention_kernel()
    assert "kernels-community/flash-attn3" in capsys.readouterr().err


def test_trl_bench_step_figures_leave_out_the_warmup_and_count_every_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import trl_grpo

    out = trl_grpo.step_figures([0.0, 10.0, 14.0, 18.0], 1, 128, 2, [100, 110], 500.0)
    assert out["step_times_s"] == [10.0, 4.0, 4.0] and out["measured_steps"] == 2
    assert out["step_s"] == 4.0 and out["samples_per_s_per_gpu"] == 16.0
    assert out["tokens_per_s_per_gpu"] == 128 * 605 / 8


# --- the GPU sampler (nvidia-smi stands in as a script on PATH) ------------------------------

FAKE_SMI = """#!/bin/sh
# two GPUs; GPU 1's power is not reported; $REFUSE_CLOCKS: a driver without the clock fields
case "$1" in
  *clocks.sm*)
    [ -n "$REFUSE_CLOCKS" ] && { echo 'Field "clocks.sm" is not a valid field' >&2; exit 2; }
    echo "0, 1000, $(cat "$CLOCK_FILE"), 500.5, 90"
    echo "1, 2000, 1755, [N/A], 10" ;;
  *) echo "0, 1000"; echo "1, 2000" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    clock = tmp_path / "clock"
    clock.write_text("1980")
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("CLOCK_FILE", str(clock))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return clock


def wait_for(predicate, timeout: float = 10.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_the_sampler_keeps_clocks_only_inside_its_window(fake_smi: Path):
    from gpu_memory import GpuSampler

    sampler = GpuSampler(every_s=0.01)
    try:
        wait_for(lambda: sampler.peaks.get("idle"))
        assert sampler.clocks() == {}  # no window named yet
        sampler.clock_window = "measured"
        wait_for(lambda: len(sampler._samples.get("measured", {}).get(0, [])) >= 3)
        fake_smi.write_text("1200")  # GPU 0 slows down inside the window
        wait_for(lambda: any(s[0] == 1200 for s in sampler._samples["measured"][0]))
        sampler.clock_window = None
    finally:
        sampler.stop()
    clocks = sampler.clocks()["measured"]
    assert clocks["0"]["sm_mhz_min"] == 1200
    assert 1200 < clocks["0"]["sm_mhz_mean"] < 1980
    assert clocks["0"]["power_w_mean"] == 500.5 and clocks["0"]["utilization_pct_mean"] == 90
    assert clocks["1"]["power_w_mean"] is None  # [N/A] is no figure, not a zero
    assert sampler.peaks["idle"] == {
        0: round(1000 * 2**20 / 1e9, 2),
        1: round(2000 * 2**20 / 1e9, 2),
    }


def test_the_sampler_sees_only_the_gpus_given_to_the_bench(fake_smi: Path, monkeypatch):
    from gpu_memory import GpuSampler, visible_gpus

    # A run beside the bench on GPU 0 of the host: the bench was given GPU 1 alone, which its
    # processes call GPU 0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    sampler = GpuSampler(every_s=0.01)
    try:
        wait_for(lambda: sampler.peaks.get("idle"))
        assert sampler.used() == {0: 2000 * 2**20 / 1e9}
    finally:
        sampler.stop()
    assert sampler.peaks["idle"] == {0: round(2000 * 2**20 / 1e9, 2)}
    assert visible_gpus("2,3") == {2: 0, 3: 1}
    assert visible_gpus("") is None and visible_gpus("GPU-5f1c,GPU-77aa") is None


def test_without_the_clock_fields_the_sampler_still_takes_memory(fake_smi: Path, monkeypatch):
    from gpu_memory import GpuSampler

    monkeypatch.setenv("REFUSE_CLOCKS", "1")
    sampler = GpuSampler(every_s=0.01, clock_window="calls")
    try:
        wait_for(lambda: sampler.peaks.get("idle"))
    finally:
        sampler.stop()
    assert sampler.peaks["idle"][1] == round(2000 * 2**20 / 1e9, 2)
    assert sampler.clocks() == {}


def test_the_step_window_covers_the_measured_steps(tmp_path: Path):
    class Sampler:
        clock_window = None

    metrics, sampler, seen = tmp_path / "metrics.jsonl", Sampler(), []
    window = gpu_grpo.StepWindow(sampler, metrics, first=2, last=4, name="measured")
    try:
        for lines in range(1, 5):
            metrics.write_text('{"step": 1}\n' * lines)
            inside = 2 <= lines < 4
            wait_for(lambda inside=inside: (sampler.clock_window == "measured") == inside)
            seen.append(sampler.clock_window)
    finally:
        window.stop()
    assert seen == [None, "measured", "measured", None]
    assert sampler.clock_window is None


def test_engine_thread_means_skip_rows_without_the_figures():
    rows = [
        {"generator/engine_thread_cpu_s": 1.0, "generator/engine_thread_voluntary_switches": 10.0},
        {"generator/engine_thread_cpu_s": 3.0, "generator/engine_thread_voluntary_switches": 30.0},
        {"time/step_s": 2.0},
    ]
    assert gpu_grpo.engine_thread(rows, "generator/engine_thread_") == {
        "engine_thread_cpu_s": 2.0,
        "engine_thread_voluntary_switches": 20.0,
        "engine_thread_involuntary_switches": None,
    }


def test_host_cpu_counts_busy_cores_between_two_snapshots():
    """The bench's host CPU figures (bench/gpu_memory.py): busy cores between two /proc/stat
    snapshots (idle and iowait are not busy) and the mean `cpu MHz` of /proc/cpuinfo."""
    from gpu_memory import busy_cores, cpu_mhz, cpu_times

    first = cpu_times(
        "cpu  30 0 30 140 0 0 0 0 0 0\n"
        "cpu0 10 0 10 80 0 0 0 0 0 0\n"
        "cpu1 20 0 20 60 0 0 0 0 0 0\nintr 1 2 3\n"
    )
    # over the next 100 jiffies a core each: cpu0 fully busy, cpu1 a quarter (and waiting on
    # the disk for another quarter, which is not busy)
    last = cpu_times(
        "cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 70 0 50 80 0 0 0 0 0 0\ncpu1 30 0 35 110 25 0 0 0 0 0\n"
    )
    assert set(first) == {"cpu0", "cpu1"}
    assert busy_cores(first, last) == pytest.approx(1.25)
    assert busy_cores(first, first) == 0.0
    assert cpu_mhz("cpu MHz\t\t: 2000.0\nmodel name : x\ncpu MHz\t\t: 3000.0\n") == 2500.0
    assert cpu_mhz("model name : x\n") is None


def test_the_step_window_records_stacks_from_its_own_step_to_the_last(tmp_path: Path):
    class Sampler:
        clock_window = None

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def start(self, pid: int) -> None:
            self.calls.append(("start", lines))

        def stop(self) -> None:
            self.calls.append(("stop", lines))

    metrics, recorder = tmp_path / "metrics.jsonl", Recorder()
    window = gpu_grpo.StepWindow(
        Sampler(), metrics, first=1, last=4, name="measured", recorder=recorder, stacks_from=2
    )
    try:
        for lines in range(1, 5):
            metrics.write_text('{"step": 1}\n' * lines)
            want = {1: 0, 2: 1, 3: 1, 4: 2}[lines]
            wait_for(lambda want=want: len(recorder.calls) == want)
    finally:
        window.stop()
    # started once at step 2, stopped at the last step; stop() again at the end is harmless
    assert recorder.calls[:2] == [("start", 2), ("stop", 4)]


RAW = (
    'process 10:"python3 bench/gpu_grpo.py grpo";thread (10): MainThread;'
    "run (runtime/control/run.py:40);select (selectors.py:450) 30\n"
    'process 10:"python3 bench/gpu_grpo.py grpo";process 21:"python3 -m runtime.procs.proc_main\n'
    '--multi-line";thread (22): monarch-actor-event-loop;'
    "_Actor.handle (monarch/actor_mesh.py:900);"
    "GeneratorActor.generate (runtime/actors/generator.py:101);"
    "VLLMGenerator.generate (runtime/backends/vllm_generator.py:388);"
    "step (vllm/v1/engine/core.py:300);schedule (vllm/v1/core/sched/scheduler.py:200) 60\n"
    'process 10:"python3 bench/gpu_grpo.py grpo";process 21:"python3 -m runtime.procs.proc_main\n'
    '--multi-line";thread (22): monarch-actor-event-loop;'
    "_Actor.handle (monarch/actor_mesh.py:900);"
    "GeneratorActor.generate (runtime/actors/generator.py:101);"
    "VLLMGenerator.generate (runtime/backends/vllm_generator.py:388);"
    "step (vllm/v1/engine/core.py:310);sample (vllm/v1/sample/sampler.py:70) 20\n"
    'process 10:"python3 bench/gpu_grpo.py grpo";process 21:"python3 -m runtime.procs.proc_main\n'
    '--multi-line";thread (22): monarch-actor-event-loop;'
    "_Actor.handle (monarch/actor_mesh.py:900);select (selectors.py:450) 10\n"
    'process 10:"python3 bench/gpu_grpo.py grpo";process 21:"python3 -m runtime.procs.proc_main\n'
    '--multi-line";thread (23): weight-recv;_receive_loop (runtime/weights/push.py:360) 5\n'
    'process 10:"python3 bench/gpu_grpo.py grpo";process 31:"python3 -m runtime.procs.proc_main";'
    "thread (32): monarch-actor-event-loop;"
    "TrainerActor.train (runtime/actors/trainer.py:80);train_step (fsdp_trainer.py:200) 90\n"
)


def test_stacks_name_each_process_by_its_service_and_split_the_engine_threads_time():
    from stacks import parse, summarize

    rows = parse(RAW)
    assert len(rows) == 6  # the multi-line command line joined back
    assert (
        rows[1][0].startswith("process 21:")
        and rows[1][1] == "thread (22): monarch-actor-event-loop"
    )
    s = summarize(RAW, rate=100, seconds=1.0)
    by_role = {p["role"]: p for p in s["processes"]}
    assert set(by_role) == {"controller", "generator", "trainer"}
    assert by_role["trainer"]["on_cpu_cores"] == 0.9
    gen = by_role["generator"]
    assert gen["samples"] == 95 and gen["pid"] == 21
    assert gen["threads"][0] == {
        "thread": "thread (22): monarch-actor-event-loop",
        "samples": 90,
        "on_cpu_share": 0.9,
    }
    engine = s["generator_engine_thread"]
    # inside the generate call only: 80 of the thread's 90 samples, 0.8 CPU seconds at 100 Hz
    assert engine["samples"] == 90 and engine["within_cpu_s"] == 0.8
    assert engine["self"] == [
        ["schedule (scheduler.py)", 0.6, 0.75],
        ["sample (sampler.py)", 0.2, 0.25],
    ]
    inclusive = dict((name, share) for name, _, share in engine["inclusive"])
    assert inclusive["step (core.py)"] == 1.0  # two lines of one function are one entry
    assert "select (selectors.py)" not in inclusive


def test_vllm_alone_in_the_bench_process_counts_as_the_generator():
    from stacks import summarize

    raw = (
        'process 5:"python3 bench/gpu_grpo.py vllm";thread (5): MainThread;'
        "run_vllm (bench/gpu_grpo.py:420);"
        "VLLMGenerator.generate (runtime/backends/vllm_generator.py:388);"
        "step (vllm/v1/engine/core.py:300) 40\n"
    )
    s = summarize(raw, rate=50, seconds=1.0)
    assert s["processes"][0]["role"] == "generator"
    assert s["generator_engine_thread"]["within_cpu_s"] == 0.8


def test_a_recorder_without_py_spy_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import stacks

    monkeypatch.setattr(stacks.shutil, "which", lambda name: None)
    monkeypatch.setattr(stacks.sys, "executable", str(tmp_path / "python3"))
    recorder = stacks.StackRecorder(tmp_path / "stacks.txt")
    recorder.start(os.getpid())
    recorder.stop()
    assert recorder.summary() == {"error": "py-spy is not installed"}


# Speed comparisons as alternating pairs (bench/pairs.py, bench/speed_summary.py).

import pairs  # noqa: E402
import speed_summary  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_speed_summary_is_what_its_specs_give():
    specs = json.loads((REPO / "bench/results/speed_comparisons.json").read_text())
    committed = json.loads((REPO / "bench/results/speed_summary.json").read_text())
    assert speed_summary.summarize(specs) == committed
    # the docs' speed table is those rows, as --markdown prints them
    table = speed_summary.markdown(committed)
    assert table in (REPO / "docs/benchmarks.md").read_text()
    for r in committed["rows"]:
        figure = "tokens" if r["policy"] == "sft" else "samples"
        assert r["pairs"] == len(r[f"ours_{figure}_per_s_per_gpu"]) == len(r["ratios"])
        assert r["median_of_3"] is (r["pairs"] >= 3)


def test_the_readme_quotes_only_median_rows_of_the_speed_summary():
    import re

    rows = json.loads((REPO / "bench/results/speed_summary.json").read_text())["rows"]
    medians = {f"{r['ratio_median']:.2f}x" for r in rows if r["median_of_3"]}
    quoted = re.findall(r"\b\d+\.\d+x per GPU", (REPO / "README.md").read_text())
    assert quoted, "the README quotes no speed ratio"
    for q in quoted:
        assert q.removesuffix(" per GPU") in medians, f"README: {q} is no median-of-3 row"


def _iso(seconds: float) -> str:
    return f"{datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC):%Y-%m-%dT%H:%M:%SZ}"


def _stamped(path: Path, pairs_: list[tuple[float, float]], host="h1", start=0, gap=60):
    """A file of alternating runs made through bench/pairs.py's stamps, 100 s each."""
    t0 = 1_800_000_000 + start
    result = {"device": {"name": "NVIDIA H200"}}
    for k, (ours, peer) in enumerate(pairs_, 1):
        for i, (side, sps) in enumerate((("ours", ours), ("peer", peer))):
            begin = t0 + (2 * (k - 1) + i) * (100 + gap)
            result[pairs.section_name(k, side)] = {"samples_per_s_per_gpu": sps, "exit_code": 0}
            run = {"system": side, "started": _iso(begin), "ended": _iso(begin + 100)}
            run.update(exit_code=0, host=host, boot_id="b", commit="abc1234", tag="")
            result[pairs.section_name(k, side)]["run"] = {"pair": k, "side": side, **run}
    path.write_text(json.dumps(result))
    return result


def _spec(name: str, n: int, **more):
    spec = {"work": "w", "gpu": "H200", "gpus": 1, "policy": "on", "peer": "trl"}
    spec["pairs"] = [[f"{name}#pair{k}_ours", f"{name}#pair{k}_peer"] for k in range(1, n + 1)]
    return {**spec, **more}


def test_speed_rows_take_the_median_of_the_pairs_and_mark_fewer_than_three(tmp_path):
    _stamped(tmp_path / "three.json", [(20.0, 10.0), (21.0, 15.0), (22.0, 20.0)])
    _stamped(tmp_path / "two.json", [(20.0, 10.0), (21.0, 15.0)])
    rows = speed_summary.summarize([_spec("three.json", 3), _spec("two.json", 2)], tmp_path)
    three, two = rows["rows"]
    assert three["ratios"] == [2.0, 1.4, 1.1]
    assert (three["ratio_median"], three["ratio_min"], three["ratio_max"]) == (1.4, 1.1, 2.0)
    assert three["ours_samples_per_s_per_gpu"] == [20.0, 21.0, 22.0]
    assert three["peer_samples_per_s_per_gpu"] == [10.0, 15.0, 20.0]
    assert three["median_of_3"] and three["host"] == "h1" and three["commit"] == "abc1234"
    assert three["commit_from"] == "the runs' records" and three["times_from"] == "stamps"
    assert two["median_of_3"] is False and two["ratio_median"] == pytest.approx(1.7)


@pytest.mark.parametrize(
    "case, words",
    [
        ("swapped", "made as pair 1 peer, listed as pair 1 ours"),
        ("overlap", "not in alternating order"),
        ("two_hosts", "span 2 hosts"),
        ("failed", "not a completed run"),
        ("other_gpu", "ran on NVIDIA H100 80GB HBM3, not H200"),
    ],
)
def test_speed_summary_refuses_pairs_out_of_order_or_on_two_hosts(tmp_path, case, words):
    result = _stamped(tmp_path / "r.json", [(20.0, 10.0), (21.0, 15.0), (22.0, 20.0)])
    spec = _spec("r.json", 3)
    if case == "swapped":
        spec["pairs"][0].reverse()
    elif case == "overlap":  # pair 2's peer started while pair 2's ours still ran
        result["pair2_peer"]["run"]["started"] = result["pair2_ours"]["run"]["started"]
    elif case == "two_hosts":
        result["pair3_peer"]["run"]["host"] = "h2"
    elif case == "failed":
        result["pair2_ours"]["run"]["exit_code"] = 124
    elif case == "other_gpu":
        result["device"]["name"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "r.json").write_text(json.dumps(result))
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([spec]))
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/speed_summary.py"), "--specs", str(specs), "--out",
         str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr
    assert not out.exists()


def test_speed_summary_refuses_old_runs_whose_logs_say_they_overlapped(tmp_path):
    """Sections without stamps: the logs' clock times order them."""
    (tmp_path / "a.json").write_text(
        json.dumps({
            "device": {"name": "NVIDIA H200"},
            "date": "2026-11-28",
            "ours": {"samples_per_s_per_gpu": 21.0},
            "trl": {"samples_per_s_per_gpu": 15.0},
        })
    )  # fmt: skip
    (tmp_path / "ours.log").write_text("INFO 11-28 08:30:26 start\nINFO 11-28 08:33:39 end\n")
    (tmp_path / "trl.log").write_text("INFO 11-28 08:36:44 start\n[23:59:00] x\n")
    spec = _spec("a.json", 1, host="folder", commit="c0ffee0", commit_from="its README")
    spec["pairs"] = [["a.json#ours", "a.json#trl"]]
    spec["logs"] = {"a.json#ours": "ours.log", "a.json#trl": "trl.log"}
    (r,) = speed_summary.summarize([spec], tmp_path)["rows"]
    assert r["ratios"] == [1.4] and r["times_from"] == "logs" and r["host"] == "folder"
    assert r["runs"][1]["ended"] == "2026-11-28T23:59:00Z"
    (tmp_path / "trl.log").write_text("INFO 11-28 08:32:00 start\n")
    with pytest.raises(speed_summary.Refused, match="not in alternating order"):
        speed_summary.summarize([spec], tmp_path)


def test_pairs_stamps_runs_in_order_and_refuses_another_order_or_host(tmp_path):
    out = tmp_path / "pairs.json"

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / "bench/pairs.py"), *args, "--json", str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def stamp(pair: int, side: str, rc: int = 0) -> subprocess.CompletedProcess:
        times = ("--started", "2026-11-29T01:00:00Z", "--ended", "2026-11-29T01:05:00Z")
        return call("stamp", "--pair", str(pair), "--side", side, "--system", "x", *times,
                    "--exit-code", str(rc))  # fmt: skip

    assert call("next").stdout.split() == ["1", "ours"]
    refused = stamp(1, "peer")
    assert refused.returncode == 2 and "pair1_ours has no completed run" in refused.stderr
    # a run cut by its limit wrote no section: stamped as failed, made again next
    assert stamp(1, "ours", rc=124).returncode == 0
    assert call("next").stdout.split() == ["1", "ours"]
    result = json.loads(out.read_text())
    assert result["pairs_failed_runs"][0]["exit_code"] == 124
    result["pair1_ours"] = {"samples_per_s_per_gpu": 20.0, "exit_code": 0}  # the bench wrote it
    out.write_text(json.dumps(result))
    assert stamp(1, "ours").returncode == 0
    assert call("next").stdout.split() == ["1", "peer"]
    result = json.loads(out.read_text())
    assert result["pair1_ours"]["run"]["side"] == "ours"
    assert result["pair1_ours"]["run"]["started"] == "2026-11-29T01:00:00Z"
    result["pair1_peer"] = {"samples_per_s_per_gpu": 10.0, "exit_code": 0}
    result["pair1_ours"]["run"]["host"] = "another-host"
    out.write_text(json.dumps(result))
    refused = stamp(1, "peer")
    assert refused.returncode == 2 and "pairs are on one host" in refused.stderr
    assert call("next", "--pairs", "1").stdout.strip() == "done"


def test_device_run_pairs_dry_run_names_the_next_run_and_refuses_bad_input(tmp_path):
    tag = f"_t{os.getpid()}"
    json_path = Path(f"/tmp/bench/pairs{tag}.json")
    env = {**os.environ, "TAG": tag, "OUT": str(tmp_path / "out"), "PAIRS_PEER": "trl-lora"}

    def run(*args: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "scripts/gpu/device_run.sh"), "pairs", "--dry-run", *args],
            capture_output=True, text=True, timeout=60, env={**env, **more}, cwd=tmp_path,
        )  # fmt: skip

    try:
        json_path.unlink(missing_ok=True)
        first = run("on", "1")
        assert first.returncode == 0, first.stderr
        assert "pair 1, ours" in first.stdout and "--section pair1_ours" in first.stdout
        assert "grpo.max_policy_age=0" in first.stdout
        json_path.parent.mkdir(parents=True, exist_ok=True)
        done = {"samples_per_s_per_gpu": 8.0, "exit_code": 0}
        json_path.write_text(json.dumps({"pair1_ours": done}))
        peer = run("off", "2", "--lora-rank", "16")
        assert "pair 1, peer" in peer.stdout and "torch.distributed.run" in peer.stdout
        assert "--optimizer-steps-per-generation 2 --lora-rank 16 --section pair1_peer" in (
            peer.stdout
        )
        for args, more, words in [
            (("sideways",), {}, "on or off"),
            (("on", "0"), {}, "a GPU count"),
            (("on",), {"PAIRS_PEER": "nemo-rl"}, "no launcher for the peer nemo-rl"),
            (("on",), {"PAIRS_SIDE": "ours"}, "the order calls for pair 1 peer"),
        ]:
            bad = run(*args, **more)
            assert bad.returncode == 2 and words in bad.stderr, (args, bad.stderr)
    finally:
        json_path.unlink(missing_ok=True)


# SFT against TRL's SFTTrainer (bench/gpu_sft.py, bench/trl_sft.py, `pairs sft`).

import gpu_sft  # noqa: E402


def _sft_file(path: Path, pairs_: list[tuple[float, float]]) -> None:
    _stamped(path, pairs_)
    result = json.loads(path.read_text())
    for k in range(1, len(pairs_) + 1):
        for side, mfu in (("ours", 0.5), ("peer", 0.4)):
            section = result[pairs.section_name(k, side)]
            section["tokens_per_s_per_gpu"] = section.pop("samples_per_s_per_gpu") * 1000
            section["mfu"] = mfu
    path.write_text(json.dumps(result))


def test_sft_speed_rows_compare_tokens_per_gpu_and_keep_each_sides_mfu(tmp_path):
    _sft_file(tmp_path / "sft.json", [(20.0, 10.0), (21.0, 15.0), (22.0, 20.0)])
    spec = _spec("sft.json", 3, policy="sft", peer="trl-sft")
    (row,) = speed_summary.summarize([spec], tmp_path)["rows"]
    assert row["ours_tokens_per_s_per_gpu"] == [20000.0, 21000.0, 22000.0]
    assert row["peer_tokens_per_s_per_gpu"] == [10000.0, 15000.0, 20000.0]
    assert row["ratios"] == [2.0, 1.4, 1.1] and row["ratio_median"] == 1.4
    assert row["ours_mfu"] == [0.5] * 3 and row["peer_mfu"] == [0.4] * 3
    table = speed_summary.markdown({"rows": [row]})
    assert "| w | 1 H200 | trl-sft | 3 | 20,000 (0.50), 21,000 (0.50), 22,000 (0.50) |" in table
    # an SFT run is compared by its tokens: a section without them did not complete
    result = json.loads((tmp_path / "sft.json").read_text())
    result["pair2_peer"]["tokens_per_s_per_gpu"] = None
    (tmp_path / "sft.json").write_text(json.dumps(result))
    with pytest.raises(speed_summary.Refused, match="pair2_peer is not a completed run"):
        speed_summary.summarize([spec], tmp_path)
    assert not pairs.completed(result["pair2_peer"]) and pairs.completed(result["pair2_ours"])


def test_device_run_sft_pairs_run_the_product_then_trl_on_the_same_recipe(tmp_path):
    tag = f"_sft{os.getpid()}"
    json_path = Path(f"/tmp/bench/pairs{tag}.json")
    env = {**os.environ, "TAG": tag, "OUT": str(tmp_path / "out")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "scripts/gpu/device_run.sh"), "pairs", "--dry-run", *args],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )  # fmt: skip

    try:
        json_path.unlink(missing_ok=True)
        first = run("sft", "1")
        assert first.returncode == 0, first.stderr
        assert (
            "bench/gpu_sft.py" in first.stdout
            and "--recipe qwen3-1.7b-sft --gpus 1" in first.stdout
        )
        json_path.parent.mkdir(parents=True, exist_ok=True)
        done = {"tokens_per_s_per_gpu": 9000.0, "mfu": 0.5, "exit_code": 0}
        json_path.write_text(json.dumps({"pair1_ours": done}))
        peer = run("sft", "1", "--micro-batch", "4")
        assert "pair 1, peer" in peer.stdout, peer.stdout
        assert "bench/trl_sft.py" in peer.stdout and "--micro-batch 4 --section pair1_peer" in (
            peer.stdout
        )
        bad = run("sft", "0")
        assert bad.returncode == 2 and "a GPU count" in bad.stderr
    finally:
        json_path.unlink(missing_ok=True)


def test_sft_bench_chats_fit_the_recipe_and_train_the_assistants_turn_only(tmp_path):
    from runtime.sft.data import ChatEncoder

    recipe = gpu_sft.bench_recipe("qwen3-1.7b-sft")
    tok, letters = gpu_sft.tokenizer_for(recipe)
    rows = gpu_sft.chats(recipe, letters, steps=1)
    assert rows == gpu_sft.chats(recipe, letters, steps=1)  # deterministic
    encoder = ChatEncoder(tok)
    lengths = []
    for row in rows[:40]:
        ex = encoder.encode(row["messages"])
        user, answer = (m["content"] for m in row["messages"])
        assert len(ex.ids) == len(user) + len(answer) + gpu_sft.SPECIALS <= 2048
        # <bos>, the user's characters and their <eos> untrained; the answer and its <eos> trained
        assert ex.trained == [False] * (len(user) + 2) + [True] * (len(answer) + 1)
        lengths.append(len(ex.ids))
    assert min(lengths) >= 2048 // 8 and max(lengths) > 1500
    total = sum(len(encoder.encode(r["messages"]).ids) for r in rows)
    assert total >= 2 * recipe.sft.tokens_per_step


def test_sft_bench_figures_leave_out_the_warmup_steps():
    rows = [{"step": 0, "eval/loss": 3.0}]
    rows += [
        {
            "step": k,
            "tokens_per_s": 1.0,
            "tokens": 1000 * k,
            "time/step_s": float(k),
            "mfu": 0.1 * k,
            "compile/graphs": float(k == 3),
            "compile/ranks_max/graphs": float(k in (3, 4)),
            "time/train_s": k - 0.5,
            "time/data_s": 0.01,
        }
        for k in (1, 2, 3, 4)
    ]
    got = gpu_sft.summarize(rows, warmup=2, gpus=2)
    assert (got["steps"], got["warmup_steps"], got["measured_steps"]) == (4, 2, 2)
    assert got["tokens_per_s_per_gpu"] == pytest.approx((3000 + 4000) / (3 + 4) / 2)
    assert got["step_s"] == 3.5 and got["mfu"] == pytest.approx(0.35)
    assert got["compile_graphs_by_step"] == [0.0, 0.0, 1.0, 0.0]
    assert got["compile_graphs_ranks_max_by_step"] == [0.0, 0.0, 1.0, 1.0]
    assert got["train_s_by_step"] == [0.5, 1.5, 2.5, 3.5] and got["data_s_by_step"] == [0.01] * 4
    # a profiled step is left out too (its time holds the profiler's)
    rows[3]["trainer/profiled"] = 1.0
    got = gpu_sft.summarize(rows, warmup=1, gpus=2)
    assert got["measured_steps"] == 2 and got["profiled_steps"] == [3]
    assert got["tokens_per_s_per_gpu"] == pytest.approx((2000 + 4000) / (2 + 4) / 2)
    assert got["alloc_retries_by_step"] == [None] * 4  # none on a CPU (or before 2026-11-30)
