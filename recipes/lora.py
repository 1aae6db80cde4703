"""A LoRA adapter's size, from the architecture and the recipe's `model.lora`: what the memory
model, the planned settings, the cost model and the plan's words count instead of the whole
model where only the adapter trains, moves and is saved.

Torch-free, like the rest of recipes/: the runtime builds the adapter (runtime/models/lora.py),
this only counts it.
"""

from __future__ import annotations

from typing import Any

# The ranks vLLM's engine takes as max_lora_rank (vLLM 0.24, `MaxLoRARanks`): it sizes its
# adapter slots by this, so a recipe's rank is served by the smallest one at least as large.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters a vLLM engine holds at once: the version being sampled and the next one, loaded
# while requests of the old one finish.
VLLM_MAX_LORAS = 2


def projection_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection LoRA may wrap, by Hugging Face name, in one block."""
    d, hd = arch.dim, arch.head_dim
    q, kv = arch.n_heads * hd, arch.n_kv_heads * hd
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, arch.ffn_dim),
        "up_proj": (d, arch.ffn_dim),
        "down_proj": (arch.ffn_dim, d),
    }


def adapter_params(arch: Any, lora: Any) -> int:
    """Parameters of the adapter: rank x (in + out) for each targeted projection (A is rank x
    in, B out x rank), in every block."""
    shapes = projection_shapes(arch)
    per_block = sum(lora.rank * sum(shapes[name]) for name in lora.modules)
    return arch.n_layers * per_block


def adapter_bytes(arch: Any, lora: Any, bytes_per_param: int = 2) -> int:
    """Bytes of the adapter at `bytes_per_param` (2: bf16, as a version goes to generators)."""
    return bytes_per_param * adapter_params(arch, lora)


def max_lora_rank(rank: int) -> int | None:
    """vLLM's max_lora_rank for an adapter of `rank`: the smallest rank it allows that is at
    least that; None above the largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def slot_bytes(arch: Any, rank: int) -> int:
    """Bytes vLLM reserves on each generator GPU for its LoRA slots: VLLM_MAX_LORAS adapters of
    `rank` on every linear, in bf16 (it sizes them for all-linear whatever the adapter wraps),
    before tensor parallelism."""
    shapes = projection_shapes(arch)
    per_block = sum(rank * (i + o) for i, o in shapes.values())
    return VLLM_MAX_LORAS * 2 * arch.n_layers * per_block


def targets_words(lora: Any) -> str:
    """The targeted projections as `model.lora.targets` takes them: "all-linear (q_proj, ...,
    down_proj)", or the names listed."""
    names = ", ".join(lora.modules)
    return f"{lora.targets} ({names})" if isinstance(lora.targets, str) else names
