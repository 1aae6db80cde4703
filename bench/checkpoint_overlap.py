"""Training steps while a checkpoint is written: what the write costs the steps it overlaps.

A catalog recipe's trainer (FSDP2 over --ranks GPUs of this machine, the recipe's architecture
with seeded random weights, its optimizer) trains --before steps, starts a checkpoint the way
the runtime does (runtime.backends.trainer_state: each rank copies its shards to host memory in
a background thread, then DCP writes them from that copy), and keeps training until the files
are on disk. Per rank it records:

- with --prepare, the host copy made before the first step, as the runtime makes it
  (runtime.backends.trainer_state.Saver.prepare): the save call's seconds and what the first
  steps waited for it;
- step seconds before the writes, and for each of --writes checkpoints one after the other
  (the first makes the host copy, pinned on a GPU, which the later ones reuse) the steps while
  it is written and the two after;
- each save call's seconds, and what the first step after it waited for the copy before its
  optimizer step (`time/checkpoint_staging_wait_s`);
- each write's seconds (save call to files on disk) and bytes, so GB/s of the disk (a write's
  files are removed once every rank has them: the disk needs room for one);
- the largest lateness of a 10 ms timer in another Python thread of the rank (how long that
  thread waited for the interpreter lock: what the training thread's Python waits too).

    python bench/checkpoint_overlap.py [--recipe qwen3-8b] [--ranks 2] [--dir /tmp/ckpt_overlap]
        [--rows 16] [--width 640] [--before 2] [--most 40] [--writes 2] [--prepare]
        [--out FILE]

On CPU (`--device cpu`, gloo) it runs the same code on small recipes, for trying it.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class Lateness:
    """A thread that sleeps 10 ms at a time and keeps the largest overshoot per phase."""

    def __init__(self) -> None:
        self.phase = "before"
        self.worst: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(0.01)
            late = time.perf_counter() - start - 0.01
            self.worst[self.phase] = max(self.worst.get(self.phase, 0.0), late)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _rank(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from runtime_helpers import join_group, token_batch

    from recipes import load_recipe
    from runtime.backends import OptimizerConfig
    from runtime.backends.build import model_spec
    from runtime.backends.fsdp_trainer import FSDPTrainer
    from runtime.grpo import policy_loss

    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    join_group(rank, world, port)
    device = f"cuda:{rank}" if cuda else "cpu"
    spec = model_spec(load_recipe(args["recipe"]))
    start = time.perf_counter()
    trainer = FSDPTrainer(spec, OptimizerConfig(lr=1e-6), device=device)
    built_s = time.perf_counter() - start
    tokens, mask, adv = token_batch(spec.vocab_size, args["rows"], args["width"], args["prompt"])
    old = trainer.logprobs(tokens, mask)
    loss = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.0)

    waits: list[float] = []

    def step() -> float:
        t = time.perf_counter()
        stats = trainer.train_step(tokens, mask, adv, old, old, policy_loss, **loss)
        if cuda:
            torch.cuda.synchronize()
        if "time/checkpoint_staging_wait_s" in stats:
            waits.append(stats["time/checkpoint_staging_wait_s"])
        return time.perf_counter() - t

    probe = Lateness()
    say = print if rank == 0 else (lambda *_, **__: None)
    prepared = None
    if args["prepare"]:
        # what the runtime does at start-up: the host copy made (and on a GPU
        # pinned) in the background; the steps below overlap it
        probe.phase = "prepare"
        t0 = time.perf_counter()
        trainer.prepare_checkpoint_copy(on_cpu=True)  # CPU: the same copy, to try the bench
        prepared = {"call_s": round(time.perf_counter() - t0, 2)}
        probe.phase = "before"
    before = [step() for _ in range(args["before"])]
    if prepared is not None:
        prepared["staging_wait_s"] = [round(x, 2) for x in waits]
        waits.clear()
    say(f"built in {built_s:.1f} s; prepared {prepared}; steps {before}", flush=True)
    writes = []
    for number in range(1, args["writes"] + 1):
        directory = Path(args["dir"]) / f"write_{number}"
        probe.phase = f"save call {number}"
        waits.clear()
        t0 = time.perf_counter()
        trainer.save_checkpoint(str(directory))
        call_s = time.perf_counter() - t0
        probe.phase = f"during write {number}"
        during: list[float] = []
        written_s = None
        say(f"write {number}: save call {call_s:.1f} s", flush=True)
        while len(during) < args["most"]:
            during.append(step())
            say(
                f"step while writing: {during[-1]:.2f} s ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            if trainer.checkpoint_written():  # a collective: every rank asks at the same points
                written_s = time.perf_counter() - t0
                break
        if written_s is None:
            trainer.checkpoint_written(wait=True)
            written_s = time.perf_counter() - t0
        probe.phase = f"after write {number}"
        after = [step() for _ in range(2)]
        mine = sum(f.stat().st_size for f in directory.rglob(f"__{rank}_*") if f.is_file())
        writes.append(
            {
                "write": number,
                "save_call_s": round(call_s, 2),
                "staging_wait_s": [round(x, 2) for x in waits],
                "step_s_during_write": [round(x, 3) for x in during],
                "steps_done_during_write": len(during),
                "write_s": round(written_s, 1),
                "bytes_written_by_rank": mine,
                "step_s_after": [round(x, 3) for x in after],
            }
        )
        dist.barrier()
        if rank == 0:  # a disk that holds one checkpoint of the model holds every write
            shutil.rmtree(directory, ignore_errors=True)
        dist.barrier()
    probe.stop()
    result = {
        "rank": rank,
        "built_s": round(built_s, 1),
        "prepared": prepared,
        "step_s_before": [round(x, 3) for x in before],
        "writes": writes,
        "timer_lateness_max_s": {k: round(v, 3) for k, v in probe.worst.items()},
    }
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, result)
    if rank == 0:
        Path(out).write_text(json.dumps(answers))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="qwen3-8b")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dir", default="/tmp/ckpt_overlap")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--before", type=int, default=2)
    p.add_argument("--most", type=int, default=40, help="steps at most while a write runs")
    p.add_argument(
        "--writes",
        type=int,
        default=2,
        help="checkpoints one after the other: the first makes (and on a GPU pins) the host "
        "copy, the later ones reuse it",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="make the host copy before the first steps, as the runtime does "
        "(Saver.prepare): the first write then reuses it",
    )
    p.add_argument("--out", default="bench/results/checkpoint_overlap.json")
    a = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp
    from runtime_helpers import free_port

    shutil.rmtree(a.dir, ignore_errors=True)
    Path(a.dir).mkdir(parents=True)
    scratch = Path(a.dir) / "rank0.json"
    args = vars(a)
    mp.start_processes(
        _rank, args=(a.ranks, free_port(), str(scratch), args), nprocs=a.ranks, start_method="spawn"
    )
    ranks = json.loads(scratch.read_text())
    per_write = []
    for number in range(a.writes):
        total = sum(r["writes"][number]["bytes_written_by_rank"] for r in ranks)
        write_s = max(r["writes"][number]["write_s"] for r in ranks)
        per_write.append(
            {
                "write": number + 1,
                "checkpoint_bytes": total,
                "write_s": write_s,
                "disk_GB_per_s": round(total / write_s / 1e9, 2),
            }
        )
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else platform.processor()
    result = {
        "what": "trainer steps while its DCP checkpoint is written (runtime.backends.trainer_state)",
        "recipe": a.recipe,
        "ranks": a.ranks,
        "device": device,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "batch": {"rows": a.rows, "width": a.width, "prompt": a.prompt},
        "prepared_before_training": a.prepare,
        "writes": per_write,
        "ranks_detail": ranks,
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
