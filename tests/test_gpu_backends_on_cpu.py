"""The GPU backends' logic that runs anywhere: backend choice, vLLM's log-prob mode, the start-up
model folder, and the GPU trainer's math (it runs on CPU too, and must agree with the CPU
trainer)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from runtime_helpers import token_batch

from recipes import UserError, apply_overrides, architecture, load_recipe, plan
from runtime.backends import OptimizerConfig, TitanReference, TitanTrainer, token_logprobs
from runtime.backends import build as services
from runtime.backends.blocks import micro_batches
from runtime.backends.fsdp_reference import GPUReference
from runtime.backends.fsdp_trainer import FSDPTrainer
from runtime.backends.hf_generator import HFGenerator
from runtime.backends.scoring import response_logprobs
from runtime.backends.vllm_generator import (
    engine_environment,
    logprobs_mode_for,
    request_tokens,
    write_model_dir,
)
from runtime.grpo import policy_loss
from runtime.models import ModelSpec

SPEC = ModelSpec.from_arch(architecture("qwen3", "tiny"))


def _batch(seed: int = 0, rows: int = 6, width: int = 20):
    # row 0 a shorter response, right-padded; row 1 no response token at all
    tokens, mask, _ = token_batch(SPEC.vocab_size, rows, width, seed=seed, short=7, empty=True)
    return tokens, mask


def test_vllm_logprob_mode_matches_the_trainer_distribution():
    assert logprobs_mode_for(1.0, 1.0) == "raw_logprobs"
    assert logprobs_mode_for(1.0, 0.9) == "raw_logprobs"  # raw: before top-p, as the contract
    assert logprobs_mode_for(0.7, 1.0) == "processed_logprobs"  # after temperature
    with pytest.raises(UserError, match="grpo.top_p"):
        logprobs_mode_for(0.7, 0.9)
    with pytest.raises(UserError, match="temperature"):
        logprobs_mode_for(0.0, 1.0)


def test_vllm_engine_environment_keeps_flashinfer_sampler_only_where_top_p_filters():
    # top-p 1.0, no top-k: vLLM samples on its PyTorch path; FlashInfer's sampler would only be
    # built for the warm-up
    assert engine_environment(1.0) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    # top-p filters: vLLM's default (unset) stands, and the engine core may get its own process
    assert engine_environment(0.9, engine_in_process=False) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": None,
    }


def test_an_episode_rounds_long_and_short_contexts_each_get_what_the_engine_leaves():
    # one round of episodes: the most any may take is 96, the longest context has 40 left
    assert request_tokens([[1] * 300, [1] * 984, [1] * 1000], 96, 1024) == [96, 40, 24]
    with pytest.raises(ValueError, match="a prompt of 1024 tokens leaves no room"):
        request_tokens([[1] * 10, [1] * 1024], 8, 1024)


def test_model_folder_describes_the_architecture(tmp_path):
    spec = services.model_spec(load_recipe("qwen3-1.7b"))
    folder = write_model_dir(spec, tmp_path / "m", eos_token_id=7, pad_token_id=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (spec.dim, spec.n_layers)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (151936, True)
    assert config["eos_token_id"] == 7
    assert not list(folder.glob("*.safetensors"))  # vLLM starts with load_format="dummy"


def test_backend_choice_on_cpu():
    recipe = load_recipe("tiny")
    settings = plan(recipe, 0).settings
    tokenizer = services.load_tokenizer(recipe)
    assert settings.generator.backend == "hf"
    assert isinstance(
        services.GeneratorConfig(recipe, settings.generator).build(tokenizer), HFGenerator
    )
    assert isinstance(services.TrainerConfig(recipe, settings.trainer).build(), TitanTrainer)
    assert isinstance(services.ReferenceConfig(recipe, settings.reference).build(), TitanReference)
    # a CPU plan refuses vLLM before anything starts; a proc given a GPU plan's vLLM settings
    # without a GPU refuses to build it
    with_vllm = apply_overrides(recipe, ["generator.backend=vllm"])
    with pytest.raises(UserError, match="generator.backend vllm needs a GPU, and this plan"):
        plan(with_vllm, 0)
    vllm = plan(load_recipe("tiny-gpu"), 1).settings.generator
    with pytest.raises(UserError, match="generator.backend vllm needs a GPU; this generator"):
        services.GeneratorConfig(recipe, vllm).build(tokenizer)
    with pytest.raises(
        UserError, match=r"generator.backend: Input should be 'auto', 'vllm' or 'hf'"
    ):
        apply_overrides(recipe, ["generator.backend=tensorrt"])


def test_response_only_logprobs_equal_full_logits_logprobs():
    tokens, mask = _batch()
    trainer = TitanTrainer(SPEC, OptimizerConfig(), temperature=0.7, seed=3)
    with torch.no_grad():
        full = token_logprobs(trainer.model(tokens), tokens, mask, 0.7)
        trainer.model._skip_lm_head = True
        mine = response_logprobs(trainer.model, tokens, mask, 0.7)
    torch.testing.assert_close(mine, full, rtol=0, atol=1e-5)
    assert mine[1].abs().sum() == 0 and mine[0, 15:].abs().sum() == 0


def test_micro_batches_cover_every_row_once():
    tokens = torch.zeros(10, 7, dtype=torch.long)
    parts = micro_batches(tokens, budget=20)  # 2 rows of 7 tokens fit
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert [(p.start, p.stop) for p in micro_batches(tokens, budget=3)][:2] == [(0, 1), (1, 2)]


def test_gpu_trainer_step_matches_the_cpu_trainer():
    """Micro-batches, activation checkpointing and response-only logits change nothing."""
    tokens, mask = _batch(1)
    optim = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
    cpu = TitanTrainer(SPEC, optim, temperature=0.7, seed=1)
    gpu = FSDPTrainer(SPEC, optim, temperature=0.7, seed=1, device="cpu", tokens_per_micro_batch=40)
    old = cpu.logprobs(tokens, mask)
    torch.testing.assert_close(gpu.logprobs(tokens, mask), old, rtol=0, atol=1e-5)
    advantages = torch.linspace(-1, 1, tokens.shape[0])
    noisy_old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    kw = dict(variant="grpo", clip_low=0.2, clip_high=0.28, kl_beta=0.1)
    a = cpu.train_step(tokens, mask, advantages, noisy_old * mask, old, policy_loss, **kw)
    b = gpu.train_step(tokens, mask, advantages, noisy_old * mask, old, policy_loss, **kw)
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "response_tokens", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(
        gpu.logprobs(tokens, mask), cpu.logprobs(tokens, mask), atol=1e-4, rtol=0
    )


def test_gpu_trainer_publishes_hf_names_in_publish_dtype_and_resumes():
    trainer = FSDPTrainer(SPEC, OptimizerConfig(), seed=2, device="cpu")
    published = trainer.hf_state_dict()
    reference = TitanTrainer(SPEC, OptimizerConfig(), seed=2).hf_state_dict()
    assert published.keys() == reference.keys()
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, reference[name].to(torch.bfloat16), rtol=0, atol=0)

    tokens, mask = _batch(2)
    trainer.train_step(tokens, mask, torch.ones(6), None, None, policy_loss)
    resumed = FSDPTrainer(SPEC, OptimizerConfig(), seed=9, device="cpu")
    resumed.load_state_dict(trainer.state_dict())
    assert resumed.step == 1
    torch.testing.assert_close(resumed.logprobs(tokens, mask), trainer.logprobs(tokens, mask))


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_published_layout_is_known_without_gathering(family: str):
    """`hf_layout` gives what `hf_groups` yields (names, shapes, dtype) as meta tensors: a
    version's flat buffer is laid out before any of it is gathered."""
    spec = SPEC
    if family == "llama3":  # q/k rows permuted to HF's rotary layout, an untied head
        spec = dataclasses.replace(SPEC, family="llama3", tie_embeddings=False, norm_eps=1e-5)
    trainer = FSDPTrainer(spec, OptimizerConfig(), seed=2, device="cpu")
    layout = trainer.hf_layout()
    published = trainer.hf_state_dict()
    assert list(layout) == list(published)
    for name, tensor in published.items():
        assert layout[name].device.type == "meta"
        assert (layout[name].shape, layout[name].dtype) == (tensor.shape, tensor.dtype), name


