"""Qwen3 on the Hugging Face side: weight names (TorchTitan's adapter), config and model class."""

from __future__ import annotations

from typing import Any


def adapter(config: Any) -> Any:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, None)


def hf_config(common: dict[str, Any], spec: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def hf_model() -> type:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM
