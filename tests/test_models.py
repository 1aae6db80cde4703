"""TorchTitan models built from a ModelSpec, and their HF weight format."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

from recipes.architectures import ARCHITECTURES, architecture
from recipes.errors import UserError
from runtime.models import (
    ModelSpec,
    build_hf_model,
    build_model,
    from_hf,
    hf_config,
    load_hf_state_dict,
    load_pretrained,
    titan_config,
    to_hf,
)

QWEN = ModelSpec(
    family="qwen3",
    vocab_size=48,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=24,  # deliberately not dim / n_heads
    ffn_dim=96,
    rope_theta=10000.0,
    norm_eps=1e-6,
    max_seq_len=64,
    tie_embeddings=True,
)
# Long-context scaling with a short original window, so scaled frequencies matter at T=40.
LLAMA = dataclasses.replace(
    QWEN,
    family="llama3",
    head_dim=16,
    norm_eps=1e-5,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
SPECS = {
    "qwen3-tied": QWEN,
    "qwen3-untied": dataclasses.replace(QWEN, tie_embeddings=False),
    "llama3-tied": LLAMA,
    "llama3-untied-plain-rope": dataclasses.replace(LLAMA, tie_embeddings=False, rope_scaling=None),
}


def _tokens(spec: ModelSpec, batch: int = 3, length: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, length), generator=g)


def test_titan_model_trains_on_cpu_with_causal_sdpa():
    model = build_model(QWEN, seed=0)
    tokens = _tokens(QWEN)
    logits = model(tokens)
    assert logits.shape == (3, 40, QWEN.vocab_size)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, QWEN.vocab_size), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name

    # Causal: a later token cannot change earlier logits, so right padding is harmless.
    changed = tokens.clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % QWEN.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :30], after[:, :30])
    assert not torch.allclose(before[:, 30:], after[:, 30:])


def test_build_model_is_deterministic_in_seed():
    a = build_model(QWEN, seed=3).state_dict()
    b = build_model(QWEN, seed=3).state_dict()
    c = build_model(QWEN, seed=4).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key])
    assert any(not torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))


def test_build_model_casts_parameters_only():
    model = build_model(LLAMA, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(_tokens(LLAMA)).dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(SPECS))
def test_to_hf_gives_identical_logits_in_transformers(name):
    spec = SPECS[name]
    model = build_model(spec, seed=1)
    hf = build_hf_model(spec)
    assert isinstance(hf, Qwen3ForCausalLM if spec.family == "qwen3" else LlamaForCausalLM)
    hf_state = to_hf(model.state_dict(), spec)
    assert all(k.startswith(("model.", "lm_head.")) for k in hf_state)
    assert ("lm_head.weight" in hf_state) != spec.tie_embeddings
    result = hf.load_state_dict(hf_state, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if spec.tie_embeddings else [])
    tokens = _tokens(spec)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SPECS))
def test_from_hf_round_trip(name):
    spec = SPECS[name]
    source = build_model(spec, seed=1)
    back = from_hf(to_hf(source.state_dict(), spec), spec)
    target = build_model(spec, seed=2)
    target.load_state_dict(back, strict=True)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value, atol=0, rtol=0)


def _save_hf_checkpoint(spec: ModelSpec, folder, seed: int = 5, max_shard_size=None):
    torch.manual_seed(seed)
    hf = build_hf_model(spec)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(folder, safe_serialization=True, **kwargs)
    return hf


@pytest.mark.parametrize("name", ["qwen3-tied", "llama3-untied-plain-rope"])
def test_load_pretrained_from_a_saved_hf_folder(tmp_path, name):
    spec = SPECS[name]
    hf = _save_hf_checkpoint(spec, tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # the sharded path is exercised

    model = build_model(spec, seed=0)
    model.load_state_dict(load_pretrained(str(tmp_path), spec), strict=True)
    tokens = _tokens(spec)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, atol=1e-5, rtol=0)

    hf_state = load_hf_state_dict(str(tmp_path))
    for key, value in hf.state_dict().items():
        if key == "lm_head.weight" and spec.tie_embeddings:
            continue
        torch.testing.assert_close(hf_state[key], value, atol=0, rtol=0)


def test_load_pretrained_rejects_a_checkpoint_of_another_size(tmp_path):
    _save_hf_checkpoint(QWEN, tmp_path)
    wrong = dataclasses.replace(QWEN, n_layers=3)
    with pytest.raises(UserError, match="num_hidden_layers=2"):
        load_pretrained(str(tmp_path), wrong)


def test_load_pretrained_names_a_folder_without_weights(tmp_path):
    hf_config(QWEN).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="no \\*.safetensors"):
        load_pretrained(str(tmp_path), QWEN)


@pytest.mark.parametrize("key", sorted(ARCHITECTURES, key=str))
def test_every_catalog_architecture_builds_with_its_parameter_count(key):
    arch = ARCHITECTURES[key]
    spec = ModelSpec.from_arch(arch)
    with torch.device("meta"):
        model = titan_config(spec).build()
    assert sum(p.numel() for p in model.parameters()) == arch.params == spec.num_params()
    config = hf_config(spec)
    assert (config.num_hidden_layers, config.head_dim) == (arch.n_layers, arch.head_dim)


def test_from_arch_accepts_a_mapping_and_names_what_is_missing():
    tiny = architecture("qwen3", "tiny")
    assert ModelSpec.from_arch(dataclasses.asdict(tiny)) == ModelSpec.from_arch(tiny)
    partial = dataclasses.asdict(tiny)
    del partial["ffn_dim"]
    with pytest.raises(ValueError, match="ffn_dim"):
        ModelSpec.from_arch(partial)
