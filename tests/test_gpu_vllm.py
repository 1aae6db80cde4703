"""The vLLM generator on one GPU (run with `pytest -m gpu` on a GPU machine with vllm).

One engine serves the whole module (start-up with torch.compile and CUDA graphs, the production
path, takes tens of seconds). Its temperature is 0.7, so its log-probs come from vLLM's
"processed_logprobs" mode, the one where temperature matters.
"""

from __future__ import annotations

import pytest
import torch
from gpu_models import SMALL, free_gpu_memory, peaked_weights, random_prompts

from runtime.backends import OptimizerConfig, collate
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.grpo import policy_loss
from runtime.models import to_hf
from runtime.models.export import write_hf_model
from runtime.models.loading import weight_source
from runtime.tasks.arith import tokenizer as char_tokenizer

pytestmark = pytest.mark.gpu

T = 0.7
EOS, PAD = 1, 0
MAX_NEW = 64


def small_engine(**options):
    """A vLLM engine of SMALL as these tests build it (a quarter of the GPU, 256 tokens, 64
    sequences, sampling at T); `options` add to or override VLLMGenerator's arguments."""
    from runtime.backends.vllm_generator import VLLMGenerator

    free_gpu_memory()
    return VLLMGenerator(
        SMALL,
        **{
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "max_model_len": 256,
            "temperature": T,
            "top_p": 1.0,
            "gpu_memory_utilization": 0.25,
            "seed": 0,
            "max_num_seqs": 64,
            **options,
        },
    )


def _hf(weights):
    return {k: v.to(torch.bfloat16) for k, v in to_hf(weights, SMALL).items()}


@pytest.fixture(scope="module")
def w0():
    return peaked_weights(SMALL, seed=10)


@pytest.fixture(scope="module")
def engine(w0):
    gen = small_engine(weights=_hf(w0))
    print(f"vLLM engine ready in {gen.init_seconds:.1f} s ({gen.logprobs_mode})")
    yield gen
    gen.close()
    free_gpu_memory()


def _sample(engine, seed: int, prompts=None, n: int = 4):
    prompts = prompts or random_prompts(8, SMALL.vocab_size, seed=1)
    out = engine.generate(prompts, n=n, max_new_tokens=MAX_NEW, temperature=T, seed=seed)
    _assert_not_degenerate(out)
    return out


def _assert_not_degenerate(completions) -> None:
    """Samples that every check here would pass vacuously fail loudly instead: one sequence
    repeated across prompts and seeds, or log-probs of 0 (p = 1: nothing is being sampled)."""
    distinct = len({tuple(c.response_ids) for c in completions})
    lps = torch.tensor([lp for c in completions for lp in c.response_logprobs])
    certain = float((lps > -1e-4).float().mean())
    assert distinct > len(completions) // 2, f"only {distinct} distinct samples: degenerate"
    assert certain < 0.5, f"{certain:.0%} of sampled tokens have p ~ 1: degenerate outputs"
    # The test weights sample at a few nats (uniform would be log(vocab) ~ 8.3).
    assert -6.0 < float(lps.mean()) < -0.3, f"mean sampled log-prob {float(lps.mean()):.2f}"


def _mismatch(completions, scorer) -> torch.Tensor:
    """|generator log-prob - teacher-forced log-prob| over every sampled token."""
    batch = collate(completions, pad_id=PAD)
    scored = scorer.logprobs(batch.tokens, batch.response_mask).cpu()
    return (scored - batch.logprobs)[batch.response_mask].abs()


def _bf16_noise(completions, weights, temperature: float = T) -> torch.Tensor:
    """How far bf16 rounding alone moves these log-probs: the reference in fp32 vs in bf16.

    vLLM computes in plain bf16 (bf16 residual stream), the reference in the trainer's regime;
    both sit within bf16 rounding of the exact values, so twice this is the tolerance.
    """
    batch = collate(completions, pad_id=PAD)
    scores = [
        GPUReference(SMALL, temperature=temperature, weights=weights, device="cuda", dtype=dtype)
        .logprobs(batch.tokens, batch.response_mask)
        .cpu()
        for dtype in (torch.float32, torch.bfloat16)
    ]
    noise = (scores[0] - scores[1])[batch.response_mask].abs()
    assert noise.mean() > 1e-3  # the rounding is visible at this spread (not a 0 == 0 test)
    return noise


