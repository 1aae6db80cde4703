"""Trainer -> generator weight transfer between two procs, on the runtime's own paths.

    python bench/weight_push.py [--model qwen3-1.7b] [--versions 5] [--paths push,ipc,store]
    python bench/weight_push.py --paths push,push_groups      # the push whole, then by groups
    python bench/weight_push.py --device cpu --model tiny      # the same code over gloo

One proc plays trainer rank 0 (a `PushSender` or `IpcSender` of runtime/weights/), the other a
generator (`PushReceiver` for "push" and "push_groups", `open_ipc` for "ipc"). "push_groups" is
`weight_sync.push_buffer groups`: each transformer block's tensors (and those outside the blocks)
handed to the sender as a group, broadcast as they come, no staging buffer. On a GPU machine the
push paths put them on GPUs 0 and 1 (NCCL), "ipc" both on GPU 0; "store" (`run_store`) publishes into TorchStore from GPU 0 in
this process, as a run's controller does, and fetches into GPU 1. Weights: the model's HF state dict in bf16 (the architecture
from the recipe catalog, random values). Each version is staged, moved and checked on the
receiving side (a checksum of every tensor against the trainer's); the first version (NCCL set-up)
is left out of the averages. Reported per path: seconds and GB/s of staging (copy into the flat
buffer), of the transfer (trainer side), and end to end (stage start -> receiver holds it).
The JSON merges into `--out` under "weight_push" with device and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PUSH_PATHS = ("push", "push_groups")


def _weights(model: str, device: Any, seed: int) -> dict[str, Any]:
    import torch

    if model.startswith("synthetic:"):
        # "synthetic:<bytes>:<tensors>": bf16 tensors of equal size, no model code needed.
        _, nbytes, count = model.split(":")
        numel = int(nbytes) // 2 // int(count)
        g = torch.Generator(device=device).manual_seed(seed)
        return {
            f"t{i:04d}": torch.randn(numel, generator=g, device=device).to(torch.bfloat16)
            for i in range(int(count))
        }

    from recipes import architecture, load_recipe
    from runtime.models import ModelSpec, build_model, to_hf

    recipe = load_recipe(model)
    spec = ModelSpec.from_arch(
        architecture(recipe.model.family, recipe.model.size), family=recipe.model.family
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    built = build_model(spec, device=device, dtype=dtype, seed=seed)
    return to_hf({k: v.detach() for k, v in built.state_dict().items()}, spec)


def _checksums(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


def _pin_gpu(index: int) -> None:
    """This proc sees only the `index`-th GPU of those the bench was started with."""
    from runtime.procs.host import host_gpu_ids

    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = host_gpu_ids((index,))[0]


def _device(kind: str) -> Any:
    import torch

    if kind == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _trainer(args: dict[str, Any], to_gen: Any, from_gen: Any, results: Any) -> None:
    _pin_gpu(0)
    import asyncio

    import torch

    from runtime.weights.flat import flat_layout
    from runtime.weights.ipc import IpcSender
    from runtime.weights.push import PushSender

    device = _device(args["device"])
    state = _weights(args["model"], device, seed=0)
    push = args["path"] in PUSH_PATHS
    source = PushSender(device, receivers=1) if push else IpcSender(device)
    groups = args["path"] == "push_groups"
    if groups:
        source.stream_groups()
    to_gen.put(source.open())
    entries, _ = flat_layout(state)
    plain = {n: tuple(e) for n, e in entries.items()}
    nbytes = sum(e.nbytes for e in entries.values())
    rows = []
    for version in range(args["versions"]):
        # A new version: every tensor changes (as after an optimizer step).
        with torch.no_grad():
            for t in state.values():
                t.add_(1.0 / 64)
        sums = _checksums(state)
        start = time.perf_counter()
        if groups:
            source.begin(version, entries)
            for group in _blocks(state):
                source.fill(group)
            direct = source.finish(version)["direct"]
        else:
            direct = asyncio.run(source.stage(version, state, entries))["direct"]
        staged_s = time.perf_counter() - start
        if push:
            source.wait_pushed(600)
        to_gen.put((version, {**direct, "tensors": plain}, sums))
        got = from_gen.get(timeout=600)
        if got["error"]:
            raise RuntimeError(got["error"])
        transfer_s = source.last_push_s if push else 0.0
        print(
            f"  version {version}: stage {staged_s:.3f} s, transfer "
            f"{transfer_s:.3f} s, end to end {got['done'] - start:.3f} s "
            f"({nbytes / 1e9:.2f} GB)",
            flush=True,
        )
        rows.append(
            {
                "version": version,
                "bytes": nbytes,
                "stage_s": staged_s,
                "transfer_s": transfer_s,
                "end_to_end_s": got["done"] - start,
                "load_s": got["load_s"],
            }
        )
        source.release(version)
    source.close()
    to_gen.put(None)
    results.put({"rows": rows, "tensors": len(state)})


def _blocks(state: dict[str, Any]) -> Any:
    """`state` in groups of consecutive tensors, one per transformer block (`layers.N.`) and
    one for each run of tensors outside the blocks: what a sharded trainer gathers at a time."""
    group: dict[str, Any] = {}
    key = None
    for name, tensor in state.items():
        parts = name.split(".")
        block = parts[parts.index("layers") + 1] if "layers" in parts[:-1] else None
        if group and block != key:
            yield group
            group = {}
        key = block
        group[name] = tensor
    if group:
        yield group


def _generator(args: dict[str, Any], from_trainer: Any, to_trainer: Any) -> None:
    _pin_gpu(1 if args["path"] in PUSH_PATHS else 0)
    import torch

    from runtime.weights.flat import entries_of, views
    from runtime.weights.ipc import open_ipc
    from runtime.weights.push import PushReceiver

    device = _device(args["device"])
    receiver = None
    address = from_trainer.get(timeout=600)
    if args["path"] in PUSH_PATHS:
        receiver = PushReceiver(*address, 1, 2, device)
    while True:
        item = from_trainer.get(timeout=600)
        if item is None:
            break
        version, direct, sums = item
        error = None
        t = time.perf_counter()
        if receiver is not None:
            receiver.wait_for(version, 600)
            flat = receiver.buffer
        else:
            flat = open_ipc(direct["ipc"][0])
        got = views(flat, entries_of(direct))
        # "Load": one on-GPU copy of every tensor, what the engine's load_weights does.
        copies = {k: v.clone() for k, v in got.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        mismatched = [k for k, v in _checksums(copies).items() if abs(v - sums[k]) > 1e-6]
        if mismatched:
            error = f"version {version}: {len(mismatched)} tensors differ, e.g. {mismatched[0]}"
        # perf_counter is CLOCK_MONOTONIC: comparable between procs of one host.
        to_trainer.put({"done": done, "load_s": done - t, "error": error})
    if receiver is not None:
        receiver.close()


def run_path(model: str, path: str, versions: int, device: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    args = {"model": model, "path": path, "versions": versions, "device": device}
    ctx = mp.get_context("spawn")
    to_gen, from_gen, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_trainer, args=(args, to_gen, from_gen, results)),
        ctx.Process(target=_generator, args=(args, to_gen, from_gen)),
    ]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                result = results.get(timeout=5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"{path}: a proc failed (exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"{path}: a proc exited with {bad}")
    return summarize(path, result)


def run_store(model: str, versions: int, device: str) -> dict[str, Any]:
    """The store path as a run takes it (the path of the recipes too large for a flat buffer on
    rank 0): each version handed to the runtime's `Publisher` a tensor at a time (a sharded
    trainer's gathered groups), written to TorchStore bucket by bucket from the trainer's
    device, then fetched into the generator's preallocated tensors (GPU 1 where there are two,
    else the trainer's) and checked tensor by tensor. This process is the controller that
    owns the store, as in a run; the storage volume is a proc of its own. Reported as the
    other paths: stage = the publish (into the store), transfer = the same, load = the fetch,
    end to end = both."""
    import asyncio

    import torch

    from runtime.weights.store import start_store, stop_store
    from runtime.weights.transport import Publisher

    source = _device(device)
    target = source
    if source.type == "cuda" and torch.cuda.device_count() > 1:
        target = torch.device("cuda", 1)
    state = _weights(model, source, seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    async def go() -> list[dict[str, Any]]:
        store = await start_store()
        publisher = Publisher(store, ["store"], source)
        into = {n: torch.empty_like(t, device=target) for n, t in state.items()}
        rows = []
        try:
            for version in range(versions):
                with torch.no_grad():
                    for t in state.values():
                        t.add_(1.0 / 64)
                sums = _checksums(state)
                extra = None
                if source.type == "cuda":
                    torch.cuda.synchronize(source)
                    torch.cuda.reset_peak_memory_stats(source)
                    base = torch.cuda.memory_allocated(source)
                start = time.perf_counter()
                await publisher.publish_groups(version, ({n: t} for n, t in state.items()))
                published = time.perf_counter()
                if source.type == "cuda":
                    # what the publish allocated on the trainer's GPU beside its weights
                    extra = torch.cuda.max_memory_allocated(source) - base
                got, _ = await store.fetch(version, into=into)
                if target.type == "cuda":
                    torch.cuda.synchronize(target)
                done = time.perf_counter()
                wrong = [k for k, v in _checksums(got).items() if abs(v - sums[k]) > 1e-6]
                if wrong:
                    raise RuntimeError(
                        f"version {version}: {len(wrong)} tensors differ ({wrong[0]})"
                    )
                print(
                    f"  version {version}: publish {published - start:.3f} s, fetch "
                    f"{done - published:.3f} s ({nbytes / 1e9:.2f} GB)",
                    flush=True,
                )
                rows.append(
                    {
                        "version": version,
                        "bytes": nbytes,
                        "stage_s": published - start,
                        "transfer_s": published - start,
                        "end_to_end_s": done - start,
                        "load_s": done - published,
                        "publish_gpu_extra_bytes": extra,
                    }
                )
                if version:
                    await publisher.drop(version - 1)  # a run keeps the last ones only
        finally:
            publisher.close()
            await stop_store(store)
        return rows

    rows = asyncio.run(go())
    return summarize("store", {"rows": rows, "tensors": len(state)})


def summarize(path: str, result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    steady = rows[1:] or rows
    nbytes = rows[0]["bytes"]

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in steady)

    def rate(seconds: float) -> float | None:
        return nbytes / 1e9 / seconds if seconds > 0 else None

    out = {
        "path": path,
        "bytes": nbytes,
        "tensors": result["tensors"],
        "versions": len(rows),
        "stage_s": mean("stage_s"),
        "transfer_s": mean("transfer_s"),
        "end_to_end_s": mean("end_to_end_s"),
        "load_s": mean("load_s"),
        "rows": rows,
    }
    out["stage_gb_per_s"] = rate(out["stage_s"])
    out["transfer_gb_per_s"] = rate(out["transfer_s"])
    out["end_to_end_gb_per_s"] = rate(out["end_to_end_s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="qwen3-1.7b",
        help="catalog recipe whose model to move, or synthetic:<bytes>:<tensors> (bf16)",
    )
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--paths", default="push,ipc", help="of push, push_groups, ipc and store")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--out", default=None, help="merge the result into this JSON")
    args = p.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for path in args.paths.split(","):
        if path in PUSH_PATHS and device == "cuda" and torch.cuda.device_count() < 2:
            print(f"{path}: needs 2 GPUs, skipped", flush=True)
            continue
        if path == "ipc" and device != "cuda":
            print("ipc: needs a GPU, skipped", flush=True)
            continue
        if path == "store":
            r = run_store(args.model, args.versions, device)
        else:
            r = run_path(args.model, path, args.versions, device)
        results.append(r)
        print(
            f"{args.model} {path}: {r['bytes'] / 1e9:.2f} GB in {r['tensors']} tensors; "
            f"stage {r['stage_s']:.3f} s, transfer {r['transfer_s']:.3f} s "
            f"({r['transfer_gb_per_s'] or 0:.1f} GB/s), end to end {r['end_to_end_s']:.3f} s "
            f"({r['end_to_end_gb_per_s']:.1f} GB/s)",
            flush=True,
        )
    if args.out:
        from importlib import metadata

        out = Path(args.out)
        doc = json.loads(out.read_text()) if out.exists() else {}
        section = doc.setdefault("weight_push", {})
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        section[args.model] = {
            "device": name,
            "versions": {d: metadata.version(d) for d in ("torch",)},
            "results": results,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
