"""Hugging Face side of a model: its config, and weight names converted by TorchTitan's adapters.

HF parameter names are the wire format of weights between trainer, store and generator.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.models.families import family
from runtime.models.spec import ModelSpec


def _adapter(spec: ModelSpec) -> Any:
    # The adapters read only shapes, tying and the RoPE flavour from the config, never the
    # attention backend, so an SDPA config serves every variant (a full model's: no LoRA).
    fam = family(spec.family)
    return fam.adapter(fam.titan_config(spec, "sdpa"))


def to_hf(state_dict: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """TorchTitan parameter names → HF names (llama3 q/k rows permuted to HF's rotary layout)."""
    return _adapter(spec).to_hf(dict(state_dict))


def from_hf(hf_state_dict: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF parameter names → TorchTitan names; a tied checkpoint without lm_head is filled in."""
    return _adapter(spec).from_hf(dict(hf_state_dict))


def from_hf_part(hf_part: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """`from_hf` of part of a checkpoint (one block, or the tensors outside the blocks).

    The adapters expect a whole checkpoint: for a tied model they fill `lm_head` in from the
    embedding, and refuse a dict with neither. A part without the embedding gets a placeholder
    `lm_head` (a meta tensor) that is dropped again.
    """
    part = dict(hf_part)
    placeholder = spec.tie_embeddings and not any(
        k in part for k in ("lm_head.weight", "model.embed_tokens.weight")
    )
    if placeholder:
        part["lm_head.weight"] = torch.empty(0, device="meta")
    out = _adapter(spec).from_hf(part)
    if placeholder:
        out.pop("lm_head.weight", None)
    return out


def hf_config(spec: ModelSpec, **token_ids: Any) -> Any:
    """The transformers config of the same architecture (`Qwen3Config`, `LlamaConfig`, ...),
    with `architectures` set. `token_ids` may set pad_token_id, bos_token_id, eos_token_id."""
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.dim,
        intermediate_size=spec.ffn_dim,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_seq_len,
        rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        attention_bias=False,
        **token_ids,
    )
    fam = family(spec.family)
    config = fam.hf_config(common, spec)
    config.architectures = [fam.hf_architecture]
    return config


def build_hf_model(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **token_ids: Any,
) -> torch.nn.Module:
    """An HF causal LM of this architecture (random weights; load real ones with load_state_dict).

    Uses the eager/SDPA attention that runs everywhere; weights are HF-named.
    """
    config = hf_config(spec, **token_ids)
    config._attn_implementation = "sdpa"
    model = family(spec.family).hf_model()(config).to(device=device, dtype=dtype)
    model.eval()
    return model