def _assert_matches(completions, weights, scorer) -> torch.Tensor:
    diff = _mismatch(completions, scorer)
    noise = _bf16_noise(completions, weights)
    print(
        f"vLLM vs recompute mean |diff| {diff.mean():.4f} (p99 {diff.quantile(0.99):.3f}); "
        f"bf16 rounding alone {noise.mean():.4f}"
    )
    assert diff.mean() < 2 * noise.mean() and diff.quantile(0.99) < 0.5
    return diff


def test_samples_are_prompt_major_with_one_logprob_per_token(engine):
    prompts = random_prompts(8, SMALL.vocab_size, seed=1)
    out = _sample(engine, seed=1, prompts=prompts)
    assert len(out) == 8 * 4
    for k, c in enumerate(out):
        assert c.prompt_index == k // 4 and c.prompt_ids == prompts[k // 4]
        assert 0 < len(c.response_ids) <= MAX_NEW
        assert len(c.response_logprobs) == len(c.response_ids)
        assert all(lp <= 0 for lp in c.response_logprobs)
        assert c.finish_reason == ("stop" if c.response_ids[-1] == EOS else "length")
    # four samples of one prompt differ (sampling, not four copies of one sequence)
    assert len({tuple(c.response_ids) for c in out[:4]}) > 1


def test_logprobs_match_the_trainer_distribution(engine, w0):
    """vLLM's sampled-token log-probs equal log softmax(logits / T) recomputed by TorchTitan,
    up to bf16 noise; the same check at T = 1 fails (the mode matters)."""
    out = _sample(engine, seed=2)
    right = _assert_matches(out, w0, GPUReference(SMALL, temperature=T, weights=w0, device="cuda"))
    wrong = _mismatch(out, GPUReference(SMALL, temperature=1.0, weights=w0, device="cuda"))
    print(f"at the wrong temperature {wrong.mean():.3f}")
    assert wrong.mean() > 5 * right.mean()


def test_load_weights_switches_the_policy_in_place(engine, w0):
    before = _sample(engine, seed=3)
    w1 = peaked_weights(SMALL, seed=11)
    engine.load_weights(_hf(w1))
    engine.policy_version = 1
    after = _sample(engine, seed=3)
    assert all(c.policy_version == 1 for c in after)
    same = sum(a.response_ids == b.response_ids for a, b in zip(before, after, strict=True))
    assert same == 0  # new weights, new samples (CUDA graphs see the copied weights)
    _assert_matches(after, w1, GPUReference(SMALL, temperature=T, weights=w1, device="cuda"))

    engine.load_weights(_hf(w0))
    engine.policy_version = 2
    again = _sample(engine, seed=3)
    same = sum(a.response_ids == b.response_ids for a, b in zip(before, again, strict=True))
    # same weights and seeds: the same samples (a rare bf16 tie may flip one sequence)
    assert same >= len(before) - 2


def test_trainer_weights_round_trip_into_vllm(engine):
    """A trained step's `hf_state_dict()` loads into vLLM, whose log-probs then match the
    trainer's own teacher-forced ones."""
    trainer = FSDPTrainer(
        SMALL,
        OptimizerConfig(lr=1e-3),
        temperature=T,
        weights=peaked_weights(SMALL, 12),
        device="cuda",
    )
    engine.load_weights(trainer.hf_state_dict())
    batch = collate(_sample(engine, seed=4), pad_id=PAD)
    adv = torch.randn(batch.tokens.shape[0], generator=torch.Generator().manual_seed(0))
    trainer.train_step(batch.tokens, batch.response_mask, adv, batch.logprobs, None, policy_loss)
    engine.load_weights(trainer.hf_state_dict())
    master = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    _assert_matches(_sample(engine, seed=5), master, trainer)


