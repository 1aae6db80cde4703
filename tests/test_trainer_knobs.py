"""Trainer speed knobs: activation checkpointing off, and torch.compile per transformer block
(with and under activation checkpointing, batch widths that change from step to step)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import fsdp_on_cpu, token_batch

from recipes import architecture
from runtime.backends import blocks
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))
LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def _batch(width: int, seed: int = 0, rows: int = 5):
    return token_batch(SPEC.vocab_size, rows, width, seed=seed, short=width - 11)


def _trainer(**options) -> FSDPTrainer:
    return fsdp_on_cpu(SPEC, **options)


def _step(trainer: FSDPTrainer, width: int, seed: int) -> dict[str, float]:
    tokens, mask, adv = _batch(width, seed)
    old = trainer.logprobs(tokens, mask)
    return trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)


def test_without_activation_checkpointing_the_steps_are_the_same():
    recomputed, kept = _trainer(), _trainer(activation_checkpointing=False)
    for width, seed in ((20, 0), (26, 1)):
        a, b = _step(recomputed, width, seed), _step(kept, width, seed)
        for key in ("loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_compiled_checkpointed_blocks_match_eager_across_batch_widths():
    from runtime.backends.gpu_memory import StepEvents

    eager, compiled = _trainer(), _trainer(compile=True)
    tokens, mask, _ = _batch(20)
    events = StepEvents("cpu")  # what a step's record counts (compile/graphs)
    before = events.read()
    torch.testing.assert_close(
        compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
    )
    assert events.since(before)["compile/graphs"] > 0  # the checkpointed blocks did compile
    assert "memory/alloc_retries" not in events.read()  # a CUDA allocator's count, on a GPU
    # the output projection's log-softmax is compiled too (eager keeps the plain function)
    assert compiled.model._head_logprobs is not blocks.head_logprobs
    assert not hasattr(eager.model, "_head_logprobs")
    a, b = _step(eager, 23, 1), _step(compiled, 23, 1)
    for key in ("loss", "kl", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # dynamic shapes: a new width reuses the compiled graphs (a recompile would raise here)
    with torch._dynamo.config.patch(error_on_recompile=True):
        before = events.read()
        a, b = _step(eager, 31, 2), _step(compiled, 31, 2)
        assert events.since(before) == {"compile/graphs": 0.0}
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    tokens, mask, _ = _batch(17, seed=3)
    torch.testing.assert_close(
        compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-4, rtol=0
    )


def test_a_step_that_compiles_again_says_which_guard_failed():
    """A batch of one row, where the blocks were compiled for more (torch.compile specializes a
    size of 1), compiles them again: the step's stats name the guard, and the run says it in a
    line beside the step's (runtime.backends.profiling.say_recompiles)."""
    from runtime.backends.profiling import measured_step, say_recompiles

    torch._dynamo.reset()  # graphs other tests compiled for these blocks would be reused
    compiled = _trainer(compile=True, tokens_per_micro_batch=64)
    first = measured_step(lambda: _step(compiled, 20, 0), "cpu", profile=False)
    assert first["compile/graphs"] > 0
    again = measured_step(lambda: _step(compiled, 21, 1), "cpu", profile=False)
    assert again["compile/graphs"] == 0 and "compile/reasons" not in again  # a width is dynamic
    tokens, mask, adv = token_batch(SPEC.vocab_size, 1, 20, seed=5, short=9)
    one = measured_step(
        lambda: compiled.train_step(tokens, mask, adv, None, None, policy_loss, **LOSS),
        "cpu",
        profile=False,
    )
    assert one["compile/graphs"] >= 1
    reasons = one["compile/reasons"]
    assert any("size()[0]" in r and "blocks.py" in r for r in reasons), reasons
    lines: list[str] = []
    say_recompiles({**one}, 1, lines.append, first=True)
    assert lines == []  # the process's first step makes graphs anyway
    say_recompiles(one, 3, lines.append)
    assert "compile/reasons" not in one and len(lines) == len(reasons)
    assert lines[0].startswith("trainer: step 3 compiled again, a guard failed: run (")
    assert "(runtime/backends/blocks.py:" in lines[0]


def test_compiled_reference_scores_like_eager():
    eager = GPUReference(SPEC, seed=4, device="cpu", dtype=torch.float32)
    compiled = GPUReference(SPEC, seed=4, device="cpu", dtype=torch.float32, compile=True)
    for width in (20, 29):
        tokens, mask, _ = _batch(width, seed=width)
        torch.testing.assert_close(
            compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
        )
