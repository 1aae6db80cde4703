"""A compiled trainer and reference make their graphs before the first step, on made-up rows
(runtime.backends.warm_up), and leave nothing else behind: the first real step, at other sizes,
compiles no graph, and the weights, optimizer and random generators are as they were. Real
TorchTitan models and torch.compile on the CPU."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import fsdp_on_cpu, token_batch

from recipes import architecture
from recipes.run_sections import Lora
from runtime.backends import OptimizerConfig
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.backends.gpu_memory import StepEvents
from runtime.backends.warm_up import synthetic_rows
from runtime.control.startup import warm_up_line
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))
LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def _trainer(**options) -> FSDPTrainer:
    return fsdp_on_cpu(SPEC, tokens_per_micro_batch=64, compile=True, **options)


def _first_step(trainer: FSDPTrainer, entropy_coef: float) -> dict[str, float]:
    """A step as the runtime makes it: 5 rows of 20 tokens (the warm-up's were 3 of 24), two
    micro-batches, the reference scored by the trainer under LoRA."""
    tokens, mask, adv = token_batch(SPEC.vocab_size, 5, 20, seed=3, short=9)
    ref = trainer.reference_logprobs(tokens, mask) if trainer.lora is not None else None
    old = torch.zeros(tokens.shape)
    return trainer.train_step(
        tokens, mask, adv, old, ref, policy_loss, entropy_coef=entropy_coef, **LOSS
    )


@pytest.mark.parametrize(
    ("lora", "entropy_coef"),
    [(None, 0.01), (Lora(rank=4, targets=["q_proj", "down_proj"]), 0.0)],
    ids=["full-entropy-bonus", "lora"],
)
def test_a_warmed_up_trainer_compiles_nothing_in_its_first_step(lora, entropy_coef):
    torch._dynamo.reset()  # graphs other tests compiled for these blocks would be reused
    trainer = _trainer(lora=lora)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rng = torch.get_rng_state()

    warm = trainer.warm_up(24, 2 if entropy_coef else 1)

    assert warm is not None and warm["graphs"] > 0 and warm["seconds"] > 0
    assert "out_of_memory" not in warm
    line = warm_up_line("trainer", warm)
    assert line == f"  trainer: {warm['graphs']:.0f} graphs compiled before its first step " + (
        f"({warm['seconds']:.1f} s)"
    )
    # nothing stays: the weights, no optimizer state, no gradient, the generator's state
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
        assert p.grad is None, name
    assert not trainer.optimizer.state and trainer.step == 0
    assert torch.equal(torch.get_rng_state(), rng)

    events = StepEvents("cpu")
    before = events.read()
    with torch._dynamo.config.patch(error_on_recompile=True):
        stats = _first_step(trainer, entropy_coef)
    assert events.since(before)["compile/graphs"] == 0
    assert stats["step"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))


def test_a_trainer_that_does_not_compile_has_nothing_to_warm_up():
    trainer = FSDPTrainer(SPEC, OptimizerConfig(), device="cpu", compute_dtype=torch.float32)
    assert trainer.warm_up(24, 1) is None
    assert warm_up_line("trainer", None) is None
    assert warm_up_line("trainer", {"graphs": 0.0, "seconds": 0.1}) is None
    no_room = warm_up_line("trainer", {"graphs": 0.0, "seconds": 0.0, "out_of_memory": 1.0})
    assert no_room == (
        "  trainer: no room on its GPU beside the generator's start to compile ahead; "
        "its first step compiles"
    )


def test_a_warmed_up_reference_compiles_nothing_when_it_first_scores():
    torch._dynamo.reset()
    reference = GPUReference(
        SPEC, seed=4, device="cpu", dtype=torch.float32, compile=True, tokens_per_micro_batch=64
    )
    assert reference.warm_up(24)["graphs"] > 0
    tokens, mask, _ = token_batch(SPEC.vocab_size, 5, 20, seed=3, short=9)
    events = StepEvents("cpu")
    before = events.read()
    with torch._dynamo.config.patch(error_on_recompile=True):
        scored = reference.logprobs(tokens, mask)
    assert events.since(before)["compile/graphs"] == 0
    eager = GPUReference(SPEC, seed=4, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(scored, eager.logprobs(tokens, mask), atol=1e-5, rtol=0)
    assert GPUReference(SPEC, device="cpu", dtype=torch.float32).warm_up(24) is None


@pytest.mark.parametrize(
    ("width", "budget", "shape"),
    [
        (24, 64, (3, 23)),
        (100, 8192, (81, 99)),
        (2048, 8192, (3, 2047)),
        (2048, 16384, (7, 2047)),
        (91, 8281, (89, 91)),
        (2, 64, (11, 5)),
    ],
)
def test_the_made_up_rows_fill_a_micro_batch_in_odd_sizes_of_their_own(width, budget, shape):
    """qwen3-1.7b's caps make rows of 2,048 tokens, its hidden size: 2,047 are made."""
    tokens, mask = synthetic_rows(1000, width, budget)
    rows, w = shape
    assert tokens.shape == (rows, w) and mask.shape == (rows, w)
    assert rows * w <= max(budget, 3 * w) and int(tokens.max()) < 1000
    # what each row predicts (position t-1 predicts token t) and all of them: odd, and no two
    # sizes alike, none of 1
    per_row = mask[:, 1:].sum(dim=1)
    assert (per_row == per_row[0]).all()
    sizes = [rows, w, int(per_row[0]), int(per_row.sum())]
    assert all(n % 2 == 1 and n > 1 for n in sizes), sizes
    assert len(set(sizes[:2] + sizes[3:])) == 3, sizes
