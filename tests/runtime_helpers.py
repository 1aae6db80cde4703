"""Helpers shared by the tests: runs of the real runtime in a subprocess (real Monarch procs,
TorchStore), what a finished run must not leave behind, free ports, and token batches.
conftest.py offers the ones tests take as fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "SupervisionError", "resource_tracker", "leaked shared_memory")
# What a run that ends by a signal or a failure must not print either (the lifecycle's own app).
LIFECYCLE_NOISE = (
    *NOISE,
    "leaked",
    "Monarch internal logs",
    "Unhandled monarch error",
    "KeyboardInterrupt",
    "CancelledError",
)


def run_on_one_gpu(run_dir: Path, overrides: list[str] | tuple[str, ...]) -> str:
    """`tests/shared_gpu_app.py`: the tiny recipe with generator, reference and trainer placed
    on GPU index 0 (on a CPU host the index only sets CUDA_VISIBLE_DEVICES); its output, after
    checking that it exited 0 and printed no error noise."""
    args = [sys.executable, str(ROOT / "tests/shared_gpu_app.py"), str(run_dir)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for word in NOISE:
        assert word not in out, f"{word!r} in output:\n{out}"
    return out


def shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


# How long a new segment that no process of another run holds may take to go before it counts
# as left behind: a run beside this one (another group of the GPU suite on other GPUs of the
# host, another test session) unlinks the segments of its ended procs as it ends.
SHM_SETTLE_S = 60.0
# Segments named after the process that made them (runtime.procs.host): its pid.
_PID_NAMED = (r"torch_(\d+)_\d+_\d+", r"cuda\.shm\.\d+\.([0-9a-f]+)\.\d+", r"forgesky_(\d+)-")


def left_in_shm(
    before: set[str], session: int | None = None, settle: float = SHM_SETTLE_S
) -> set[str]:
    """The entries of /dev/shm made since `before` that a run (session `session`) left: those
    no live process of another session holds (open, mapped, or named after it) and still
    there after up to `settle` s."""
    deadline = time.monotonic() + settle
    while True:
        new = shm_entries() - before
        left = new - held_elsewhere(new, session) if new else new
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def held_elsewhere(names: set[str], session: int | None) -> set[str]:
    """Of /dev/shm's entries `names`, those a live process outside session `session` holds:
    has open or mapped, or is named after."""
    import re

    held: set[str] = set()
    for name in names:
        for pattern, base in zip(_PID_NAMED, (10, 16, 10), strict=True):
            found = re.match(pattern, name)
            if found and _outside(int(found.group(1), base), session):
                held.add(name)
    paths = {f"/dev/shm/{name}": name for name in names - held}
    for pid in psutil.pids() if paths else ():
        if not _outside(pid, session):
            continue
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{pid}/maps").read_text()
            held.update(name for path, name in paths.items() if path in maps)
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target in paths:
                        held.add(paths[target])
    return held


def _outside(pid: int, session: int | None) -> bool:
    """Whether `pid` is a live process outside session `session`."""
    try:
        return alive(pid) and (session is None or os.getsid(pid) != session)
    except (ProcessLookupError, PermissionError):
        return False


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m runtime ARGS` in its own session, output captured (merged)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "tests"), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    """Read output until a line containing `needle`; returns the lines read so far."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no line with {needle!r} within {timeout} s; got:\n{''.join(lines)}")


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for the process; its exit code and the rest of its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"runtime did not exit within {timeout} s:\n{out}") from None
    return proc.returncode, out


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def leftover_processes(pgid: int) -> list[str]:
    """Processes still in the run's session (the runtime and everything it started)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.info["pid"]) == pgid:
                left.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return left


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_nothing_left(
    output: str,
    *,
    pgid: int | None = None,
    shm_before: set[str] | None = None,
    noise: tuple[str, ...] = NOISE,
) -> None:
    """A finished run printed no noise and left no process of its session (`pgid`) and no
    new shared-memory segment (against `shm_before`; a segment a run beside it holds is not
    its: `left_in_shm`)."""
    noisy = [word for word in noise if word in output]
    assert not noisy, f"{noisy} in output:\n{output}"
    if pgid is not None:
        time.sleep(0.5)
        assert leftover_processes(pgid) == []
    if shm_before is not None:
        left = left_in_shm(shm_before, pgid)
        assert not left, left


def free_port(*hosts: str) -> int:
    """A TCP port free on every one of `hosts` (default: the loopback)."""
    import socket

    hosts = hosts or ("127.0.0.1",)
    while True:
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue


def token_batch(
    vocab: int,
    rows: int,
    width: int,
    prompt: int = 8,
    *,
    seed: int = 0,
    short: int | None = None,
    empty: bool = False,
) -> tuple[Any, Any, Any]:
    """Random tokens `[rows, width]`, the response mask (positions from `prompt` on) and one
    advantage per row (-1 to 1). Row 0's response keeps only `short` tokens (default: half),
    right-padded; with `empty`, row 1 has no response token at all."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, prompt:] = True
    keep = (width - prompt) // 2 if short is None else short
    mask[0, prompt + keep :] = False
    if empty:
        mask[1] = False
    return tokens, mask, torch.linspace(-1, 1, rows)


