"""LoRA trainers on the CPU (real TorchTitan): only the adapter trains, the reference is the base
with the adapter off in the trainer itself, activation checkpointing and compile change nothing,
two FSDP2 ranks train and score like one, and a checkpoint holds the adapter alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import join_group, run_ranks, token_batch

from recipes import architecture
from recipes.run_sections import Lora
from runtime.backends import OptimizerConfig, TitanReference, TitanTrainer
from runtime.backends.checkpoint_read import adapter_weights, read_all, saved_kind
from runtime.grpo import policy_loss
from runtime.models import ModelSpec
from runtime.models.lora import adapter_off, adapter_state

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))
LORA = Lora(rank=8, targets=["q_proj", "v_proj", "down_proj"])
LOSS = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def _batch(width: int = 20, seed: int = 0, rows: int = 7):
    return token_batch(SPEC.vocab_size, rows, width, seed=seed, short=width - 13)


def _titan(seed: int = 1, lora: Any = LORA, **options: Any) -> TitanTrainer:
    return TitanTrainer(
        SPEC, OptimizerConfig(lr=1e-2), temperature=0.7, seed=seed, lora=lora, **options
    )


def _fsdp(seed: int = 1, **options: Any) -> Any:
    from runtime.backends.fsdp_trainer import FSDPTrainer

    return FSDPTrainer(
        SPEC,
        OptimizerConfig(lr=1e-2),
        temperature=0.7,
        seed=seed,
        device="cpu",
        compute_dtype=torch.float32,
        publish_dtype=torch.float32,
        lora=LORA,
        **options,
    )


def _step(trainer: Any, seed: int = 0, width: int = 20) -> dict[str, float]:
    tokens, mask, adv = _batch(width, seed)
    old = trainer.logprobs(tokens, mask)
    return trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_only_the_adapter_trains_and_publishes_under_peft_names():
    trainer = _titan()
    before = _params(trainer)
    assert not any(before[n].any() for n in before if ".lora_b." in n)  # B starts at 0
    for seed in range(3):
        stats = _step(trainer, seed)
    assert stats["grad_norm"] > 0 and stats["step"] == 3
    after = _params(trainer)
    adapter = set(adapter_state(trainer.model))
    assert len(adapter) == 2 * SPEC.n_layers * 3
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in adapter), name
    published = trainer.hf_state_dict()
    assert sorted(published) == sorted(
        f"base_model.model.model.layers.{i}.{place}.lora_{ab}.weight"
        for i in range(SPEC.n_layers)
        for place in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    )
    # the optimizer holds the adapter alone
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in adapter_state(trainer.model).values()}


def test_the_reference_is_the_base_with_the_adapter_off():
    trainer = _titan(seed=3)
    tokens, mask, _ = _batch(23, seed=5)
    # B = 0: the policy is the base, to the bit
    assert torch.equal(trainer.reference_logprobs(tokens, mask), trainer.logprobs(tokens, mask))
    for seed in range(3):
        _step(trainer, seed)
    policy, reference = trainer.logprobs(tokens, mask), trainer.reference_logprobs(tokens, mask)
    assert (policy - reference).abs().max() > 1e-3
    plain = TitanReference(SPEC, temperature=0.7, seed=3)  # the same seeded base, no adapter
    assert torch.equal(reference, plain.logprobs(tokens, mask))
    # the adapter is on again afterwards
    assert torch.equal(trainer.logprobs(tokens, mask), policy)


def test_adapter_off_restores_the_scaling_when_its_body_raises():
    trainer = _titan()
    wrapped = [m for m in trainer.model.modules() if hasattr(m, "lora_a")]
    assert wrapped and all(m._lora_scaling == LORA.scaling for m in wrapped)
    with pytest.raises(ValueError, match="inside"), adapter_off(trainer.model):
        assert all(m._lora_scaling == 0.0 for m in wrapped)
        raise ValueError("inside")
    assert all(m._lora_scaling == LORA.scaling for m in wrapped)
    full = _titan(lora=None)
    with pytest.raises(RuntimeError, match="no LoRA"), adapter_off(full.model):
        pass
    with pytest.raises(RuntimeError, match="full-parameter"):
        full.reference_logprobs(*_batch()[:2])


def test_the_fsdp_trainer_on_one_rank_steps_like_the_cpu_trainer():
    cpu, fsdp = _titan(), _fsdp(tokens_per_micro_batch=40)
    for seed in range(2):
        a, b = _step(cpu, seed), _step(fsdp, seed)
        for key in ("loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    tokens, mask, _ = _batch(21, seed=9)
    torch.testing.assert_close(
        fsdp.reference_logprobs(tokens, mask), cpu.reference_logprobs(tokens, mask)
    )
    published, expected = fsdp.hf_state_dict(), cpu.hf_state_dict()
    assert published.keys() == expected.keys()
    layout = fsdp.hf_layout()
    assert {k: (v.shape, v.dtype, v.device.type) for k, v in layout.items()} == {
        k: (v.shape, torch.float32, "meta") for k, v in expected.items()
    }
    for name, tensor in expected.items():
        torch.testing.assert_close(published[name], tensor, rtol=0, atol=1e-5)
    fsdp.publish_dtype = torch.bfloat16  # as runs publish: every matrix cast in one go
    for name, tensor in fsdp.hf_state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, published[name].bfloat16())
    # a later publish reads the parameters as they are then (where they sit was found once)
    fsdp.publish_dtype = torch.float32
    published = {k: v.clone() for k, v in published.items()}  # float32 publishes are live
    a, b = _step(cpu, 5), _step(fsdp, 5)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    later, expected = fsdp.hf_state_dict(), cpu.hf_state_dict()
    assert any(not torch.equal(later[k], published[k]) for k in later)
    for name, tensor in expected.items():
        torch.testing.assert_close(later[name], tensor, rtol=0, atol=1e-5)


def test_frozen_projections_are_stored_in_the_compute_dtype():
    from runtime.backends.fsdp_trainer import _round_frozen_weights
    from runtime.models.titan import meta_model

    model = meta_model(SPEC, lora=LORA)
    _round_frozen_weights(model, torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.attention.qkv_linear.wq.weight"] == torch.bfloat16
    assert dtypes["layers.0.feed_forward.w1.weight"] == torch.bfloat16
    assert dtypes["layers.0.attention.qkv_linear.wq.lora_a.weight"] == torch.float32
    assert dtypes["layers.0.attention.qkv_linear.wq.lora_b.weight"] == torch.float32
    assert dtypes["layers.0.attention_norm.weight"] == torch.float32
    assert dtypes["tok_embeddings.weight"] == torch.float32  # tied to the output projection


def test_activation_checkpointing_and_compile_step_like_eager():
    eager = _fsdp(activation_checkpointing=False)
    checkpointed = _fsdp(activation_checkpointing=True)
    compiled = _fsdp(activation_checkpointing=True, compile=True)
    tokens, mask, _ = _batch(20, seed=2)
    for trainer in (checkpointed, compiled):
        torch.testing.assert_close(
            trainer.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
        )
    for seed, width in ((0, 20), (1, 26)):
        a = _step(eager, seed, width)
        for trainer in (checkpointed, compiled):
            b = _step(trainer, seed, width)
            for key in ("loss", "kl", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    reference = eager.reference_logprobs(tokens, mask)
    for trainer in (checkpointed, compiled):
        torch.testing.assert_close(
            trainer.reference_logprobs(tokens, mask), reference, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            trainer.logprobs(tokens, mask), eager.logprobs(tokens, mask), atol=1e-5, rtol=0
        )


def _rank(rank: int, world: int, port: int, out: str) -> None:
    join_group(rank, world, port)
    import torch.distributed as dist

    tokens, mask, adv = _batch()
    trainer = _fsdp(tokens_per_micro_batch=40)
    sharded = type(next(iter(adapter_state(trainer.model).values()))).__name__
    share = trainer.my_rows(tokens.shape[0])
    first = trainer.reference_logprobs(tokens, mask)
    old = trainer.logprobs(tokens, mask)
    stats = trainer.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    later = trainer.reference_logprobs(tokens, mask)
    published = trainer.hf_state_dict()
    trainer.save_checkpoint(str(Path(out).parent / "dcp"))
    assert trainer.checkpoint_written(wait=True)
    shares = [None] * world
    dist.all_gather_object(shares, (share, first, later))
    if rank == 0:
        torch.save((sharded, shares, stats, published), out)
    dist.destroy_process_group()


def test_two_ranks_train_and_score_like_one(tmp_path: Path):
    sharded, shares, stats, published = run_ranks(_rank, 2, tmp_path)
    assert sharded == "DTensor"
    tokens, mask, adv = _batch()
    one = _titan()
    first = one.reference_logprobs(tokens, mask)
    old = one.logprobs(tokens, mask)
    expected = one.train_step(tokens, mask, adv, old, old, policy_loss, **LOSS)
    later = one.reference_logprobs(tokens, mask)
    # each rank scored its own rows; put back together they are one rank's
    assert [s.start for s, _, _ in shares] == [0, 4] and shares[-1][0].stop == 7
    torch.testing.assert_close(torch.cat([f for _, f, _ in shares]), first, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([x for _, _, x in shares]), later, rtol=0, atol=1e-6)
    torch.testing.assert_close(later, first)  # the base did not move
    for key in ("loss", "kl", "response_tokens", "grad_norm", "ratio/mean"):
        assert stats[key] == pytest.approx(expected[key], abs=1e-5), key
    reference = one.hf_state_dict()
    assert published.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(published[name], tensor, rtol=0, atol=1e-5)
    # the two ranks' checkpoint resumes on one process
    assert saved_kind(tmp_path / "dcp") == ("lora", 8, ("q_proj", "v_proj", "down_proj"))
    single = _titan(seed=1)
    single.load_checkpoint(str(tmp_path / "dcp"))
    assert single.step == 1
    for name, param in adapter_state(one.model).items():
        torch.testing.assert_close(adapter_state(single.model)[name], param, rtol=0, atol=1e-5)


def test_a_checkpoint_holds_the_adapter_and_its_moments_and_resumes_bit_exactly(tmp_path: Path):
    trainer = _titan(seed=2)
    for seed in range(2):
        _step(trainer, seed)
    trainer.save_checkpoint(str(tmp_path / "lora"))
    assert trainer.checkpoint_written(wait=True)
    saved = read_all(tmp_path / "lora")
    adapter = adapter_state(trainer.model)
    assert set(saved["model"]) == set(adapter)
    assert all(".lora_a." in k or ".lora_b." in k for k in saved["model"])
    assert set(saved["optimizer"]["state"]) == set(adapter)
    assert all({"exp_avg", "exp_avg_sq"} <= set(s) for s in saved["optimizer"]["state"].values())
    assert saved["step"] == 2
    assert saved_kind(tmp_path / "lora") == ("lora", 8, ("q_proj", "v_proj", "down_proj"))
    weights = adapter_weights(tmp_path / "lora")
    assert weights.keys() == adapter.keys()
    for name, param in adapter.items():
        assert torch.equal(weights[name], param.detach()), name

    resumed = _titan(seed=2)  # the same base; a fresh adapter, then the checkpoint's
    resumed.load_checkpoint(str(tmp_path / "lora"))
    assert resumed.step == 2
    a, b = _step(trainer, 7), _step(resumed, 7)
    assert a == b
    mine, theirs = _params(trainer), _params(resumed)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name

    full = _titan(lora=None)
    _step(full)
    full.save_checkpoint(str(tmp_path / "full"))
    assert full.checkpoint_written(wait=True)
    assert saved_kind(tmp_path / "full") == ("full",)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        adapter_weights(tmp_path / "full")


def test_the_trainer_actor_answers_reference_logprobs_as_the_reference_actor_does():
    """A trainer proc (real Monarch) built from a recipe with model.lora scores the base."""
    import asyncio

    from recipes import load_recipe, plan
    from runtime.actors import TrainerActor
    from runtime.procs.mesh import ServiceMesh

    tiny = load_recipe("tiny")
    recipe = tiny.model_copy(update={"model": tiny.model.model_copy(update={"lora": LORA})})
    settings = plan(tiny, 0).settings
    tokens, mask, _ = _batch(18, seed=4)

    async def scenario() -> dict[str, Any]:
        mesh = await ServiceMesh.spawn("trainer", 1, threads=1)
        try:
            trainer = mesh.spawn_actor(TrainerActor)
            await trainer.setup.call_one(recipe, settings, None)
            return await trainer.reference_logprobs.call_one(tokens, mask)
        finally:
            await mesh.stop()

    answer = asyncio.run(scenario())
    base = TitanReference(SPEC, temperature=recipe.grpo.temperature, seed=recipe.grpo.seed)
    expected = base.logprobs(tokens, mask)
    assert answer["first"] == 0 and answer["seconds"] > 0
    assert len(answer["logprobs"]) == tokens.shape[0]
    for row, lps, keep in zip(expected, answer["logprobs"], mask, strict=True):
        assert lps == row[keep].tolist()
