"""Llama 3: complex RoPE with the long-context frequency scaling of 3.1 and later."""

from runtime.models.family import Family
from runtime.models.llama3.model import titan_config
from runtime.models.llama3.state_dict import adapter, hf_config, hf_model

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
