"""What a model family is to the runtime: how its blocks are built, how its weights are named on
the Hugging Face side, and which transformers classes load them. One `Family` per folder
(runtime/models/<family>/); `family(name)` finds it.

Adding a family: its architecture sizes in recipes/architectures.py, its name in
recipes/names.FAMILIES, and a folder here with `model.py` (TorchTitan blocks and RoPE) and
`state_dict.py` (HF names and config), and its entry in runtime/models/families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One model family.

    - `titan_config(spec, inner_attention, fuse_qkv=True)`: the TorchTitan decoder config of a
      `ModelSpec` (q, k and v in one projection, or, for LoRA, in three).
    - `adapter(titan_config)`: its TorchTitan <-> HF state-dict adapter.
    - `hf_config(common, spec)`: the transformers config from the keyword arguments every
      family shares (`common`), plus what is the family's own (RoPE scaling).
    - `hf_model`: the transformers causal-LM class; `hf_architecture` its name in config.json
      (what vLLM reads).
    - `qk_norm`: whether attention normalises queries and keys per head (parameter counts).
    """

    name: str
    titan_config: Callable[..., Any]
    adapter: Callable[[Any], Any]
    hf_config: Callable[[dict[str, Any], Any], Any]
    hf_model: Callable[[], type]
    hf_architecture: str
    qk_norm: bool
    rope_scaling: bool = False
