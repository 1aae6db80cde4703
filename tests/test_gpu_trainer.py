"""GPU trainer and reference on one GPU (run with `pytest -m gpu` on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from gpu_models import QWEN3_1P7B_2_LAYERS, SMALL, free_gpu_memory, peaked_weights
from runtime_helpers import token_batch

from runtime.backends import OptimizerConfig
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.backends.scoring import response_logprobs
from runtime.grpo import policy_loss
from runtime.models import build_model, to_hf
from runtime.models.export import write_hf_model
from runtime.models.loading import weight_source
from runtime.tasks.arith import tokenizer as char_tokenizer

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    free_gpu_memory()


def _batch(spec, rows: int, prompt: int, response: int, seed: int = 0):
    tokens, mask, _ = token_batch(spec.vocab_size, rows, prompt + response, prompt, seed=seed)
    return tokens, mask


def test_qwen3_layers_train_a_step_in_bf16():
    """Qwen3-1.7B's layers and vocabulary: a step runs in micro-batches, moves the weights the
    way the advantages say, and reports finite stats."""
    torch.cuda.reset_peak_memory_stats()
    trainer = FSDPTrainer(
        QWEN3_1P7B_2_LAYERS,
        OptimizerConfig(lr=1e-3),
        seed=0,
        device="cuda",
        tokens_per_micro_batch=4096,
    )
    tokens, mask = _batch(QWEN3_1P7B_2_LAYERS, rows=16, prompt=128, response=384)
    advantages = torch.tensor([1.0, -1.0] * 8)
    # Backends return results on their device (actors move them); the CPU copies meet the
    # CPU-side mask and advantages below.
    before = trainer.logprobs(tokens, mask).cpu()
    assert before.dtype == torch.float32 and before.shape == tokens.shape
    assert torch.isfinite(before).all() and (before[mask] < 0).all() and (before[~mask] == 0).all()
    stats = trainer.train_step(tokens, mask, advantages, before, before, policy_loss, kl_beta=0.1)
    assert trainer.step == 1 and stats["grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert stats["response_tokens"] == float(mask.sum())
    after = trainer.logprobs(tokens, mask).cpu()
    change = ((after - before) * mask).sum(1) / mask.sum(1)
    assert change[advantages > 0].mean() > 0 > change[advantages < 0].mean()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"peak GPU memory {peak:.1f} GiB")
    # fp32 weights, grads and two AdamW moments of ~0.41B params are ~6.6 GiB; the logits of a
    # micro-batch must not add up to the [B, T, vocab] tensor (16 x 512 x 151936 fp32 = 46 GiB).
    assert peak < 40


def test_published_weights_are_full_bf16_hf_tensors():
    trainer = FSDPTrainer(SMALL, OptimizerConfig(), seed=1, device="cuda")
    published = trainer.hf_state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in published
    assert all(t.dtype == torch.bfloat16 and t.is_cuda for t in published.values())
    q = published["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (SMALL.n_heads * SMALL.head_dim, SMALL.dim)


def test_reference_scores_like_the_trainer_at_the_start():
    """The reference computes in the one-rank trainer's precision (fp32 embeddings, norms and
    residual stream; bf16 matmuls), so the KL penalty starts at 0; a plain bf16 model of the same
    weights is a few bf16 ulps of the logits away, which the test shows it can tell apart."""
    weights = peaked_weights(SMALL, seed=2)
    trainer = FSDPTrainer(SMALL, OptimizerConfig(), temperature=0.8, weights=weights, device="cuda")
    reference = GPUReference(SMALL, temperature=0.8, weights=weights, device="cuda")
    tokens, mask = _batch(SMALL, rows=8, prompt=32, response=96, seed=3)
    theirs, mine = trainer.logprobs(tokens, mask).cpu(), reference.logprobs(tokens, mask).cpu()
    plain = build_model(SMALL, device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(weights)
    plain._skip_lm_head = True
    with torch.no_grad():
        bf16 = response_logprobs(plain, tokens.cuda(), mask.cuda(), 0.8).cpu()
    spread = theirs[mask].std()
    diff = (theirs - mine)[mask].abs()
    floor = (theirs - bf16)[mask].abs()
    print(
        f"log-prob spread {spread:.2f}, trainer vs reference mean |diff| {diff.mean():.5f} "
        f"(max {diff.max():.4f}); vs a plain bf16 model {floor.mean():.4f}"
    )
    assert spread > 1.0  # peaked outputs: the comparison is not trivially satisfied
    assert floor.mean() > 0.005  # bf16 rounding is visible at this spread
    # Same kernels on the same rounded operands: equal up to a rare kernel-choice difference.
    assert diff.mean() < 1e-3 and diff.max() < 0.05


def test_compiled_blocks_give_the_same_logprobs():
    weights = peaked_weights(SMALL, seed=4)
    plain = FSDPTrainer(SMALL, OptimizerConfig(), weights=weights, device="cuda")
    compiled = FSDPTrainer(SMALL, OptimizerConfig(), weights=weights, device="cuda", compile=True)
    tokens, mask = _batch(SMALL, rows=4, prompt=16, response=48, seed=5)
    exact = FSDPTrainer(
        SMALL, OptimizerConfig(), weights=weights, device="cuda", compute_dtype=torch.float32
    )
    ours = plain.logprobs(tokens, mask)
    diff = (ours - compiled.logprobs(tokens, mask))[mask].abs()
    noise = (ours - exact.logprobs(tokens, mask))[mask].abs()
    print(f"compiled vs eager mean |diff| {diff.mean():.4f}; bf16 vs fp32 {noise.mean():.4f}")
    # Inductor fuses elementwise ops in fp32 where eager rounds each to bf16: the difference is
    # bounded by what bf16 rounding itself does to these log-probs.
    assert diff.mean() < max(0.02, noise.mean().item())
    stats = compiled.train_step(tokens, mask, torch.ones(4), None, None, policy_loss)
    assert stats["grad_norm"] > 0


def test_a_warmed_up_trainer_compiles_nothing_in_its_first_step():
    """One rank in bf16 autocast, as a one-GPU plan runs it: the warm-up's made-up micro-batch
    makes the graphs, and the first step, at other sizes, compiles none."""
    from runtime.backends.gpu_memory import StepEvents

    torch._dynamo.reset()
    trainer = FSDPTrainer(SMALL, OptimizerConfig(), device="cuda", compile=True)
    warm = trainer.warm_up(96, 1)
    print("warm-up", warm)
    assert warm["graphs"] > 0 and "out_of_memory" not in warm
    tokens, mask = _batch(SMALL, rows=6, prompt=16, response=48, seed=5)
    old = torch.zeros(tokens.shape)
    events = StepEvents("cuda")
    before = events.read()
    with torch._dynamo.config.patch(error_on_recompile=True):
        stats = trainer.train_step(tokens, mask, torch.linspace(-1, 1, 6), old, None, policy_loss)
    assert events.since(before)["compile/graphs"] == 0 and stats["grad_norm"] > 0


def test_compiled_output_projection_trains_like_eager_in_less_memory():
    """Qwen3-1.7B's vocabulary: the compiled projection + log-softmax (one reduction over the
    bf16 logits) steps like the eager one, which keeps fp32 copies of [response tokens, vocab]."""
    tokens, mask = _batch(QWEN3_1P7B_2_LAYERS, rows=16, prompt=128, response=384, seed=6)
    advantages = torch.linspace(-1, 1, 16)
    results = {}
    for head in (False, True):
        trainer = FSDPTrainer(
            QWEN3_1P7B_2_LAYERS,
            OptimizerConfig(lr=1e-3),
            seed=0,
            device="cuda",
            tokens_per_micro_batch=8192,
            activation_checkpointing=False,
            compile=True,
            compile_head=head,
        )
        old = trainer.logprobs(tokens, mask).cpu()
        trainer.train_step(tokens, mask, advantages, old, old, policy_loss)  # compiles
        free_gpu_memory()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stats = trainer.train_step(tokens, mask, advantages, old, old, policy_loss, kl_beta=0.1)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        results[head] = (old, stats, peak)
        del trainer
        free_gpu_memory()
    (old_e, eager, peak_e), (old_c, compiled, peak_c) = results[False], results[True]
    print(
        f"step peak above the resident state: eager head {peak_e:.1f} GiB, compiled "
        f"{peak_c:.1f} GiB; grad norm {eager['grad_norm']:.4f} vs {compiled['grad_norm']:.4f}"
    )
    assert (old_e - old_c)[mask].abs().mean() < 0.02
    for key in ("loss", "kl", "grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=0.05, abs=1e-3), key
    # 6144 response tokens x 151936 x 4 bytes = 3.5 GiB per fp32 copy the eager head keeps
    assert peak_c < peak_e - 2.0


def test_trainer_start_up_peak_stays_below_its_step_peak(tmp_path):
    """Built on meta and filled a block at a time, the trainer's start-up peak is its fp32
    weights plus one group in flight, below the peak of a training step."""
    spec = QWEN3_1P7B_2_LAYERS
    model = build_model(spec, device="cpu", seed=3)
    params = sum(p.numel() for p in model.parameters())
    folder = write_hf_model(
        to_hf(model.state_dict(), spec),
        spec,
        tmp_path / "hf",
        tokenizer=char_tokenizer(spec.vocab_size),
    )
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
        f"{params / 1e9:.2f}B params: start-up peak {start_peak / 1e9:.2f} GB (fp32 weights "
        f"{4 * params / 1e9:.2f} GB, resident after start {resident / 1e9:.2f} GB), step peak "
        f"{step_peak / 1e9:.2f} GB"
    )
    # one tensor in flight: to_empty gives each module of the tied embedding/output pair its
    # own storage for a moment, before they are tied again
    assert start_peak <= resident + 1.01 * largest
    assert start_peak < step_peak


def test_a_checkpoint_copies_the_state_in_the_background_and_holds_its_step(tmp_path):
    """On a GPU the checkpoint's copy of the trainer's state goes to pinned host memory on a
    stream of its own while the caller goes on; the next optimizer step waits for it (and says
    how long), so the files hold the step the checkpoint was started at, and a second write
    reuses the same pinned copy."""
    from runtime.backends import trainer_state

    spec = QWEN3_1P7B_2_LAYERS
    trainer = FSDPTrainer(spec, OptimizerConfig(lr=1e-3), seed=0, device="cuda")
    tokens, mask = _batch(spec, rows=8, prompt=64, response=192)
    advantages = torch.tensor([1.0, -1.0] * 4)
    args = (tokens, mask, advantages, None, None, policy_loss)
    trainer.train_step(*args)
    full = {
        n: getattr(p, "full_tensor", lambda p=p: p)() for n, p in trainer.model.named_parameters()
    }
    saved = {n: p.detach().float().cpu().clone() for n, p in full.items()}
    trainer.save_checkpoint(str(tmp_path / "one"))
    stats = trainer.train_step(*args)  # changes every weight once the copy is done
    assert stats["time/checkpoint_staging_wait_s"] >= 0.0
    print(f"waited {stats['time/checkpoint_staging_wait_s']:.3f} s for the copy")
    assert trainer.checkpoint_written(wait=True)
    state = trainer_state.read_all(tmp_path / "one")
    assert state["step"] == 1
    for name, value in saved.items():
        torch.testing.assert_close(state["model"][name].float(), value, atol=0, rtol=0)
    stager = trainer._saver.stager
    cached = list(stager._state_dict_stager._cached_storage_mapping.values())
    assert cached and all(s.is_pinned() for s in cached if s.nbytes() >= 1 << 20)
    trainer.save_checkpoint(str(tmp_path / "two"))
    assert "time/checkpoint_staging_wait_s" in trainer.train_step(*args)
    assert trainer.checkpoint_written(wait=True)
    assert trainer._saver.stager is stager
    assert trainer_state.read_all(tmp_path / "two")["step"] == 2


def test_a_host_copy_made_before_training_is_pinned_and_the_first_write_fills_it(tmp_path):
    """The runtime makes the checkpoints' host copy while the other services start
    (`prepare_checkpoint_copy`): pinned host memory, which the first optimizer step waits for
    and the first checkpoint copies into instead of allocating and pinning its own."""
    from runtime.backends import trainer_state

    spec = QWEN3_1P7B_2_LAYERS
    trainer = FSDPTrainer(spec, OptimizerConfig(lr=1e-3), seed=0, device="cuda")
    tokens, mask = _batch(spec, rows=8, prompt=64, response=192)
    advantages = torch.tensor([1.0, -1.0] * 4)
    args = (tokens, mask, advantages, None, None, policy_loss)
    assert trainer.prepare_checkpoint_copy()
    stats = trainer.train_step(*args)
    print(f"the first step waited {stats['time/checkpoint_staging_wait_s']:.3f} s for the copy")
    cache = trainer._saver.stager._state_dict_stager._cached_storage_mapping
    made = sorted(host.data_ptr() for host in cache.values())
    assert made and all(s.is_pinned() for s in cache.values() if s.nbytes() >= 1 << 20)
    trainer.save_checkpoint(str(tmp_path / "one"))
    trainer.train_step(*args)
    assert trainer.checkpoint_written(wait=True)
    assert sorted(host.data_ptr() for host in cache.values()) == made
    assert trainer_state.read_all(tmp_path / "one")["step"] == 1
