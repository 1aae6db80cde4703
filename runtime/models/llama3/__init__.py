"""Llama 3: complex RoPE with the long-context frequency scaling of 3.1 and later."""

from typing import Any

from runtime.models.family import Family
from runtime.models.llama3.state_dict import adapter, hf_config, hf_model


def titan_config(spec: Any, attention: str = "sdpa", fuse_qkv: bool = True) -> Any:
    # TorchTitan's model code only where a TorchTitan model is built (not in generator procs).
    from runtime.models.llama3.model import titan_config

    return titan_config(spec, attention, fuse_qkv)


FAMILY = Family(
    name="llama3",
    titan_config=titan_config,
    adapter=adapter,
    hf_config=hf_config,
    hf_model=hf_model,
    hf_architecture="LlamaForCausalLM",
    qk_norm=False,
    rope_scaling=True,
)
