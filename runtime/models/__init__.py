"""Policy models: a `ModelSpec`, the TorchTitan model it builds, and its HF weight format."""

# First: lets torchtitan import on torch 2.11 (GPU nodes); see runtime/compat/torchtitan.py.
from runtime.compat import torchtitan as _torchtitan_compat  # noqa: F401  (isort: first)
from runtime.models.hf import build_hf_model, from_hf, hf_config, to_hf
from runtime.models.loading import load_hf_state_dict, load_pretrained
from runtime.models.spec import ModelSpec
from runtime.models.titan import build_model, titan_config

__all__ = [
    "ModelSpec",
    "build_hf_model",
    "build_model",
    "from_hf",
    "hf_config",
    "load_hf_state_dict",
    "load_pretrained",
    "titan_config",
    "to_hf",
]
