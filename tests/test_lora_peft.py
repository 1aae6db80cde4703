"""LoRA: TorchTitan's converter on forgesky's decoder against PEFT on the transformers model of
the same architecture (real HF models, real PEFT, real TorchTitan; fp32 on the CPU)."""

from __future__ import annotations

import pytest
import torch

from recipes.run_sections import Lora
from runtime.backends.base import token_logprobs
from runtime.models import ModelSpec, build_hf_model, from_hf
from runtime.models.loading import GivenWeights, load_into
from runtime.models.lora import (
    adapter_state,
    check_converted,
    converter,
    peft_state,
    titan_state,
)
from runtime.models.titan import materialize, meta_model, titan_config

SHAPE = dict(
    vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
    rope_theta=10000.0, norm_eps=1e-6, max_seq_len=64,
)  # fmt: skip
SPECS = {
    "qwen3": ModelSpec(family="qwen3", tie_embeddings=True, **SHAPE),
    "llama3": ModelSpec(
        family="llama3",
        tie_embeddings=False,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **SHAPE,
    ),
}
TARGETS = {"all-linear": "all-linear", "q_v": ["q_proj", "v_proj"]}


def _pair(family: str, targets):
    """(PEFT model with random A and B, our model from the same base and adapter, lora)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    spec = SPECS[family]
    torch.manual_seed(0)
    hf = build_hf_model(spec)
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    peft = get_peft_model(
        hf,
        LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, init_lora_weights=False
        ),
    )
    lora = Lora(rank=8, alpha=16, targets=targets)
    adapter = get_peft_model_state_dict(peft)
    ours = materialize(meta_model(spec, lora=lora), "cpu")
    load_into(ours, GivenWeights(from_hf(base, spec) | titan_state(adapter, family, lora, spec)))
    return peft, ours, lora, adapter


def _batch(spec: ModelSpec):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (3, 20), generator=generator)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    mask[:, 8:] = True
    mask[1, 15:] = False  # a shorter response
    return tokens, mask


@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("family", list(SPECS))
def test_logits_and_adapter_gradients_equal_peft(family: str, targets: str):
    spec = SPECS[family]
    peft, ours, lora, _ = _pair(family, TARGETS[targets])
    tokens, mask = _batch(spec)
    theirs_logits = peft(input_ids=tokens).logits
    our_logits = ours(tokens)
    torch.testing.assert_close(our_logits, theirs_logits, atol=1e-5, rtol=1e-5)

    token_logprobs(theirs_logits, tokens, mask).sum().backward()
    token_logprobs(our_logits, tokens, mask).sum().backward()
    theirs = {
        n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if p.requires_grad
    }
    mine = peft_state({n: p.grad for n, p in adapter_state(ours).items()}, family, lora, spec)
    assert mine.keys() == theirs.keys()
    assert len(mine) == 2 * spec.n_layers * len(lora.modules)
    for name, grad in theirs.items():
        torch.testing.assert_close(mine[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    adapter = adapter_state(ours)
    for name, param in ours.named_parameters():
        if name not in adapter:
            assert not param.requires_grad and param.grad is None, name


@pytest.mark.parametrize("family", list(SPECS))
def test_peft_and_titan_names_round_trip(family: str):
    spec = SPECS[family]
    _, ours, lora, adapter = _pair(family, "all-linear")
    titan = titan_state(adapter, family, lora, spec)
    for name, tensor in peft_state(titan, family, lora, spec).items():
        assert torch.equal(tensor, adapter[name]), name
    mine = {n: p.detach() for n, p in adapter_state(ours).items()}
    for name, tensor in titan_state(
        peft_state(mine, family, lora, spec), family, lora, spec
    ).items():
        assert torch.equal(tensor, mine[name]), name
    # llama3's q and k rows of B are reordered between the sides, qwen3's are not
    ours_b = titan["layers.0.attention.qkv_linear.wq.lora_b.weight"]
    peft_b = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(ours_b, peft_b) == (family == "qwen3")


def test_names_and_shapes_outside_the_adapter_are_refused():
    spec = SPECS["qwen3"]
    lora = Lora(rank=8, targets=["q_proj", "v_proj"])
    k_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    with pytest.raises(KeyError, match="k_proj"):
        titan_state({k_a: torch.zeros(8, 64)}, "qwen3", lora, spec)
    q_a = "layers.0.attention.qkv_linear.wq.lora_a.weight"
    with pytest.raises(ValueError, match="shape"):
        peft_state({q_a: torch.zeros(4, 64)}, "qwen3", lora, spec)


def test_v_proj_alone_wraps_only_wv():
    spec = SPECS["llama3"]
    model = meta_model(spec, lora=Lora(rank=4, targets=["v_proj"]))
    wrapped = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_a"))
    assert wrapped == [f"layers.{i}.attention.qkv_linear.wv" for i in range(spec.n_layers)]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * spec.n_layers
    assert all(".wv.lora_" in n for n in trainable)


def test_a_target_matching_nothing_fails_the_check():
    spec = SPECS["qwen3"]
    lora = Lora(rank=4, targets=["q_proj", "o_proj"])
    # the fused projection has no `wq` for the converter to match: only wo gets an adapter
    with torch.device("meta"):
        model = converter(lora).convert(titan_config(spec)).build()
    with pytest.raises(RuntimeError, match=r"not wrapped: \['layers.0.attention.qkv_linear.wq"):
        check_converted(model, spec, lora)