def fsdp_on_cpu(spec: Any, **options: Any) -> Any:
    """The GPU trainer on the CPU in float32 (its math, without autocast), learning rate 1e-2,
    temperature 0.7, seed 1; `options` go to FSDPTrainer."""
    import torch

    from runtime.backends import OptimizerConfig
    from runtime.backends.fsdp_trainer import FSDPTrainer

    return FSDPTrainer(
        spec,
        OptimizerConfig(lr=1e-2),
        temperature=0.7,
        seed=1,
        device="cpu",
        compute_dtype=torch.float32,
        publish_dtype=torch.float32,
        **options,
    )


def join_group(rank: int, world: int, port: int) -> None:
    """In a spawned rank: the environment a service's rank gets (runtime.control.startup's
    group_env and runtime.procs.mesh's rank), so the backend joins its process group."""
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        FORGESKY_TRAINER_WORLD_SIZE=str(world),
        FORGESKY_PROC_RANK=str(rank),
    )
    torch.set_num_threads(1)


def run_ranks(fn: Any, ranks: int, tmp_path: Path) -> Any:
    """Spawn `fn(rank, ranks, port, out)` on `ranks` procs meeting on a free loopback port;
    return what rank 0 saved to `out` with torch.save."""
    import torch
    import torch.multiprocessing as mp

    port = free_port()
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(fn, args=(ranks, port, out), nprocs=ranks, start_method="spawn")
    return torch.load(out, weights_only=False)


def tiny_run_dir(root: Path, steps: tuple[int, ...] = (7,)) -> Path:
    """A run directory of the `tiny` recipe without running it: the recipe it records and a
    committed checkpoint per step, each of a trainer seeded with its step."""

    from recipes import load_recipe, plan
    from runtime.backends import build
    from runtime.backends.titan_trainer import OptimizerConfig, TitanTrainer
    from runtime.control import checkpoint

    recipe = load_recipe("tiny")
    recorded = {**recipe.model_dump(mode="json"), "plan": plan(recipe, 0).to_dict()}
    (root / "config.json").write_text(json.dumps(recorded))
    for step in steps:
        trainer = TitanTrainer(build.model_spec(recipe), OptimizerConfig(lr=1e-3), seed=step)
        partial = checkpoint.begin(root / "checkpoints", step)
        trainer.save_checkpoint(str(partial))
        trainer.checkpoint_written(wait=True)
        checkpoint.commit(root / "checkpoints", partial, step)
    return root


def service_proc(run_pid: int, service: str, rank: int) -> psutil.Process:
    """The proc of `service` with `rank` in the run's session (its identity is in its env)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) != run_pid:
                    continue
                env = p.environ()
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
            if env.get("FORGESKY_SERVICE") == service and env.get("FORGESKY_PROC_RANK") == str(
                rank
            ):
                return p
        time.sleep(0.2)
    raise AssertionError(f"no {service} proc of rank {rank} in the run")
