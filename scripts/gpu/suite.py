"""The GPU suite (`pytest -m gpu`) in groups that each fit one remote command of 10 minutes.

Each group names its tests as pytest node ids (a file, a test, or one case of a parametrized
test), the GPUs it needs (2: some of its tests skip on fewer; 1: none does) and its estimated
minutes on H200s with the stack installed. The estimates come from the committed logs of
earlier runs (bench/results: gpu_tests*.log, gpu_faults*.log, their `fault-exit` lines and
pytest totals; a group's log from `device_run.sh` has each test's seconds, `--durations=0`).
tests/test_gpu_suite.py checks that every gpu-marked test is in exactly one group.

`scripts/gpu/device_run.sh tests GROUP` runs one group, `... suite GROUP...` several at once
on GPUs of their own; this file answers them (standard library only: it runs on the GPU
machine before anything is installed):

    python3 scripts/gpu/suite.py list            # the groups: name, GPUs, minutes, tests
    python3 scripts/gpu/suite.py gpus GROUP      # how many GPUs GROUP needs
    python3 scripts/gpu/suite.py tests GROUP     # its node ids, one a line
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# What one group may take, in estimated minutes: a remote command has 10, of which the install
# (the first call of a machine), pytest's start and returning the logs take up to 2, and an
# estimate may be a minute short.
BOUND_MINUTES = 7.0

F = "tests/test_gpu_faults.py::"
R = "tests/test_gpu_runtime.py::"
TWO_GPU_KILL = F + "test_a_killed_service_on_two_gpus_ends_the_run"


@dataclass(frozen=True)
class Group:
    """Tests that run together in one command, on `gpus` GPUs, in about `minutes`."""

    gpus: int
    minutes: float
    tests: tuple[str, ...]


GROUPS: dict[str, Group] = {
    # two GPUs each
    "ranks": Group(
        2,
        5.2,
        (
            "tests/test_gpu_trainer_ranks.py",
            "tests/test_gpu_reference_ranks.py",
            "tests/test_gpu_vllm_tp.py",
        ),
    ),
    "push": Group(
        2,
        3.5,
        (
            "tests/test_gpu_weight_sync.py",
            R + "test_tiny_gpu_learns_through_vllm_and_the_weight_push",
            F + "test_gpu_memory_taken_from_the_generator_ends_the_run",
        ),
    ),
    "kills-2gpu": Group(
        2,
        4.4,
        (TWO_GPU_KILL + "[push-sender-killed]", TWO_GPU_KILL + "[trainer-rank-killed]"),
    ),
    "oom-step": Group(
        2,
        5.9,
        (
            F + "test_the_trainer_out_of_memory_in_its_first_step_ends_the_run",
            F + "test_one_trainer_rank_out_of_memory_in_its_backward_ends_the_run",
        ),
    ),
    "oom-nccl": Group(
        2,
        5.0,
        (
            F + "test_a_trainer_rank_out_of_memory_in_nccl_is_named_out_of_memory",
            F + "test_a_trainer_rank_killed_mid_publish_ends_the_run",
        ),
    ),
    "oom-wait": Group(
        2,
        5.7,
        (
            F + "test_one_trainer_rank_out_of_memory_ends_the_run_while_the_other_waits",
            TWO_GPU_KILL + "[push-receiver-killed]",
        ),
    ),
    # one GPU each
    "kills-1gpu": Group(
        1,
        5.2,
        (
            F + "test_a_killed_gpu_service_ends_the_run_and_the_rerun_resumes",
            F + "test_an_occupied_gpu_is_refused_before_anything_starts",
        ),
    ),
    "memory": Group(
        1,
        5.7,
        (
            F + "test_gpu_memory_taken_during_start_up_ends_the_run",
            F + "test_gpu_memory_taken_once_the_services_are_up_leaves_the_run_training",
            F + "test_a_cuda_error_in_compiled_code_ends_the_run_and_the_rerun_resumes",
        ),
    ),
    "trainer": Group(
        1,
        4.7,
        ("tests/test_gpu_trainer.py", F + "test_a_silent_generator_is_ended_by_the_watchdog"),
    ),
    "vllm": Group(
        1,
        # 3.5 min in gpu_h200x4_2026-11-28 (gpu_suite_vllm_runtime_first.log), and an engine of
        # its own process since (its start 25-70 s as the module's, 48 greedy calls, 3 loads)
        5.0,
        # the runtime test first: test_gpu_vllm.py's in-process engines hold half the GPU until
        # the pytest process ends, and the runtime test's `forgesky eval` starts vLLM at 0.85
        (R + "test_tiny_gpu_learns_on_one_gpu_colocated", "tests/test_gpu_vllm.py"),
    ),
    # SFT through the trainer actor, varlen and document attention: no estimate from a run yet
    # (start-up, the blocks compiled, 30 steps of a 0.6B model and its export guessed at 3
    # minutes each)
    "sft": Group(1, 6.0, ("tests/test_gpu_sft.py",)),
    # an engine of its own (built with LoRA), in a process of its own
    # the runtime test first, for the same reason as the vllm group's
    "lora": Group(
        1,
        # 3.2 min in gpu_h200_2026-11-29-lora (gpu_suite_lora.log), and a second LoRA engine
        # since, its core in a process of its own (the module's took 88 s to start there)
        5.5,
        (R + "test_tiny_gpu_learns_with_a_lora_adapter", "tests/test_gpu_lora.py"),
    ),
}


def covers(entry: str, node_id: str) -> bool:
    """Whether the group entry `entry` (a file, a test, a case) covers the test `node_id`."""
    return node_id == entry or node_id.startswith((entry + "::", entry + "["))


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        for name, group in GROUPS.items():
            print(
                f"{name:<11} {group.gpus} GPU{'s' if group.gpus > 1 else ' '} "
                f"~{group.minutes:.1f} min  {' '.join(group.tests)}"
            )
        return 0
    if len(argv) == 2 and argv[0] in ("gpus", "tests"):
        group = GROUPS.get(argv[1])
        if group is None:
            print(f"no GPU test group {argv[1]!r}: one of {', '.join(GROUPS)}", file=sys.stderr)
            return 2
        print(group.gpus if argv[0] == "gpus" else "\n".join(group.tests))
        return 0
    print("usage: suite.py list | gpus GROUP | tests GROUP", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
