"""The product path on one GPU: a Hugging Face folder in (read a block at a time into a model
built on meta), a trained policy exported, and vLLM serving that export with the trainer's
log-probs. Run with `pytest -m gpu` on a GPU machine with vllm."""

from __future__ import annotations

import pytest
import torch
from gpu_models import QWEN3_1P7B_2_LAYERS, SMALL, free_gpu_memory, peaked_weights, random_prompts
from test_gpu_vllm import EOS, MAX_NEW, PAD, T, _assert_matches, _assert_not_degenerate

from runtime.backends import OptimizerConfig, collate
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.grpo import policy_loss
from runtime.models import build_model, to_hf
from runtime.models.export import write_hf_model
from runtime.models.loading import weight_source
from runtime.tasks.arith import tokenizer as char_tokenizer

pytestmark = pytest.mark.gpu

GB = 1e9


def _save(spec, weights, folder, dtype="bfloat16"):
    state = {k: v.detach().cpu() for k, v in to_hf(weights, spec).items()}
    return write_hf_model(
        state, spec, folder, tokenizer=char_tokenizer(spec.vocab_size), dtype=dtype
    )


def test_vllm_serves_an_export_with_the_trainers_logprobs(tmp_path):
    start = _save(SMALL, peaked_weights(SMALL, seed=12), tmp_path / "start", dtype="float32")
    trainer = FSDPTrainer(
        SMALL,
        OptimizerConfig(lr=1e-3),
        temperature=T,
        weights=weight_source(str(start), SMALL),
        device="cuda",
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, SMALL.vocab_size, (16, 96), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 32:] = True
    adv = torch.randn(16, generator=g)
    old = trainer.logprobs(tokens, mask)
    trainer.train_step(tokens, mask, adv, old, None, policy_loss)
    # what the trainer actor's export endpoint writes at the end of a run
    export = write_hf_model(
        trainer.hf_state_dict(),
        SMALL,
        tmp_path / "export",
        tokenizer=char_tokenizer(SMALL.vocab_size),
        temperature=T,
    )
    master = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    from runtime.backends.vllm_generator import VLLMGenerator

    free_gpu_memory()
    engine = VLLMGenerator(
        SMALL,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_model_len=256,
        temperature=T,
        gpu_memory_utilization=0.25,
        seed=0,
        model_dir=export,
        max_num_seqs=64,
    )
    try:
        prompts = random_prompts(8, SMALL.vocab_size, seed=1)
        out = engine.generate(prompts, n=4, max_new_tokens=MAX_NEW, temperature=T, seed=5)
        _assert_not_degenerate(out)
        diff = _assert_matches(out, master, trainer)
        print(f"export served by vLLM: mean |lp diff| vs the trainer {diff.mean():.4f}")
    finally:
        engine.close()
        free_gpu_memory()
    batch = collate(out, pad_id=PAD)
    assert batch.tokens.shape[0] == 32


def test_trainer_start_up_peak_stays_below_its_step_peak(tmp_path):
    """Built on meta and filled a block at a time, the trainer's start-up peak is its fp32
    weights plus one group in flight, below the peak of a training step."""
    spec = QWEN3_1P7B_2_LAYERS
    model = build_model(spec, device="cpu", seed=3)
    params = sum(p.numel() for p in model.parameters())
    folder = _save(spec, model.state_dict(), tmp_path / "hf")
    del model
    free_gpu_memory()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    trainer = FSDPTrainer(
        spec, OptimizerConfig(lr=1e-5), weights=weight_source(str(folder), spec), device="cuda"
    )
    torch.cuda.synchronize()
    start_peak = torch.cuda.max_memory_allocated() - base
    resident = torch.cuda.memory_allocated() - base
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, spec.vocab_size, (8, 512), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 128:] = True
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(tokens, mask, torch.randn(8, generator=g), None, None, policy_loss)
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - base
    largest = max(p.numel() for p in trainer.model.parameters()) * 4
    print(
        f"{params / 1e9:.2f}B params: start-up peak {start_peak / GB:.2f} GB (fp32 weights "
        f"{4 * params / GB:.2f} GB, resident after start {resident / GB:.2f} GB), step peak "
        f"{step_peak / GB:.2f} GB"
    )
    assert start_peak <= 4 * params + largest
    assert start_peak < step_peak
