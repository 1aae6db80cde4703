"""SFT's trainer step on one GPU, without the runtime: `FSDPTrainer.sft_step` on the packed chats
of tiny-sft (the project's character tokenizer) for Qwen3 shapes with random weights, bf16,
eager then compiled, five steps each; the loss, the seconds and the allocator's peak of each.

    python bench/sft_step_check.py ATTENTION SIZE [SIZE ...]   # e.g. document 0.6b 1.7b

ATTENTION is the trainer's mask for packed rows: `document` (SDPA with a dense same-row mask) or
`flex` (TorchTitan's flex attention document mask). On the GPU machine it needs only TorchTitan
(`.whl/tt`): `pip install --no-deps .whl/tt/*.whl`, then `PYTHONPATH=$PWD python3 ...`.
A configuration that fails is reported in one line and the next one runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recipes import architecture, load_recipe  # noqa: E402
from runtime.backends import OptimizerConfig  # noqa: E402
from runtime.backends.fsdp_trainer import FSDPTrainer  # noqa: E402
from runtime.models import ModelSpec  # noqa: E402
from runtime.sft.data import ChatEncoder, Counts, examples, micro_batches  # noqa: E402
from runtime.tasks.tiny import tokenizer  # noqa: E402

BUDGET = 8192  # tokens a micro-batch


def main(attention: str, sizes: list[str]) -> None:
    ds = load_recipe("tiny-sft").dataset
    rows = [json.loads(x) for x in Path(ds.path).read_text().splitlines()]
    exs = list(examples(rows, range(len(rows)), ChatEncoder(tokenizer()), ds, Counts()))
    packs = list(micro_batches(iter(exs * 4), BUDGET, pad_to=False))[:8]
    tokens = sum(int(p.tokens.numel()) for p in packs)
    print(f"{len(rows)} rows, {len(packs)} micro-batches, {tokens} tokens a step", flush=True)
    for size in sizes:
        spec = ModelSpec.from_arch(architecture("qwen3", size))
        for compiled in (False, True):
            try:
                trainer = FSDPTrainer(
                    spec,
                    OptimizerConfig(lr=1e-4),
                    seed=1,
                    device="cuda",
                    compute_dtype=torch.bfloat16,
                    publish_dtype=torch.bfloat16,
                    tokens_per_micro_batch=BUDGET,
                    activation_checkpointing=False,
                    compile=compiled,
                    attention=attention,
                )
                for i in range(5):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    stats = trainer.sft_step(packs)
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                    peak = torch.cuda.max_memory_allocated() / 1e9
                    print(
                        f"{size} compile={compiled} step {i}: loss {stats['loss']:.4f} "
                        f"{seconds:.3f} s, {len(packs)} packs, {tokens} tokens, peak {peak:.1f} GB",
                        flush=True,
                    )
                del trainer
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001  (said in one line; the next configuration runs)
                print(f"{size} compile={compiled}: FAILED {type(e).__name__}: {str(e)[:600]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
