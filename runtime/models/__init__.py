"""Policy models: a `ModelSpec`, the TorchTitan model it builds, and its HF weight format.

Names load on first use (a generator proc needs the HF side, not TorchTitan's model code).
"""

from __future__ import annotations

import importlib
from typing import Any

# First: lets torchtitan import on torch 2.11 (GPU nodes); see runtime/compat/torchtitan.py.
from runtime.compat import torchtitan as _torchtitan_compat  # noqa: F401  (isort: first)

_WHERE = {
    "ModelSpec": "runtime.models.spec",
    "build_hf_model": "runtime.models.hf",
    "from_hf": "runtime.models.hf",
    "hf_config": "runtime.models.hf",
    "to_hf": "runtime.models.hf",
    "load_hf_state_dict": "runtime.models.loading",
    "load_pretrained": "runtime.models.loading",
    "build_model": "runtime.models.titan",
    "materialize": "runtime.models.titan",
    "meta_model": "runtime.models.titan",
    "WeightSource": "runtime.models.loading",
    "load_into": "runtime.models.loading",
    "weight_source": "runtime.models.loading",
    "titan_config": "runtime.models.titan",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