def test_incomplete_weights_are_refused(engine, w0):
    weights = _hf(w0)
    del weights["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights(weights)
    engine.load_weights(_hf(w0))


def _greedy(engine, prompts) -> list[list[int]]:
    """Each prompt alone, greedy: one sequence a step, so two engines of the same settings run
    the same kernels on the same shapes whatever order their requests arrive in."""
    return [
        engine.generate([p], n=1, max_new_tokens=MAX_NEW, temperature=0.0, logprobs=False)[
            0
        ].response_ids
        for p in prompts
    ]


def test_an_engine_of_its_own_process_loads_every_weight_path():
    """`generator.engine separate`: vLLM's engine core in a process of its own takes a full
    version by each weight path (host tensors as the store hands them over, a flat buffer of
    this process as the push path leaves one, another process's buffer by CUDA IPC) and then
    samples what the trainer's code scores under that version (the log-prob check every engine
    here passes); the CUDA IPC buffer is free once its one opener, the engine's worker, let go
    of it.

    Not token for token against this process's engine: two engines in two processes may pick
    different GEMM kernels (FlashInfer tunes its own at start-up), and one near-tie in bf16 then
    turns a greedy sequence (seen: one prompt of eight, at its ninth token, beside the other
    tests of the group); the log-prob check tells a wrong or stale version apart all the same."""
    from runtime.weights.flat import fill, flat_layout
    from runtime.weights.ipc import export_ipc

    separate = small_engine(engine_in_process=False)
    print(f"vLLM engine of its own process ready in {separate.init_seconds:.1f} s")
    try:
        assert separate.ipc_opens == 1
        prompts = random_prompts(8, SMALL.vocab_size, seed=6)
        previous = None
        for path, seed in (("store", 20), ("push", 21), ("ipc", 22)):
            weights = peaked_weights(SMALL, seed=seed)
            hf = _hf(weights)
            if path == "store":
                separate.load_weights({k: v.cpu() for k, v in hf.items()})
            else:
                entries, total = flat_layout(hf)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                flat = torch.empty(total, dtype=torch.uint8, device="cuda")
                fill(flat, entries, hf)
                torch.cuda.synchronize()
                if path == "push":
                    separate.load_flat(flat, entries)
                else:
                    separate.load_ipc(export_ipc(flat, separate.ipc_opens), entries)
                del flat
                torch.cuda.ipc_collect()
                assert torch.cuda.memory_allocated() <= base + (1 << 20), path
            print(f"{path}: a version into the separate engine in {separate.load_seconds:.2f} s")
            # sampled with seeds, scored by the trainer's code: the weights just loaded
            reference = GPUReference(SMALL, temperature=T, weights=weights, device="cuda")
            _assert_matches(_sample(separate, seed=7), weights, reference)
            del reference
            free_gpu_memory()
            greedy = _greedy(separate, prompts)
            if previous is not None:  # the version changed what is sampled
                assert sum(a == b for a, b in zip(greedy, previous, strict=True)) < len(greedy) // 2
            previous = greedy
        incomplete = _hf(weights)
        del incomplete["model.norm.weight"]
        with pytest.raises(KeyError, match="model.norm.weight"):
            separate.load_weights(incomplete)
    finally:
        separate.close()
        free_gpu_memory()


# The product path: a Hugging Face folder in (read a block at a time into a model built on meta),
# a trained policy exported as the trainer actor exports it, and a second engine (beside the
# module's) that loads the export from disk.
def test_vllm_serves_an_export_with_the_trainers_logprobs(tmp_path):
    start = write_hf_model(
        _hf(peaked_weights(SMALL, seed=12)),
        SMALL,
        tmp_path / "start",
        tokenizer=char_tokenizer(SMALL.vocab_size),
        dtype="float32",
    )
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

    engine = small_engine(model_dir=export)
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
