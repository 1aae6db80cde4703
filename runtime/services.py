"""From a recipe to the parts every service builds: model shape, tokenizer, first weights, device.

Each actor calls these in its own proc, so the controller ships only the (small, picklable) recipe.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from recipes import UserError, architecture
from runtime.models import ModelSpec, load_pretrained


def model_spec(recipe: Any) -> ModelSpec:
    """The model shape the recipe names (recipes/architectures.py is its one source)."""
    arch = architecture(recipe.model.family, recipe.model.size)
    return ModelSpec.from_arch(arch, family=recipe.model.family)


def device() -> torch.device:
    """This proc's device: its (pinned) GPU when it has one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtype(recipe: Any) -> torch.dtype:
    """bf16 where the recipe asks for it and a GPU runs it; CPU math stays in float32."""
    if recipe.model.dtype == "bfloat16" and device().type == "cuda":
        return torch.bfloat16
    return torch.float32


def hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def load_tokenizer(recipe: Any) -> Any:
    """The recipe's tokenizer: a shipped one (`builtin:<task>`) or one from the Hub."""
    name = recipe.model.tokenizer or recipe.model.hf_id
    if name.startswith("builtin:"):
        task = name.removeprefix("builtin:")
        try:
            module = importlib.import_module(f"runtime.{task}")
        except ModuleNotFoundError:
            raise UserError(f"model.tokenizer {name!r}: no shipped task named {task!r}") from None
        return module.tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, token=hf_token())


def initial_weights(recipe: Any, spec: ModelSpec) -> dict[str, torch.Tensor] | None:
    """TorchTitan-named pretrained weights, or None for a seeded random init (`init: random`)."""
    if recipe.model.init == "random":
        return None
    return load_pretrained(recipe.model.hf_id, spec, token=hf_token())


def eos_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer)[0]
