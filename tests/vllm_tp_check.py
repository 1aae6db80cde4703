"""A TP=2 vLLM engine takes two policy versions from flat buffers on GPU 0 (`load_flat`: both
workers open the buffer by CUDA IPC) and samples from each; prints one `RESULT {json}` line.

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
from runtime.backends.fsdp_trainer import GPUReference  # noqa: E402
from runtime.backends.vllm_generator import VLLMGenerator  # noqa: E402
from runtime.models import to_hf  # noqa: E402
from runtime.weights.flat import fill, flat_layout  # noqa: E402

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
    gen.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
