"""Trainer speed knobs: activation checkpointing off, and torch.compile per transformer block
(with and under activation checkpointing, batch widths that change from step to step)."""

from __future__ import annotations

import pytest
import torch

from recipes import UserError, architecture
from runtime.backends import OptimizerConfig, fsdp_trainer
from runtime.backends import build as services
from runtime.backends.fsdp_trainer import FSDPTrainer, GPUReference
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))
LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def _batch(width: int, seed: int = 0, rows: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, SPEC.vocab_size, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, 8:] = True
    mask[0, width - 3 :] = False  # a shorter response, right-padded
    return tokens, mask, torch.linspace(-1, 1, rows)


def _trainer(**options) -> FSDPTrainer:
    return FSDPTrainer(
        SPEC,
        OptimizerConfig(lr=1e-2),
        temperature=0.7,
        seed=1,
        device="cpu",
        compute_dtype=torch.float32,
        publish_dtype=torch.float32,
        **options,
    )


def _step(trainer: FSDPTrainer, width: int, seed: int) -> dict[str, float]:
    tokens, mask, adv = _batch(width, seed)
    old = trainer.logprobs(tokens, mask)
    return trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)


def test_knobs_read_0_or_1(monkeypatch):
    name = services.ACTIVATION_CHECKPOINTING_ENV
    monkeypatch.delenv(name, raising=False)
    assert services.env_flag(name, True) is True
    monkeypatch.setenv(name, "0")
    assert services.env_flag(name, True) is False
    monkeypatch.setenv(services.TRAINER_COMPILE_ENV, "1")
    assert services.env_flag(services.TRAINER_COMPILE_ENV, False) is True
    monkeypatch.setenv(services.TRAINER_COMPILE_ENV, "yes")
    with pytest.raises(UserError, match="FORGESKY_TRAINER_COMPILE='yes': expected 0 or 1"):
        services.env_flag(services.TRAINER_COMPILE_ENV, False)


def test_without_activation_checkpointing_the_steps_are_the_same():
    recomputed, kept = _trainer(), _trainer(activation_checkpointing=False)
    for width, seed in ((20, 0), (26, 1)):
        a, b = _step(recomputed, width, seed), _step(kept, width, seed)
        for key in ("loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_compiled_checkpointed_blocks_match_eager_across_batch_widths():
    from torch._dynamo.utils import counters

    eager, compiled = _trainer(), _trainer(compile=True)
    tokens, mask, _ = _batch(20)
    graphs = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(
        compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
    )
    assert counters["stats"]["unique_graphs"] > graphs  # the checkpointed blocks did compile
    # the output projection's log-softmax is compiled too (eager keeps the plain function)
    assert compiled.model._head_logprobs is not fsdp_trainer.head_logprobs
    assert not hasattr(eager.model, "_head_logprobs")
    a, b = _step(eager, 23, 1), _step(compiled, 23, 1)
    for key in ("loss", "kl", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # dynamic shapes: a new width reuses the compiled graphs (a recompile would raise here)
    with torch._dynamo.config.patch(error_on_recompile=True):
        a, b = _step(eager, 31, 2), _step(compiled, 31, 2)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    tokens, mask, _ = _batch(17, seed=3)
    torch.testing.assert_close(
        compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-4, rtol=0
    )


def test_compiled_reference_scores_like_eager():
    eager = GPUReference(SPEC, seed=4, device="cpu", dtype=torch.float32)
    compiled = GPUReference(SPEC, seed=4, device="cpu", dtype=torch.float32, compile=True)
    for width in (20, 29):
        tokens, mask, _ = _batch(width, seed=width)
        torch.testing.assert_close(
            compiled.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
        )


def _spec(recipe: str) -> ModelSpec:
    from recipes import load_recipe

    return services.model_spec(load_recipe(recipe))


H100, H200 = 79.6 * 2**30, 139.8 * 2**30  # what torch reports as their total memory


def test_memory_plan_is_calibrated_on_the_measured_peaks_and_stays_above_them():
    # Qwen3-1.7B alone on an H200, compiled, no checkpointing: peaks of 67.8, 90.9 and 137.1 GB
    # at 8192, 16384 and 32768 tokens per micro-batch (bench/results, trainer_mfu).
    spec = _spec("qwen3-1.7b")
    for tokens, measured in ((8192, 67.8e9), (16384, 90.9e9), (32768, 137.1e9)):
        fsdp_trainer.PLAN_TOKENS, saved = (tokens,), fsdp_trainer.PLAN_TOKENS
        try:
            _, checkpointing, peak = fsdp_trainer.memory_plan(spec, 1, 10**15)
        finally:
            fsdp_trainer.PLAN_TOKENS = saved
        assert not checkpointing
        assert measured < peak < 1.15 * measured, tokens


def test_memory_plan_keeps_activations_where_the_gpu_holds_them():
    small = _spec("qwen3-1.7b")
    assert fsdp_trainer.memory_plan(small, 1, H200)[:2] == (16384, False)
    assert fsdp_trainer.memory_plan(small, 1, H100)[:2] == (8192, False)
    # 8B over two H100 ranks: the sharded optimizer state leaves room only with checkpointing
    big = _spec("qwen3-8b")
    tokens, checkpointing, peak = fsdp_trainer.memory_plan(big, 2, H100)
    assert checkpointing and peak <= fsdp_trainer.PLAN_HEADROOM * H100
    # nothing fits: the smallest micro-batch, checkpointed (the recipe check rejects such plans)
    assert fsdp_trainer.memory_plan(big, 1, H100)[:2] == (4096, True)
    # more memory never means fewer tokens or checkpointing where less memory went without
    previous = None
    for gb in range(60, 200, 10):
        tokens, checkpointing, _ = fsdp_trainer.memory_plan(small, 1, gb * 2**30)
        if previous is not None and not previous[1]:
            assert not checkpointing and tokens >= previous[0]
        previous = (tokens, checkpointing)


def test_knobs_in_the_environment_win_over_the_memory_plan(monkeypatch):
    from recipes import load_recipe

    recipe = load_recipe("tiny")
    for name in (services.MICRO_BATCH_ENV, services.ACTIVATION_CHECKPOINTING_ENV):
        monkeypatch.delenv(name, raising=False)
    assert services.trainer_memory_plan(recipe) == (8192, True)  # a CPU: the fixed default
    monkeypatch.setenv(services.MICRO_BATCH_ENV, "2048")
    monkeypatch.setenv(services.ACTIVATION_CHECKPOINTING_ENV, "0")
    assert services.trainer_memory_plan(recipe) == (2048, False)
