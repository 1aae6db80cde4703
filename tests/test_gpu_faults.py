"""GPU faults caused for real (run with `pytest -m gpu` on a GPU machine): each ends the run
non-zero within a bound with one line naming the service, where it runs and the cause, leaves
no process of the run, no shared-memory segment and no GPU memory behind, and the rerun resumes
from the newest committed checkpoint.

The run is the tiny-gpu recipe through `python -m runtime`, as a launched task runs it: on one
GPU the plan `forgesky plan tiny-gpu --gpus 1 --set layout.share=all` gives (vLLM in the
generator's proc, the TorchTitan trainer, the reference when enabled, taking turns; versions by
CUDA IPC), on two GPUs the one with the NCCL weight push between them.

Each test prints its measured seconds as `fault-exit NAME S s` (the reliability table in
docs/spot-and-faults.md is taken from those lines in the committed log).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import finish, kill_tree, service_proc, start, wait_for_line

pytestmark = pytest.mark.gpu

EXIT_BOUND_S = 60.0  # the bound: a hang fails the test, a slow exit too
# Dying procs may print their own traces, and the resource tracker of a killed proc's parent
# reports the semaphore it cleans up; a segment left in /dev/shm is what must never happen
# (assert_clean compares /dev/shm with what was there before).
LEAKS = ("leaked shared_memory",)


def one_gpu_args(run_dir: Path, *sets: str) -> list[str]:
    args = ["--recipe", "tiny-gpu", "--gpus", "1", "--run-dir", str(run_dir)]
    for item in ("layout.share=all", "eval.enabled=false", *sets):
        args += ["--set", item]
    return args


def failure_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("forgesky:") and "failed" in x]


def ended(code: int, out: str, name: str, seconds: float, note: str = "") -> str:
    """The run's whole output, printed with its `fault-exit` line; it must have failed within
    the bound with a failure line, which is returned."""
    print(out)
    print(f"fault-exit {name} {seconds:.1f} s{f' ({note})' if note else ''}")
    assert code == 1, out
    assert seconds < EXIT_BOUND_S, out
    lines = failure_lines(out)
    assert lines, out
    return lines[0]


def smi(*query: str) -> list[str]:
    """nvidia-smi's CSV values (no header, no units) for `query`, of this session's GPUs: those
    CUDA_VISIBLE_DEVICES lists (another group of the GPU suite may run on the others), else
    all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    text = subprocess.run(
        [
            "nvidia-smi",
            *(["-i", visible] if visible else []),
            *query,
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return text.split()


def gpu_pids() -> set[int]:
    """Processes holding memory on this session's GPUs, where nvidia-smi can see them (in a
    container it may list none)."""
    return {int(x) for x in smi("--query-compute-apps=pid") if x.isdigit()}


def gpu_used_gb() -> float:
    """Memory in use on this session's GPUs together (nvidia-smi, MiB), GB."""
    return sum(float(x) for x in smi("--query-gpu=memory.used")) * 2**20 / 1e9


class Baseline:
    """What the GPUs held before the run: its processes and memory."""

    def __init__(self) -> None:
        self.pids = gpu_pids()
        self.used_gb = gpu_used_gb()


def assert_clean(out: str, run_pid: int, nothing_left, before: Baseline) -> None:
    """Nothing of the run left: no process of its session, no new shared-memory segment, and
    within 10 s of its exit no new process on a GPU and GPU memory back to what it was."""
    nothing_left(out, run_pid, noise=LEAKS)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not gpu_pids() - before.pids and gpu_used_gb() < before.used_gb + 1.0:
            break
        time.sleep(0.2)
    assert not gpu_pids() - before.pids, f"GPU memory still held by {gpu_pids() - before.pids}"
    assert gpu_used_gb() < before.used_gb + 1.0, (gpu_used_gb(), before.used_gb)


class GpuHog:
    """Another process taking GPU memory: `gb` GB, or (gb=None) all it can get but `leave_gb`,
    on GPU `gpu`. `armed`: CUDA is set up at once, the memory taken at `take()` (a fraction of
    a second, where starting the process takes seconds)."""

    def __init__(
        self, gb: float | None = None, leave_gb: float = 0.0, gpu: int = 0, armed: bool = False
    ) -> None:
        code = textwrap.dedent(
            f"""
            import sys, time, torch
            torch.cuda.set_device({gpu})
            torch.empty(1, device="cuda")
            if {armed!r}:
                print("armed", flush=True)
                sys.stdin.readline()
            held, chunk = [], 1 << 30
            want = {gb!r}
            leave = int({leave_gb!r} * 2**30)
            while chunk >= 2 << 20:
                if want is not None and sum(t.numel() for t in held) >= want * 2**30:
                    break
                free = torch.cuda.mem_get_info()[0]
                if want is None and free - chunk < leave:
                    chunk //= 2
                    continue
                try:
                    held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    chunk //= 2
            print(f"held {{sum(t.numel() for t in held) / 2**30:.1f}} GB", flush=True)
            time.sleep(3600)
            """
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.line = ""
        if armed:
            assert self._read() == "armed", self.line
        else:
            self._held()

    def _read(self) -> str:
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()
        return self.line

    def _held(self) -> None:
        assert self._read().startswith("held"), self.line

    def take(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self._held()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def newest_committed(run_dir: Path) -> int:
    steps = [
        int(p.parent.name.removeprefix("step_"))
        for p in (run_dir / "checkpoints").glob("step_*/COMMITTED")
    ]
    assert steps, f"no committed checkpoint in {run_dir}"
    return max(steps)


def resumes(args: list[str], run_dir: Path, nothing_left, before: Baseline) -> None:
    """The same command, to one step past the newest committed checkpoint: it resumes there."""
    newest = newest_committed(run_dir)
    again = start([*args, "--steps", str(newest + 1)])
    code, out = finish(again, timeout=600)
    assert code == 0, out
    assert f"resumed from step {newest}" in out, out
    assert_clean(out, again.pid, nothing_left, before)


def test_an_occupied_gpu_is_refused_before_anything_starts(tmp_path: Path, nothing_left):
    before = Baseline()
    hog = GpuHog(leave_gb=0.3)  # the plan puts ~6 GB there
    listed = hog.proc.pid in gpu_pids()  # nvidia-smi in a container may not see it
    try:
        t0 = time.monotonic()
        proc = start(one_gpu_args(tmp_path / "run"))
        code, out = finish(proc, timeout=120)
        seconds = time.monotonic() - t0
    finally:
        hog.stop()
    print(out)
    print(f"fault-exit occupied-gpu {seconds:.1f} s")
    assert code == 2, out
    assert "is in use" in out, out
    if listed:
        assert f"pid {hog.proc.pid}" in out, out
    assert "starting services" not in out, out  # refused before any proc
    assert seconds < 30, out
    assert_clean(out, proc.pid, nothing_left, before)


def memory_taken_at(
    tmp_path: Path,
    nothing_left,
    after: str,
    name: str,
    leave_gb: float,
    args=None,
    gpu: int = 0,
    armed: bool = False,
    place: str | None = None,
) -> str:
    """Start a run (default: the one-GPU plan), let another process take GPU `gpu`'s memory
    (all but `leave_gb`) once the run prints `after`, and check that the run ends within the
    bound, naming that GPU, and leaves the node clean; its failure line. `armed`: the other
    process sets up CUDA before the run starts and takes the memory within a fraction of a
    second of `after`. `place`: where the failure line says the failed service runs (default
    GPU `gpu` alone)."""
    before = Baseline()
    hog = GpuHog(leave_gb=leave_gb, gpu=gpu, armed=True) if armed else None
    proc = start(args or one_gpu_args(tmp_path / "run", "grpo.steps=2000"))
    try:
        head = wait_for_line(proc, after, timeout=600)
        if hog is None:
            hog = GpuHog(leave_gb=leave_gb, gpu=gpu)
        else:
            hog.take()
        taken = time.monotonic()
        code, out = finish(proc, timeout=EXIT_BOUND_S + 60)
        seconds = time.monotonic() - taken
    finally:
        if hog is not None:
            hog.stop()
        kill_tree(proc)
    out = "".join(head) + out
    first = ended(code, out, name, seconds, hog.line)
    assert "memory" in first.lower() and (place or f"(on node 0 GPU {gpu})") in first, first
    assert_clean(out, proc.pid, nothing_left, before)
    return first


def test_gpu_memory_taken_during_start_up_ends_the_run(tmp_path: Path, nothing_left):
    """Another process takes the GPU's memory between the start-up check and the services'
    allocations (the trainer's weights, vLLM's KV cache): the first service to allocate runs
    out of memory and the run ends naming it."""
    first = memory_taken_at(
        tmp_path, nothing_left, "starting services", "memory-taken-during-start-up", 0.5
    )
    assert "out of memory" in first.lower(), first


def test_gpu_memory_taken_once_the_services_are_up_leaves_the_run_training(
    tmp_path: Path, nothing_left
):
    """Another process takes all but 0.2 GB of the GPU once tiny-gpu's services are up: each
    service's allocator already holds what its steps use (vLLM its KV cache, the trainer its
    blocks from the first step, which comes within a second), so the run trains on and ends
    as asked, on time."""
    before = Baseline()
    proc = start(one_gpu_args(tmp_path / "run", "grpo.steps=40"))
    hog = None
    try:
        head = wait_for_line(proc, "services ready", timeout=600)
        hog = GpuHog(leave_gb=0.2)
        code, out = finish(proc, timeout=EXIT_BOUND_S + 60)
    finally:
        if hog is not None:
            hog.stop()
        kill_tree(proc)
    out = "".join(head) + out
    print(out)
    print(f"memory taken after start-up: {hog.line}")
    assert code == 0, out
    assert "step 40/40" in out, out
    assert_clean(out, proc.pid, nothing_left, before)


# qwen3-1.7b with random weights (the Hub-free prompts and tokenizer): its first training step
# needs tens of GB beyond the weights the trainer holds at start-up.
FULL_SIZE = (
    "model.init=random",
    "model.tokenizer=builtin:arith",
    "dataset.path=builtin:arith",
    "eval.enabled=false",
    "grpo.kl_beta=0",
    "layout.reference.enabled=false",
    "grpo.max_response_tokens=512",
    # start-up over speed
    "trainer.compile=false",
    "generator.enforce_eager=true",
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the trainer alone on a GPU: two")
def test_the_trainer_out_of_memory_in_its_first_step_ends_the_run(tmp_path: Path, nothing_left):
    """qwen3-1.7b on two GPUs, the trainer alone on GPU 1 (`layout.share=none`): another
    process takes all but 0.5 GB of GPU 1 the moment the services are up, before the trainer's
    first step has allocated its activations, gradients and AdamW's moments; the trainer runs
    out of memory at the step's first allocation (on two H100s: the 3.2 GB buffer version 0 is
    pushed from) and the run ends naming it and GPU 1. No checkpoint yet: nothing to resume."""
    args = ["--recipe", "qwen3-1.7b", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    # the plan's own two-GPU layout on an H200 is every service on both GPUs (the trainer one
    # rank a GPU): a GPU each is asked for
    for item in (*FULL_SIZE, "layout.share=none", "grpo.steps=20"):
        args += ["--set", item]
    name = "trainer-out-of-memory-in-its-step"
    first = memory_taken_at(
        tmp_path, nothing_left, "services ready", name, 0.5, args, gpu=1, armed=True
    )
    assert "trainer actor failed" in first and "out of memory" in first.lower(), first
    assert "(proc " not in first, first  # one trainer proc


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two trainer ranks: two GPUs")
def test_a_trainer_rank_out_of_memory_in_nccl_is_named_out_of_memory(tmp_path: Path, nothing_left):
    """qwen3-1.7b on two GPUs as the plan lays it out on two H200s (every service on both,
    the trainer one rank a GPU): another process takes all but 0.5 GB of GPU 1 the moment the
    services are up. Rank 1's first collective (the layout of version 0, before any step)
    needs NCCL's buffers on that GPU, and NCCL's allocation fails; torch says only `NCCL Error
    1: unhandled cuda error`. The run's line names what NCCL said (out of memory), rank 1 and
    its GPU (2 x H200 at eeb25fd it said `RuntimeError: NCCL Error 1: unhandled cuda error (in
    fsdp_trainer.py:334 hf_layout) (proc 1/2)`: rank 1, without its cause)."""
    args = ["--recipe", "qwen3-1.7b", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in (*FULL_SIZE, "layout.share=all", "grpo.steps=20"):
        args += ["--set", item]
    name = "trainer-rank-out-of-memory-in-nccl"
    first = memory_taken_at(
        tmp_path,
        nothing_left,
        "services ready",
        name,
        0.5,
        args,
        gpu=1,
        armed=True,
        place="(proc 1/2) (on node 0 GPU 1)",
    )
    assert "trainer actor failed" in first and "out of memory" in first.lower(), first


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two trainer ranks: two GPUs")
def test_one_trainer_rank_out_of_memory_ends_the_run_while_the_other_waits(
    tmp_path: Path, nothing_left
):
    """qwen3-1.7b on two GPUs with every service sharing them: the trainer is FSDP over both,
    a generator on each GPU. Another process takes all but 8 GB of GPU 1 the moment the
    services are up (room for generator1's sampling and the 3.2 GB it receives each version
    through, none for a training step at 16384 tokens a micro-batch): trainer rank 1
    runs out of memory in its first step while rank 0 waits for it in a collective. The run
    ends at once on rank 1's error (it once waited for rank 0's answer, which never came)."""
    args = ["--recipe", "qwen3-1.7b", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in (*FULL_SIZE, "layout.share=all", "grpo.steps=20"):
        args += ["--set", item]
    name = "one-trainer-rank-out-of-memory"
    first = memory_taken_at(
        tmp_path,
        nothing_left,
        "services ready",
        name,
        8.0,
        args,
        gpu=1,
        armed=True,
        place="(proc 1/2) (on node 0 GPU 1)",
    )
    # torch's own message names the GPU as rank 1's process sees it ("GPU 0"); the line adds
    # which proc it was and the GPU the plan gave it
    assert "trainer actor failed" in first, first


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the generator alone on a GPU: two")
def test_gpu_memory_taken_from_the_generator_ends_the_run(tmp_path: Path, nothing_left):
    """tiny-gpu on two GPUs, the generator alone on GPU 0 (vLLM at 0.85 of it): another process
    takes GPU 0's memory while the services start, so vLLM cannot fit its weights and KV
    cache in what is left; the run ends naming the generator, its GPU and the memory."""
    args = ["--recipe", "tiny-gpu", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in ("eval.enabled=false", "grpo.steps=2000"):
        args += ["--set", item]
    name = "generator-memory-taken-during-start-up"
    first = memory_taken_at(tmp_path, nothing_left, "starting services", name, 0.5, args)
    assert "generator0 actor failed" in first, first


KILLS = [
    # vLLM's engine runs in the generator's proc: killing it kills the engine mid-sampling
    ("generator-engine-killed", "generator0", 0, (), "generator0 actor failed: process killed"),
    ("trainer-killed", "trainer", 0, (), "trainer actor failed: process killed"),
    (
        "reference-killed",
        "reference",
        0,
        ("layout.reference.enabled=true", "grpo.kl_beta=0.1"),
        "reference actor failed: process killed",
    ),
]


def kill_mid_run(
    args: list[str], name: str, service: str, rank: int, line: str, place: str | None, nothing_left
) -> None:
    """Run `args` until a checkpoint is committed and a step more is logged, kill -9 the proc
    of `service` (rank `rank`), and check the exit, its line, the clean node and the resume."""
    before = Baseline()
    proc = start([*args, "--steps", "2000"])
    try:
        head = wait_for_line(proc, "checkpoint step ", timeout=600)
        head += wait_for_line(proc, "step ", timeout=120)
        service_proc(proc.pid, service, rank).kill()
        killed = time.monotonic()
        code, out = finish(proc, timeout=EXIT_BOUND_S + 60)
        seconds = time.monotonic() - killed
    finally:
        kill_tree(proc)
    out = "".join(head) + out
    first = ended(code, out, name, seconds)
    assert line in first, first
    if place:
        assert f"(on {place})" in first, first
    assert_clean(out, proc.pid, nothing_left, before)
    run_dir = Path(args[args.index("--run-dir") + 1])
    resumes(args, run_dir, nothing_left, before)


@pytest.mark.parametrize(
    ("name", "service", "rank", "sets", "line"), KILLS, ids=[k[0] for k in KILLS]
)
def test_a_killed_gpu_service_ends_the_run_and_the_rerun_resumes(
    tmp_path: Path, nothing_left, name, service, rank, sets, line
):
    args = one_gpu_args(tmp_path / "run", *sets, "grpo.checkpoint_interval=2")
    kill_mid_run(args, name, service, rank, line, "node 0 GPU 0", nothing_left)


def test_a_cuda_error_in_compiled_code_ends_the_run_and_the_rerun_resumes(
    tmp_path: Path, nothing_left
):
    """The trainer's step runs a torch.compile'd kernel that faults on the GPU (a custom loss,
    tests/failing_losses.py, reads far past the end of a tensor a few steps in): the CUDA error
    ends the run naming the trainer and its GPU, nothing is left, and the rerun (the recipe's
    own loss) resumes from the last committed checkpoint."""
    from fault_runs import RuntimeRun

    before = Baseline()
    run_dir = tmp_path / "run"
    args = one_gpu_args(run_dir, "grpo.checkpoint_interval=1")
    log = tmp_path / "run.log"
    run = RuntimeRun(
        [*args, "--set", "grpo.loss=failing_losses:cuda_error_in_compiled_code"], log=log
    )
    try:
        code = run.finish(timeout=600)
        exited = time.monotonic() - run.started
    finally:
        if run.proc.poll() is None:
            run.kill()
    out = run.output
    # the fault comes in the step after the last one logged (tiny-gpu: about a second each)
    logged = [float(x[1:8]) for x in log.read_text().splitlines() if "] step " in x]
    assert logged, out
    first = ended(
        code, out, "cuda-error-in-compiled-code", exited - logged[-1], "after the last step line"
    )
    assert "trainer actor failed" in first and "CUDA error" in first, first
    assert "(on node 0 GPU 0)" in first, first
    assert_clean(out, run.proc.pid, nothing_left, before)
    resumes(args, run_dir, nothing_left, before)


def test_a_silent_generator_is_ended_by_the_watchdog(tmp_path: Path, nothing_left):
    """A generator that stops answering without dying (its proc stopped, as a wedged kernel
    would leave it): the watchdog's bound, from the recipe and the calls so far, ends the run."""
    before = Baseline()
    run_dir = tmp_path / "run"
    args = one_gpu_args(
        run_dir, "grpo.checkpoint_interval=2", "watchdog.min_s=20", "watchdog.factor=10"
    )
    proc = start([*args, "--steps", "2000"])
    frozen = None
    try:
        head = wait_for_line(proc, "checkpoint step ", timeout=600)
        frozen = service_proc(proc.pid, "generator0", 0)
        frozen.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        code, out = finish(proc, timeout=EXIT_BOUND_S + 60)
        seconds = time.monotonic() - stopped
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pid, signal.SIGKILL)
        kill_tree(proc)
    out = "".join(head) + out
    first = ended(code, out, "generator-silent", seconds)
    assert first.startswith("forgesky: generator0 actor failed: stopped answering"), first
    assert "node 0 GPU 0" in first, first
    assert_clean(out, proc.pid, nothing_left, before)
    resumes(args, run_dir, nothing_left, before)


TWO_GPU_KILLS = [
    # the NCCL push: the receiving side gone while the sender is in the collective
    ("push-receiver-killed", "generator0", 0, (), "generator0 actor failed: process killed", None),
    # the sending side gone while the receiver waits for the version
    ("push-sender-killed", "trainer", 0, (), "trainer actor failed: process killed", None),
    # one rank of the two-rank FSDP trainer (every service on both GPUs, taking turns): the
    # other rank waits in the step's collectives, or soon does
    (
        "trainer-rank-killed",
        "trainer",
        1,
        ("layout.share=all",),
        "trainer actor failed: process killed",
        "node 0 GPU 1",  # the killed proc's (rank 1's) GPU
    ),
]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs: the NCCL push, FSDP2")
@pytest.mark.parametrize(
    ("name", "service", "rank", "sets", "line", "place"),
    TWO_GPU_KILLS,
    ids=[k[0] for k in TWO_GPU_KILLS],
)
def test_a_killed_service_on_two_gpus_ends_the_run(
    tmp_path: Path, nothing_left, name, service, rank, sets, line, place
):
    """tiny-gpu on two GPUs. Without sets: a GPU each, a version pushed by NCCL every step; the
    kill lands between steps, so the other side is in, or soon enters, a push collective and
    must not wait forever. With layout.share=all: the trainer is FSDP over both GPUs."""
    args = ["--recipe", "tiny-gpu", "--gpus", "2", "--run-dir", str(tmp_path / "run")]
    for item in ("eval.enabled=false", "grpo.checkpoint_interval=2", *sets):
        args += ["--set", item]
    kill_mid_run(args, name, service, rank, line, place, nothing_left)


def rank_1_fails(loss: str, marker: str, name: str, tmp_path: Path, nothing_left) -> str:
    """tiny-gpu with the trainer FSDP over two GPUs (layout.share=all, versions by CUDA IPC)
    and `failing_losses:LOSS`, which makes rank 1 fail from inside its proc a few steps in,
    after a committed checkpoint, and prints `failing_losses: MARKER at T`. Checks the exit
    within the bound from T, the clean node and that the rerun (the recipe's own loss)
    resumes; the run's failure line."""
    import re

    before = Baseline()
    run_dir = tmp_path / "run"
    args = ["--recipe", "tiny-gpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in ("eval.enabled=false", "grpo.checkpoint_interval=2", "layout.share=all"):
        args += ["--set", item]
    proc = start([*args, "--steps", "2000", "--set", f"grpo.loss=failing_losses:{loss}"])
    try:
        code, out = finish(proc, timeout=600)
        exited = time.monotonic()
    finally:
        kill_tree(proc)
    found = re.search(rf"failing_losses: {marker} at ([0-9.]+)", out)
    assert found, out[-3000:]
    first = ended(code, out, name, exited - float(found[1]))
    assert_clean(out, proc.pid, nothing_left, before)
    assert "checkpoint step " in out, out[-3000:]
    resumes(args, run_dir, nothing_left, before)
    return first


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two trainer ranks: two GPUs")
def test_a_trainer_rank_killed_mid_publish_ends_the_run(tmp_path: Path, nothing_left):
    """Rank 1 of the two-rank trainer dies between two gathered groups of a version while rank
    0 goes on into the next group's gather: the run ends naming the proc and its GPU."""
    first = rank_1_fails(
        "rank_1_killed_mid_publish",
        "rank 1 killed mid-publish",
        "trainer-rank-killed-mid-publish",
        tmp_path,
        nothing_left,
    )
    assert "trainer actor failed: process killed by SIGKILL (proc 1/2)" in first, first
    assert "(on node 0 GPU 1)" in first, first  # rank 1's GPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two trainer ranks: two GPUs")
def test_one_trainer_rank_out_of_memory_in_its_backward_ends_the_run(tmp_path: Path, nothing_left):
    """Rank 1's backward asks the CUDA allocator for a whole GPU while rank 0 waits for it in
    the backward's reduce-scatter: the run ends on rank 1's out-of-memory error, naming its
    proc and GPU."""
    first = rank_1_fails(
        "rank_1_out_of_memory_in_backward",
        "rank 1 allocating in its backward",
        "trainer-rank-out-of-memory-in-backward",
        tmp_path,
        nothing_left,
    )
    assert "trainer actor failed: OutOfMemoryError" in first, first
    assert "(in failing_losses.py:" in first, first
    assert "(proc 1/2) (on node 0 GPU 1)" in first, first
