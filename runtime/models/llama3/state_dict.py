"""Llama 3 on the Hugging Face side: weight names (TorchTitan's adapter permutes the q/k rows to
HF's rotary layout), config with its RoPE scaling, and model class."""

from __future__ import annotations

from typing import Any


def adapter(config: Any) -> Any:
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(config, None)


def hf_config(common: dict[str, Any], spec: Any) -> Any:
    from transformers import LlamaConfig

    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        common = {
            **common,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": float(spec.rope_theta),
                "factor": float(s["factor"]),
                "low_freq_factor": float(s.get("low_freq_factor", 1.0)),
                "high_freq_factor": float(s.get("high_freq_factor", 4.0)),
                "original_max_position_embeddings": int(
                    s.get("original_max_position_embeddings", 8192)
                ),
            },
        }
    return LlamaConfig(**common)


def hf_model() -> type:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM
