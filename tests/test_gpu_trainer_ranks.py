"""FSDP2 over two GPUs (NCCL, one proc per GPU as the runtime spawns them), with the trainer's
speed knobs: the same step with activation checkpointing off and with compiled blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_models import SMALL, peaked_weights
from runtime_helpers import join_group, run_ranks, token_batch

from runtime.backends import OptimizerConfig
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.grpo import policy_loss

pytestmark = pytest.mark.gpu

LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.0)
OPTIONS = {
    "default": {},
    "no_checkpointing": {"activation_checkpointing": False},
    "compiled": {"compile": True},
}


def _batch(width: int, seed: int):
    return token_batch(SMALL.vocab_size, 8, width, 16, seed=seed, short=width - 25)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    # What runtime.control.run gives each trainer proc (runtime.procs.mesh pins it to its GPU instead).
    torch.cuda.set_device(rank)
    join_group(rank, world, port)
    import torch.distributed as dist

    weights = peaked_weights(SMALL, seed=4, device=f"cuda:{rank}")
    results = {}
    initial = None
    for name, options in OPTIONS.items():
        trainer = FSDPTrainer(
            SMALL, OptimizerConfig(lr=1e-3), weights=weights, device=f"cuda:{rank}", **options
        )
        if initial is None:
            initial = {k: v.float().cpu() for k, v in trainer.hf_state_dict().items()}
            tokens, mask, _ = _batch(48, 1)
            results["start_logprobs"] = trainer.logprobs(tokens, mask).float().cpu()
        steps = []
        for width, seed in ((48, 1), (61, 2)):  # the second width must not recompile
            tokens, mask, adv = _batch(width, seed)
            old = trainer.logprobs(tokens, mask)
            steps.append(trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS))
        published = trainer.hf_state_dict()
        results[name] = (steps, {k: v.float().cpu() for k, v in published.items()})
        del trainer
    if rank == 0:
        torch.save((initial, results), out)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_train_alike_with_each_knob(tmp_path: Path):
    initial, results = run_ranks(_rank, 2, tmp_path)
    # two ranks (FSDP2's bf16 param_dtype) score like one rank (bf16 autocast) up to bf16 noise
    weights = peaked_weights(SMALL, seed=4)
    tokens, mask, _ = _batch(48, 1)
    one = FSDPTrainer(SMALL, OptimizerConfig(), weights=weights, device="cuda")
    exact = FSDPTrainer(
        SMALL, OptimizerConfig(), weights=weights, device="cuda", compute_dtype=torch.float32
    )
    ours = one.logprobs(tokens, mask).float().cpu()
    diff = (ours - results["start_logprobs"])[mask].abs()
    noise = (ours - exact.logprobs(tokens, mask).float().cpu())[mask].abs()
    print(f"two ranks vs one: mean |diff| {diff.mean():.4f}; bf16 vs fp32 {noise.mean():.4f}")
    # FSDP2 rounds norms and the residual stream too (see GPUReference): a few bf16 ulps
    assert diff.mean() < max(0.02, 3 * noise.mean().item())
    base_steps, base_weights = results["default"]
    for name in ("no_checkpointing", "compiled"):
        steps, weights = results[name]
        for mine, theirs in zip(steps, base_steps, strict=True):
            print(name, {k: round(mine[k], 5) for k in ("loss", "grad_norm", "response_tokens")})
            assert mine["response_tokens"] == theirs["response_tokens"]
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=0.02), name
        # bf16 compute: the same update up to rounding. AdamW moves every weight by about lr
        # whatever its gradient's size, so a weight whose gradient is rounding noise may move
        # the other way: compare the updates as a whole.
        update = sum((base_weights[k] - initial[k]).abs().sum().item() for k in initial)
        apart = sum((weights[k] - base_weights[k]).abs().sum().item() for k in initial)
        print(f"{name}: |difference| / |update| = {apart / update:.3f}")
        assert apart < 0.1 * update, name