def test_gpu_reference_scores_like_the_cpu_reference():
    tokens, mask = _batch(3)
    mine = GPUReference(
        SPEC, temperature=1.3, seed=4, device="cpu", dtype=torch.float32, tokens_per_micro_batch=30
    )
    theirs = TitanReference(SPEC, temperature=1.3, seed=4)
    torch.testing.assert_close(
        mine.logprobs(tokens, mask), theirs.logprobs(tokens, mask), atol=1e-5, rtol=0
    )


class _Model(torch.nn.Module):
    """What `load_on_worker` uses of vLLM's model: named parameters and `load_weights`,
    here writing each weight into its parameter (`writes=False`: matching names only)."""

    def __init__(self, writes: bool = True) -> None:
        super().__init__()
        self.writes = writes
        norm = torch.nn.Module()
        norm.weight = torch.nn.Parameter(torch.ones(4))
        self.model = torch.nn.ModuleDict({"norm": norm})

    def load_weights(self, weights):
        loaded = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if self.writes:
                params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class _Worker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def test_a_generator_load_is_read_back_and_a_nan_version_named_as_such():
    """The generator reads the probe weight back from the model it runs after each load: a
    load that wrote nothing is one error, a version holding NaN another (NaN never equals
    itself, so it was reported as the first)."""
    from runtime.backends.vllm_worker import load_on_worker

    weights = {"model.norm.weight": torch.full((4,), 2.0)}
    model = _Model()
    assert load_on_worker(_Worker(model), weights) == []
    assert torch.equal(model.model["norm"].weight.detach(), weights["model.norm.weight"])
    with pytest.raises(RuntimeError, match="did not reach the model the engine runs"):
        load_on_worker(_Worker(_Model(writes=False)), weights)
    nan = {"model.norm.weight": torch.tensor([1.0, float("nan"), 1.0, 1.0])}
    with pytest.raises(RuntimeError, match="hold NaN or infinite values"):
        load_on_worker(_Worker(_Model()), nan)
