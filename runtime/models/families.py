"""The model families the runtime builds, by name (recipes.names.FAMILIES)."""

from __future__ import annotations

from recipes.names import FAMILIES
from runtime.models.family import Family


def family(name: str) -> Family:
    """The family `name` (one of recipes.names.FAMILIES)."""
    if name == "qwen3":
        from runtime.models.qwen3 import FAMILY
    elif name == "llama3":
        from runtime.models.llama3 import FAMILY
    else:
        raise ValueError(f"unknown model family {name!r} (expected {' or '.join(FAMILIES)})")
    return FAMILY
