"""Generator, trainer and reference backends (CPU variants) and the batch layout between them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.backends import (
    Completion,
    GeneratorBackend,
    HFGenerator,
    OptimizerConfig,
    ScoringBackend,
    TitanReference,
    TitanTrainer,
    TrainerBackend,
    collate,
    trainer_state,
)
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

PAD, BOS, EOS = 0, 1, 2
SPEC = ModelSpec(
    family="qwen3",
    vocab_size=16,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    rope_theta=10000.0,
    norm_eps=1e-6,
    max_seq_len=64,
    tie_embeddings=True,
)
LLAMA = dataclasses.replace(SPEC, family="llama3", tie_embeddings=False, norm_eps=1e-5)
# Different lengths, so the generator's left padding is exercised.
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 3, 3, 4, 8, 11, 12]]


@pytest.fixture(autouse=True)
def one_thread():
    # These models are tiny: one thread is fastest, and on a busy machine extra OpenMP workers
    # spin against other processes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pair(spec: ModelSpec = SPEC, temperature: float = 1.0, **trainer_kwargs):
    trainer = TitanTrainer(
        spec, OptimizerConfig(lr=1e-2), temperature=temperature, seed=0, **trainer_kwargs
    )
    generator = HFGenerator(
        spec, eos_token_id=EOS, pad_token_id=PAD, weights=trainer.hf_state_dict(), seed=0
    )
    return trainer, generator


@pytest.mark.parametrize(
    ("spec", "temperature", "top_p"),
    [(SPEC, 1.0, 1.0), (SPEC, 0.7, 1.0), (SPEC, 1.3, 0.9), (LLAMA, 0.8, 1.0)],
)
def test_generator_logprobs_match_the_trainers_recompute(spec, temperature, top_p):
    """The on-policy invariant the GRPO ratio rests on: same weights, same log-probs."""
    trainer, generator = _pair(spec, temperature)
    completions = generator.generate(
        PROMPTS, n=4, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=1
    )
    batch = collate(completions, pad_id=PAD)
    recomputed = trainer.logprobs(batch.tokens, batch.response_mask)
    torch.testing.assert_close(recomputed, batch.logprobs, atol=1e-4, rtol=0)
    assert (batch.logprobs[batch.response_mask] < 0).all()
    assert (batch.logprobs[~batch.response_mask] == 0).all()


def test_generate_returns_groups_prompt_major_and_stops_at_eos():
    _, generator = _pair()
    generator.policy_version = 7
    completions = generator.generate(PROMPTS, n=8, max_new_tokens=12, seed=0)
    assert len(completions) == len(PROMPTS) * 8
    for i, c in enumerate(completions):
        assert c.prompt_index == i // 8
        assert c.prompt_ids == PROMPTS[i // 8]
        assert c.policy_version == 7
        assert 1 <= len(c.response_ids) <= 12
        assert len(c.response_logprobs) == len(c.response_ids)
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == EOS and EOS not in c.response_ids[:-1]
        else:
            assert len(c.response_ids) == 12 and EOS not in c.response_ids
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    # Samples of one prompt differ: the group carries signal.
    assert len({tuple(c.response_ids) for c in completions[:8]}) > 1


def test_generate_is_reproducible_with_a_seed():
    _, generator = _pair()
    a = generator.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)
    b = generator.generate(PROMPTS, n=2, max_new_tokens=6, seed=3)
    c = generator.generate(PROMPTS, n=2, max_new_tokens=6, seed=4)
    assert [x.response_ids for x in a] == [x.response_ids for x in b]
    assert [x.response_ids for x in a] != [x.response_ids for x in c]


def test_tiny_top_p_is_greedy_and_logprobs_stay_untruncated():
    trainer, generator = _pair()
    completions = generator.generate(PROMPTS[:1], n=4, max_new_tokens=5, top_p=1e-6, seed=0)
    assert len({tuple(c.response_ids) for c in completions}) == 1
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        first = trainer.model(tokens)[0, -1].argmax().item()
    assert completions[0].response_ids[0] == first
    # Log-probs are of softmax(logits / T) before the nucleus: below 0 though the pick is certain.
    assert completions[0].response_logprobs[0] < 0


def test_load_weights_changes_outputs_in_place():
    trainer, generator = _pair()
    params_before = {n: id(p) for n, p in generator.model.named_parameters()}
    before = generator.generate(PROMPTS, n=4, max_new_tokens=6, seed=5)
    batch = collate(before, pad_id=PAD)
    advantages = torch.linspace(-1, 1, len(before))
    for _ in range(3):
        trainer.train_step(
            batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss
        )
    generator.load_weights(trainer.hf_state_dict())
    assert {n: id(p) for n, p in generator.model.named_parameters()} == params_before
    after = generator.generate(PROMPTS, n=4, max_new_tokens=6, seed=5)
    assert [c.response_logprobs for c in after] != [c.response_logprobs for c in before]
    # ...and the loaded generator is on-policy for the trained weights.
    fresh = collate(after, pad_id=PAD)
    recomputed = trainer.logprobs(fresh.tokens, fresh.response_mask)
    torch.testing.assert_close(recomputed, fresh.logprobs, atol=1e-4, rtol=0)


def test_load_weights_rejects_an_incomplete_state_dict():
    trainer, generator = _pair()
    partial = trainer.hf_state_dict()
    partial.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(KeyError, match="down_proj"):
        generator.load_weights(partial)


def _fixed_batch(trainer: TitanTrainer):
    _, generator = _pair()
    completions = generator.generate(PROMPTS, n=4, max_new_tokens=6, seed=2)
    batch = collate(completions, pad_id=PAD)
    advantages = torch.tensor([1.0, -1.0] * (len(completions) // 2))
    return batch, advantages


def test_train_step_lowers_the_loss_on_a_fixed_batch():
    trainer = TitanTrainer(SPEC, OptimizerConfig(lr=3e-3), seed=0)
    batch, advantages = _fixed_batch(trainer)

    def loss_now() -> float:
        lp = trainer.logprobs(batch.tokens, batch.response_mask)
        return policy_loss(lp, batch.logprobs, None, advantages, batch.response_mask)[0].item()

    start = loss_now()
    for _ in range(5):
        stats = trainer.train_step(
            batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss
        )
    assert loss_now() < start - 0.05
    assert trainer.step == 5 and stats["step"] == 5.0
    assert stats["grad_norm"] > 0 and stats["lr"] == pytest.approx(3e-3)
    # Sequences with positive advantage became more likely, negative ones less.
    lp = trainer.logprobs(batch.tokens, batch.response_mask)
    gain = (lp - batch.logprobs).sum(dim=1)
    assert (gain[advantages > 0] > 0).all() and (gain[advantages < 0] < 0).all()


def test_micro_batches_make_the_same_step_as_one_batch():
    whole = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), seed=0)
    batch, advantages = _fixed_batch(whole)
    rows = 5  # rows per micro-batch: several micro-batches, the last one shorter
    assert batch.tokens.shape[0] > rows and batch.tokens.shape[0] % rows
    budget = rows * batch.tokens.shape[1]
    micro = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), seed=0, tokens_per_micro_batch=budget)
    args = (batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss)
    a, b = whole.train_step(*args), micro.train_step(*args)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # Gradients, not parameters: Adam's first step is ~lr * sign(grad), which blows float noise
    # in near-zero gradient entries up to lr.
    for (name, p), q in zip(whole.model.named_parameters(), micro.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_warmup_ramps_the_learning_rate():
    trainer = TitanTrainer(SPEC, OptimizerConfig(lr=1e-3, warmup_steps=4), seed=0)
    batch, advantages = _fixed_batch(trainer)
    lrs = [
        trainer.train_step(
            batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss
        )["lr"]
        for _ in range(5)
    ]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_checkpoint_state_resumes_the_same_trajectory(tmp_path):
    original = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=0)
    batch, advantages = _fixed_batch(original)
    args = (batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss)
    original.train_step(*args)
    torch.save(original.state_dict(), tmp_path / "trainer.pt")
    resumed = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=99)
    resumed.load_state_dict(torch.load(tmp_path / "trainer.pt"))
    assert resumed.step == 1
    a, b = original.train_step(*args), resumed.train_step(*args)
    assert a["lr"] == b["lr"] and a["loss"] == pytest.approx(b["loss"], abs=1e-7)
    for p, q in zip(original.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_a_checkpoint_written_in_the_background_holds_the_state_it_was_started_with(tmp_path):
    """DCP, async: the state is copied in the background and the next step's optimizer step
    waits for the copy; training that step does not reach the files, and the resumed trainer
    takes the same next step bit for bit."""
    original = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=0)
    batch, advantages = _fixed_batch(original)
    args = (batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss)
    original.train_step(*args)
    saved = {k: v.clone() for k, v in original.model.state_dict().items()}
    original.save_checkpoint(str(tmp_path))
    after_save = original.train_step(*args)  # changes every weight while the files are written
    assert after_save["time/checkpoint_staging_wait_s"] >= 0.0
    assert original.checkpoint_written(wait=True)
    # the metadata and this one process's files (trainer_state.WRITE_THREADS at most)
    names = sorted(p.name for p in (tmp_path / "trainer").iterdir())
    assert names[0] == ".metadata", names
    assert all(n.startswith("__0_") and n.endswith(".distcp") for n in names[1:]), names
    assert 1 <= len(names) - 1 <= trainer_state.WRITE_THREADS, names
    resumed = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=99)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.step == 1
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, saved[name], atol=0, rtol=0)
    again = resumed.train_step(*args)
    assert again["loss"] == after_save["loss"] and again["lr"] == after_save["lr"]
    for p, q in zip(original.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_reference_is_the_initial_policy_and_never_changes():
    trainer = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2), seed=0)
    reference = TitanReference(SPEC, seed=0)
    batch, advantages = _fixed_batch(trainer)
    initial = reference.logprobs(batch.tokens, batch.response_mask)
    torch.testing.assert_close(initial, trainer.logprobs(batch.tokens, batch.response_mask))
    for _ in range(3):
        stats = trainer.train_step(
            batch.tokens,
            batch.response_mask,
            advantages,
            batch.logprobs,
            reference.logprobs(batch.tokens, batch.response_mask),
            policy_loss,
            kl_beta=0.1,
        )
    assert stats["kl"] > 0
    assert not any(p.requires_grad for p in reference.model.parameters())
    torch.testing.assert_close(
        reference.logprobs(batch.tokens, batch.response_mask), initial, atol=0, rtol=0
    )


def test_trainer_and_reference_accept_pretrained_weights():
    source = TitanTrainer(SPEC, OptimizerConfig(), seed=1)
    weights = source.model.state_dict()
    trainer = TitanTrainer(SPEC, OptimizerConfig(), seed=2, weights=weights)
    reference = TitanReference(SPEC, seed=3, weights=weights)
    batch, _ = _fixed_batch(source)
    expected = source.logprobs(batch.tokens, batch.response_mask)
    torch.testing.assert_close(trainer.logprobs(batch.tokens, batch.response_mask), expected)
    torch.testing.assert_close(reference.logprobs(batch.tokens, batch.response_mask), expected)


def test_collate_right_pads_in_the_contract_layout():
    completions = [
        Completion([1, 4, 5], [6, 2], [-0.5, -0.25], policy_version=3, finish_reason="stop"),
        Completion([1, 7], [8, 9, 10], [-1.0, -2.0, -3.0], 4, "length", prompt_index=1),
    ]
    batch = collate(completions, pad_id=0, pad_to_multiple_of=4)
    assert batch.tokens.tolist() == [[1, 4, 5, 6, 2, 0, 0, 0], [1, 7, 8, 9, 10, 0, 0, 0]]
    assert batch.response_mask.tolist() == [
        [False, False, False, True, True, False, False, False],
        [False, False, True, True, True, False, False, False],
    ]
    assert batch.logprobs[0, 3:5].tolist() == [-0.5, -0.25]
    assert batch.logprobs[1, 2:5].tolist() == [-1.0, -2.0, -3.0]
    assert batch.logprobs.sum().item() == pytest.approx(-6.75)
    assert batch.policy_versions.tolist() == [3, 4]
    assert batch.response_lengths.tolist() == [2, 3]
    bad = Completion([1], [2, 3], [-1.0], 0, "length")
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probs"):
        collate([bad], pad_id=0)


def test_backends_satisfy_the_protocols_the_actors_use():
    trainer, generator = _pair()
    assert isinstance(generator, GeneratorBackend)
    assert isinstance(trainer, TrainerBackend)
    assert isinstance(TitanReference(SPEC), ScoringBackend)


def test_linear_schedule_warms_up_then_decays_to_zero_and_survives_a_checkpoint():
    from runtime.backends import OptimizerConfig

    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, schedule="linear", total_steps=10)
    factors = [cfg.lr_factor(s) for s in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0 and factors[-1] == 0.125
    assert all(a > b for a, b in zip(factors[2:], factors[3:], strict=False))
    assert OptimizerConfig(lr=1.0).lr_factor(1000) == 1.0  # constant by default
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cfg.lr_factor)
    sched.load_state_dict(sched.state_dict())


def test_a_resume_refreshes_the_host_copy_made_at_start_up_in_the_same_memory(tmp_path):
    """A GPU trainer starts its checkpoints' host copy while the other services start
    (`prepare_checkpoint_copy`); a resume then loads into the same tensors, and the copy is
    refreshed into the host memory already made (on a GPU: already pinned). The resumed
    trainer takes the same next step as the one that wrote the checkpoint, and its next
    checkpoint holds the resumed state's step."""
    original = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=0)
    batch, advantages = _fixed_batch(original)
    args = (batch.tokens, batch.response_mask, advantages, batch.logprobs, None, policy_loss)
    original.train_step(*args)
    original.save_checkpoint(str(tmp_path / "one"))
    assert original.checkpoint_written(wait=True)
    expected = original.train_step(*args)

    resumed = TitanTrainer(SPEC, OptimizerConfig(lr=1e-2, warmup_steps=3), seed=99)
    # what prepare_checkpoint_copy does on a GPU (on a CPU it makes none: nothing to pin)
    assert resumed.prepare_checkpoint_copy() is False
    assert resumed.prepare_checkpoint_copy(on_cpu=True)
    resumed._saver.staged()
    cache = resumed._saver.stager._state_dict_stager._cached_storage_mapping
    made = sorted(host.data_ptr() for host in cache.values())
    resumed.load_checkpoint(str(tmp_path / "one"))
    assert resumed.step == 1 and resumed._saver.staging is not None  # the refresh
    again = resumed.train_step(*args)  # waits for the refreshed copy before its update
    assert "time/checkpoint_staging_wait_s" in again
    assert sorted(host.data_ptr() for host in cache.values()) == made
    assert again["loss"] == expected["loss"] and again["lr"] == expected["lr"]
    for p, q in zip(original.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    resumed.save_checkpoint(str(tmp_path / "two"))
    assert resumed.checkpoint_written(wait=True)
    assert sorted(host.data_ptr() for host in cache.values()) == made
    assert trainer_state.read_all(tmp_path / "two")["step"] == 2
