"""A GPU another process holds is refused before the run starts, in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recipes import UserError, apply_overrides, load_recipe, plan
from runtime.procs.gpu_check import (
    GpuState,
    check_gpus_free,
    engine_room_explained,
    engine_room_line,
    parse_nvidia_smi,
)

GPUS_CSV = """0, GPU-aaaa, 1, 81559
1, GPU-bbbb, 80000, 81559
2, GPU-cccc, 0, 81559
"""
APPS_CSV = """GPU-bbbb, 4242, python3, 79990
"""


def test_nvidia_smi_rows_become_gpus_with_their_processes():
    gpus = parse_nvidia_smi(GPUS_CSV, APPS_CSV)
    assert [g.index for g in gpus] == ["0", "1", "2"]
    busy = gpus[1]
    assert busy.uuid == "GPU-bbbb" and busy.used_gb == pytest.approx(83.9, abs=0.1)
    assert busy.processes == ((4242, "python3", pytest.approx(83.9, abs=0.1)),)
    assert gpus[0].processes == () and gpus[0].free_gb == pytest.approx(85.5, abs=0.1)
    # what a driver prints for a GPU it cannot read, or no GPU at all: nothing
    assert parse_nvidia_smi("0, GPU-x, [N/A], [N/A]\n", "") == []


def three_gpu_plan():
    return plan(apply_overrides(load_recipe("qwen3-1.7b"), ["layout.share=none"]), 3)


def test_a_gpu_taken_by_another_process_is_one_line_naming_it():
    p = three_gpu_plan()  # generator 0, reference 1, trainer 2
    with pytest.raises(UserError) as info:
        check_gpus_free(p, 0, parse_nvidia_smi(GPUS_CSV, APPS_CSV))
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("GPU 1 is in use: 1.6 of 86 GB free (83.9 GB taken by pid 4242 ")
    assert "python3 83.9 GB), and the plan puts reference ~8 GB there" in line
    assert line.endswith("stop that process or give this run other GPUs (CUDA_VISIBLE_DEVICES)")


def test_free_gpus_pass_and_the_run_may_be_given_other_ones():
    p = three_gpu_plan()
    free = [GpuState(str(i), f"GPU-{i}", 0.0, 85.5) for i in range(4)]
    check_gpus_free(p, 0, free)
    # CUDA_VISIBLE_DEVICES=0,2,3: the plan's GPU 1 is the host's GPU 2, which is free
    check_gpus_free(p, 0, parse_nvidia_smi(GPUS_CSV + "3, GPU-dddd, 0, 81559\n", APPS_CSV), "0,2,3")
    # no nvidia-smi on this host: nothing to check
    check_gpus_free(p, 0, None)
    # the host's GPU 1 taken: with CUDA_VISIBLE_DEVICES=0,1,3 it is the plan's GPU 1 too; with
    # 0,2,3 the host's GPU 2 taken is the plan's GPU 1, named both ways
    taken = [GpuState("1", "GPU-1", 84.0, 85.5, ((9, "other", 84.0),))]
    taken += [GpuState(str(i), f"GPU-{i}", 0.0, 85.5) for i in (0, 2, 3)]
    with pytest.raises(UserError, match=r"^GPU 1 is in use"):
        check_gpus_free(p, 0, taken, "0,1,3")
    with pytest.raises(UserError, match=r"^GPU 1 \(host GPU 2\) is in use"):
        check_gpus_free(p, 0, [*taken[1:], GpuState("2", "GPU-2", 84.0, 85.5)], "0,2,3")


def test_a_generator_that_profiles_its_gpu_needs_its_share_of_it_free():
    # vLLM starts only with gpu_memory_utilization (0.85) of the GPU free: 20 GB taken is too much
    p = three_gpu_plan()
    gpus = [GpuState("0", "GPU-0", 20.0, 85.5, ((7, "other", 20.0),))] + [
        GpuState(str(i), f"GPU-{i}", 0.0, 85.5) for i in (1, 2)
    ]
    with pytest.raises(UserError, match=r"GPU 0 is in use: 65.5 of 86 GB free .* generator ~73 GB"):
        check_gpus_free(p, 0, gpus)


def test_a_gpu_the_host_does_not_have_is_named():
    with pytest.raises(
        UserError,
        match=r"the plan uses GPU 1 on this node, which nvidia-smi does not list; it lists 0",
    ):
        check_gpus_free(three_gpu_plan(), 0, [GpuState("0", "GPU-0", 0.0, 85.5)])


# What a host of two H200s showed when a run killed from outside went on starting its own vLLM on
# GPU 0 while the next run's engine profiled it (vLLM: "Available KV cache memory: -0.13 GiB")
BUSY_GPUS_CSV = """0, GPU-aaaa, 131072, 143771
1, GPU-bbbb, 40960, 143771
"""
BUSY_APPS_CSV = """GPU-aaaa, 5150, python3, 65536
GPU-aaaa, 6060, python3, 65536
GPU-bbbb, 6100, python3, 40960
"""
NO_CACHE = ValueError(
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine (this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name).\nSee https://docs.vllm.ai/ for more details."
)


def test_an_engine_without_room_says_what_held_its_gpu_in_one_line(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the generator's GPU, as its proc sees it
    gpus = parse_nvidia_smi(BUSY_GPUS_CSV, BUSY_APPS_CSV)
    line = engine_room_line(NO_CACHE, gpus, own_pid=6060)
    assert line is not None and "\n" not in line
    assert line.startswith(
        "the generator's engine found no room on its GPU: GPU 0 had 137.4 of 151 GB in use by "
        "pid 5150 python3 68.7 GB, pid 6060 python3 68.7 GB (this engine); "
    )
    assert "GPU 1" not in line  # not this engine's
    assert "stop it or give this run other GPUs (CUDA_VISIBLE_DEVICES)" in line
    assert line.endswith("[No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine (this flag also "
                         "controls CPU memory reservation on the CPU backend, despite its name).]")  # fmt: skip
    # any other error, or no answer from nvidia-smi: nothing to add
    assert engine_room_line(ValueError("max_model_len too large"), gpus, 6060) is None
    assert engine_room_line(NO_CACHE, None, 6060) is None


def test_an_engines_start_without_room_raises_that_line_read_from_nvidia_smi(tmp_path: Path,
                                                                            monkeypatch):  # fmt: skip
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=*) printf '{BUSY_GPUS_CSV}' ;;\n"
        f"  *) printf '{BUSY_APPS_CSV}' ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")  # a UUID names it as well
    with pytest.raises(RuntimeError) as info, engine_room_explained():
        raise NO_CACHE
    assert str(info.value).startswith(
        "the generator's engine found no room on its GPU: GPU 0 had 137.4 of 151 GB in use by "
        "pid 5150 python3 68.7 GB, pid 6060 python3 68.7 GB"
    )
    assert info.value.__cause__ is NO_CACHE
    with pytest.raises(KeyError), engine_room_explained():  # anything else as it was
        raise KeyError("model.layers.0")
