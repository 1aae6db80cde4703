"""On two GPUs (NCCL, one proc per GPU as the runtime spawns them): the reference sharded over
both scores like a trainer sharded over both at the start (the same FSDP2 bf16 regime) and
holds half the weights a GPU; the trainer's DCP checkpoint, written in the background by both
ranks, resumes on one GPU with the same next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_models import SMALL, peaked_weights
from runtime_helpers import join_group, run_ranks, token_batch

from runtime.backends import OptimizerConfig
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.grpo import policy_loss

pytestmark = pytest.mark.gpu

LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.0)


def _batch(rows: int, seed: int):
    return token_batch(SMALL.vocab_size, rows, 64, 16, seed=seed, short=30)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    join_group(rank, world, port)
    import torch.distributed as dist

    weights = peaked_weights(SMALL, seed=4, device=f"cuda:{rank}")
    device = f"cuda:{rank}"
    tokens, mask, adv = _batch(7, 1)
    ref = GPUReference(SMALL, weights=weights, device=device, tokens_per_micro_batch=128)
    share = ref.my_rows(tokens.shape[0])
    ref_lp = ref.logprobs(tokens, mask).float().cpu()
    ref_bytes = sum(
        p.to_local().numel() * p.to_local().element_size() for p in ref.model.parameters()
    )
    trainer = FSDPTrainer(SMALL, OptimizerConfig(lr=1e-3), weights=weights, device=device)
    policy_lp = trainer.logprobs(tokens, mask).float().cpu()[share]
    old = trainer.logprobs(tokens, mask)
    trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    directory = Path(out).parent / "ckpt"
    trainer.save_checkpoint(str(directory))
    second = trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    assert trainer.checkpoint_written(wait=True)
    answers = [None] * world
    dist.all_gather_object(answers, (share.start, ref_lp, policy_lp, ref_bytes))
    if rank == 0:
        torch.save((answers, second, old.float().cpu()), out)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_reference_on_two_gpus_scores_like_the_sharded_policy_and_checkpoints_reshard(
    tmp_path: Path,
):
    answers, second, old = run_ranks(_rank, 2, tmp_path)
    answers.sort(key=lambda a: a[0])
    ref_lp = torch.cat([a[1] for a in answers])
    policy_lp = torch.cat([a[2] for a in answers])
    tokens, mask, adv = _batch(7, 1)
    diff = (ref_lp - policy_lp)[mask].abs()
    print(f"sharded reference vs sharded policy at the start: max |diff| {diff.max():.5f}")
    assert diff.max() < 1e-3  # the same weights, the same FSDP2 bf16 regime
    one = GPUReference(SMALL, weights=peaked_weights(SMALL, seed=4), device="cuda")
    full = sum(p.numel() * p.element_size() for p in one.model.parameters())
    halves = [a[3] for a in answers]
    print(f"reference weights a GPU: {halves} bytes, one GPU {full}")
    params = sum(p.numel() for p in one.model.parameters())
    assert all(h <= params * 2 / 2 * 1.05 for h in halves)  # bf16, half each
    # the two ranks' background-written checkpoint resumes on one GPU: the same second step
    single = FSDPTrainer(SMALL, OptimizerConfig(lr=1e-3), device="cuda", seed=99)
    single.load_checkpoint(str(tmp_path / "ckpt"))
    assert single.step == 1
    again = single.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    print(f"second step: two ranks loss {second['loss']:.5f}, resumed on one {again['loss']:.5f}")
    assert again["loss"] == pytest.approx(second["loss"], rel=0.05, abs=1e-3)
    assert again["grad_norm"] == pytest.approx(second["grad_norm"], rel=0.05)
