"""A TP=2 vLLM engine takes two policy versions from flat buffers on GPU 0 (`load_flat`: both
workers open the buffer by CUDA IPC) and samples from each, then three versions from another
process's buffers as the trainer hands them over (`IpcSender` there, `load_ipc` here), and that
process reports what stays allocated once each is released; prints one `RESULT {json}` line.

Run by tests/test_gpu_vllm_tp.py in a process of its own (a TP engine starts worker procs and
owns this process's vLLM state); needs two GPUs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import SMALL, peaked_weights, random_prompts  # noqa: E402

from runtime.backends import collate  # noqa: E402
from runtime.backends.fsdp_reference import GPUReference  # noqa: E402
from runtime.backends.vllm_generator import VLLMGenerator  # noqa: E402
from runtime.models import to_hf  # noqa: E402
from runtime.weights.flat import entries_of, fill, flat_layout  # noqa: E402

T = 0.7


def flat_of(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    hf = {k: v.to(torch.bfloat16) for k, v in to_hf(weights, SMALL).items()}
    entries, total = flat_layout(hf)
    flat = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    fill(flat, entries, hf)
    torch.cuda.synchronize()
    return flat, entries


def mismatch(completions: list, weights: dict[str, torch.Tensor]) -> float:
    """Mean |vLLM log-prob - TorchTitan's teacher-forced log-prob| over the sampled tokens."""
    batch = collate(completions, pad_id=0)
    ref = GPUReference(SMALL, temperature=T, weights=weights, device="cuda:0")
    scored = ref.logprobs(batch.tokens, batch.response_mask).cpu()
    return float((scored - batch.logprobs)[batch.response_mask].abs().mean())


def producer(to_gen, from_gen, versions: int) -> None:
    """Trainer rank 0's part: each version into a fresh buffer by `IpcSender`, its manifest to
    the generator, released once loaded; what this process still has allocated each time."""
    import asyncio

    from runtime.weights.ipc import IpcSender

    torch.cuda.set_device(0)
    sender = IpcSender(torch.device("cuda", 0), opens=[2])  # one TP=2 generator
    base = None
    for version in range(versions):
        hf = {
            k: v.to(torch.bfloat16)
            for k, v in to_hf(peaked_weights(SMALL, seed=20 + version), SMALL).items()
        }
        entries, _ = flat_layout(hf)
        torch.cuda.synchronize()
        if base is None:
            base = torch.cuda.memory_allocated()
        direct = asyncio.run(sender.stage(version, hf, entries))["direct"]
        held = torch.cuda.memory_allocated()
        to_gen.put((version, {**direct, "tensors": {n: tuple(e) for n, e in entries.items()}}))
        assert from_gen.get(timeout=300) == version
        sender.release(version)
        to_gen.put(("allocated", base, held, torch.cuda.memory_allocated()))
        del hf
    sender.close()
    to_gen.put(None)


def from_another_process(gen: VLLMGenerator, prompts: list, versions: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_gen, from_gen = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=producer, args=(to_gen, from_gen, versions))
    proc.start()
    out: dict = {"ipc_allocated": []}
    try:
        while (item := to_gen.get(timeout=300)) is not None:
            if item[0] == "allocated":
                _, base, held, after = item
                out["ipc_allocated"].append({"base": base, "held": held, "after_release": after})
                continue
            version, direct = item
            gen.load_ipc(direct["ipc"], entries_of(direct))
            done = gen.generate(prompts, n=2, max_new_tokens=16, temperature=T, seed=3)
            out[f"ipc_samples_{version}"] = [c.response_ids for c in done]
            from_gen.put(version)
    finally:
        proc.join(60)
    out["ipc_exit"] = proc.exitcode
    return out


def main() -> None:
    gen = VLLMGenerator(
        SMALL,
        eos_token_id=1,
        pad_token_id=0,
        max_model_len=256,
        temperature=T,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.3,
        seed=0,
        max_num_seqs=64,
    )
    prompts = random_prompts(8, SMALL.vocab_size, seed=1)
    result: dict = {"init_s": gen.init_seconds}
    for version, seed in ((0, 10), (1, 11)):
        weights = peaked_weights(SMALL, seed=seed, device="cuda:0")
        flat, entries = flat_of(weights)
        gen.load_flat(flat, entries)
        result[f"load_s_{version}"] = gen.load_seconds
        out = gen.generate(prompts, n=4, max_new_tokens=64, temperature=T, seed=3)
        result[f"mismatch_{version}"] = mismatch(out, weights)
        result[f"other_weights_{version}"] = mismatch(out, peaked_weights(SMALL, seed=seed + 50))
        result[f"samples_{version}"] = [c.response_ids for c in out]
        del flat
    result.update(from_another_process(gen, prompts, versions=3))
    gen.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
