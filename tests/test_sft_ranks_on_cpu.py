"""SFT on the FSDP2 trainer across two ranks (gloo, CPU): the same step and weights as the
one-process trainer, the step's micro-batches split between the ranks, and the same held-out
loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runtime_helpers import join_group, run_ranks

from recipes import architecture, load_recipe
from runtime.backends import OptimizerConfig, TitanTrainer
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))


def _packs():
    from runtime.sft.data import ChatEncoder, Counts, examples, micro_batches
    from runtime.tasks.tiny import tokenizer

    ds = load_recipe("tiny-sft").dataset
    rows = [json.loads(line) for line in Path(ds.path).read_text().splitlines()[:20]]
    exs = list(examples(rows, range(20), ChatEncoder(tokenizer()), ds, Counts()))
    packs = list(micro_batches(iter(exs), 64, pad_to=False))  # 5 micro-batches: 3 + 2 a rank
    # the widest first: on two ranks the last (the narrowest) is padded to the width of the
    # filler beside it (runtime.sft.train.rank_share), which must change no figure
    return sorted(packs, key=lambda p: -p.tokens.shape[1])


def _trainer(compile: bool = False, gather_once: bool = False):
    """A CPU FSDP2 trainer of SPEC in fp32 with the CPU's document mask (in a group, a rank)."""
    from runtime.backends.fsdp_trainer import FSDPTrainer

    return FSDPTrainer(
        SPEC,
        OptimizerConfig(lr=1e-2),
        seed=1,
        device="cpu",
        compute_dtype=torch.float32,
        publish_dtype=torch.float32,
        attention="document",
        compile=compile,
        gather_once=gather_once,
    )


def _rank(rank: int, world: int, port: int, out: str, gather_once: bool = False) -> None:
    join_group(rank, world, port)
    trainer = _trainer(gather_once=gather_once)
    packs = _packs()
    stats = [trainer.sft_step(packs), trainer.sft_step(packs)]
    held_out = trainer.sft_loss(packs)  # every rank its share, every rank the whole sum
    published = trainer.hf_state_dict()
    if rank == 0:
        torch.save((stats, published, len(packs), held_out), out)


def _rank_gathering_once(rank: int, world: int, port: int, out: str) -> None:
    _rank(rank, world, port, out, gather_once=True)


@pytest.mark.parametrize("gather_once", [False, True], ids=["reshard", "gather_once"])
def test_two_fsdp_ranks_take_the_sft_step_of_one_process(tmp_path: Path, gather_once: bool):
    """Either way FSDP2 runs a step's micro-batches: resharding the weights after each, or
    with them gathered once a step (trainer.gather_once)."""
    fn = _rank_gathering_once if gather_once else _rank
    stats, published, count, held_out = run_ranks(fn, 2, tmp_path)
    assert count % 2 == 1  # one rank runs a filler micro-batch
    one = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), seed=1, attention="document")
    packs = _packs()
    expected = [one.sft_step(packs), one.sft_step(packs)]
    for got, want in zip(stats, expected, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(got[key] - want[key]) < 1e-5, (key, got[key], want[key])
    summed, tokens = one.sft_loss(packs)
    assert held_out[1] == tokens and abs(held_out[0] - summed) < 1e-4 * tokens
    reference = one.hf_state_dict()
    assert published.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(published[name], tensor, rtol=0, atol=1e-4)


def test_a_filler_runs_the_shapes_of_a_real_micro_batch_and_trains_nothing():
    """A rank without a micro-batch of its own runs a copy of one with its loss counted zero
    times: the compiled blocks and output projection take it without compiling again (a
    stand-in of one token did: a size of 1, and 0 trained tokens), and it adds no gradient."""
    from runtime.sft.train import filler, packed_loss

    torch._dynamo.reset()
    trainer = _trainer(compile=True)
    real = _packs()[0]
    stand_in = filler(real)
    assert stand_in.tokens.shape == real.tokens.shape and stand_in.trained_tokens == 0
    assert real.trained_tokens > 0 and not real.filler
    assert float(packed_loss(trainer.model, real, "document", torch.device("cpu"))) > 0
    trainer.model.zero_grad(set_to_none=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss = packed_loss(trainer.model, stand_in, "document", torch.device("cpu"))
        loss.backward()
    assert float(loss) == 0.0
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads)
