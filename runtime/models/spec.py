"""The architecture of a policy model, as plain numbers shared by every backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from recipes.names import FAMILIES
from runtime.models.families import family

Family = str  # one of recipes.names.FAMILIES

_FIELDS = (
    "family",
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "rope_theta",
    "norm_eps",
    "max_seq_len",
    "tie_embeddings",
    "rope_scaling",
)


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shape; the same numbers build the TorchTitan and the HF model.

    `rope_scaling` (llama3 only) uses Hugging Face's keys: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings.
    """

    family: Family
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"unknown model family {self.family!r} (expected {' or '.join(FAMILIES)})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.rope_scaling is not None and not family(self.family).rope_scaling:
            raise ValueError(f"the {self.family} family has no rope_scaling")

    @classmethod
    def from_arch(cls, arch: Any, family: str | None = None) -> ModelSpec:
        """Build from any object with the same field names (recipes' `Arch`, a dict, ...).

        `family` overrides or supplies the family when the object does not carry one.
        """

        def get(name: str, default: Any = None) -> Any:
            if isinstance(arch, dict):
                return arch.get(name, default)
            return getattr(arch, name, default)

        values = {name: get(name) for name in _FIELDS}
        if family is not None:
            values["family"] = family
        missing = [n for n in _FIELDS if values[n] is None and n != "rope_scaling"]
        if missing:
            raise ValueError(f"architecture is missing {', '.join(missing)}")
        if values["rope_scaling"] is not None:
            values["rope_scaling"] = dict(values["rope_scaling"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        attn = self.dim * self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        attn += self.n_heads * self.head_dim * self.dim
        if family(self.family).qk_norm:
            attn += 2 * self.head_dim  # q_norm, k_norm
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + self.dim
