"""Named model sizes: the numbers from each model's Hugging Face `config.json`.

The schema validates tensor-parallel sizes against these, the memory model sizes services with
them, and the runtime builds TorchTitan models from them, so they live in one table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recipes.errors import UserError

QWEN3_VOCAB = 151936
LLAMA3_VOCAB = 128256


@dataclass(frozen=True)
class Arch:
    """One decoder-only transformer: GQA attention, SwiGLU MLP, RMSNorm, RoPE."""

    family: str
    size: str
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
    # HF `rope_scaling` (llama3 long-context frequency scaling); None means plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises queries and keys per head before RoPE; Llama 3 does not."""
        return self.family == "qwen3"

    @property
    def params(self) -> int:
        """Parameter count, counting a tied embedding once (as the model cards do)."""
        d, hd = self.dim, self.head_dim
        attention = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        if self.qk_norm:
            attention += 2 * hd
        mlp = 3 * d * self.ffn_dim
        layer = attention + mlp + 2 * d  # two RMSNorm weights per block
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embeddings + d  # final norm

    @property
    def shapes(self) -> tuple[Any, ...]:
        """What fixes every parameter's shape: architectures with equal `shapes` take each
        other's weights (a checkpoint resumes, a model folder loads)."""
        fields = (self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads)
        return (*fields, self.head_dim, self.ffn_dim, self.tie_embeddings, self.qk_norm)

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 KV-cache bytes one token occupies across all layers (keys and values)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 2


def _qwen3(size: str, dim: int, n_layers: int, n_heads: int, ffn_dim: int, tied: bool) -> Arch:
    return Arch(
        family="qwen3",
        size=size,
        vocab_size=QWEN3_VOCAB,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        max_seq_len=40960,
        tie_embeddings=tied,
    )


def _llama3(
    size: str, dim: int, n_layers: int, n_heads: int, head_dim: int, ffn_dim: int, tied: bool,
    rope_factor: float,
) -> Arch:  # fmt: skip
    return Arch(
        family="llama3",
        size=size,
        vocab_size=LLAMA3_VOCAB,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        max_seq_len=131072,
        tie_embeddings=tied,
        rope_scaling={
            "rope_type": "llama3",
            "factor": rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


# Small enough to train on two CPU cores in seconds. The vocabulary is exactly the tiny task's
# tokenizer (<pad>, <bos>, <eos>, ten digits and <unk> for any other character): with spare ids
# a random policy spends its probability on tokens the task never uses and learns about half as
# fast (64 ids against 13; the one <unk> costs nothing measurable: bench/tiny_learning.py).
TINY = Arch(
    family="qwen3",
    size="tiny",
    vocab_size=14,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    max_seq_len=64,
    tie_embeddings=True,
)

# The tiny task on GPUs: shapes vLLM's attention kernels take (head_dim 64), still small enough
# to learn the task from scratch in a couple of minutes.
TINY_GPU = Arch(
    family="qwen3",
    size="tiny-gpu",
    vocab_size=14,
    dim=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=768,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    max_seq_len=64,
    tie_embeddings=True,
)

# The tiny model for the tiny-tools task: the same shape, the vocabulary of that task's tokenizer
# (its characters, chat markers and whole lookup calls: runtime/tasks/tiny_tools).
TINY_TOOLS = dataclasses.replace(TINY, size="tiny-tools", vocab_size=27)

ARCHITECTURES: dict[tuple[str, str], Arch] = {
    (a.family, a.size): a
    for a in (
        _qwen3("0.6b", dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tied=True),
        _qwen3("1.7b", dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tied=True),
        _qwen3("4b", dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tied=True),
        _qwen3("8b", dim=4096, n_layers=36, n_heads=32, ffn_dim=12288, tied=False),
        _qwen3("14b", dim=5120, n_layers=40, n_heads=40, ffn_dim=17408, tied=False),
        _qwen3("32b", dim=5120, n_layers=64, n_heads=64, ffn_dim=25600, tied=False),
        _llama3("1b", 2048, 16, 32, head_dim=64, ffn_dim=8192, tied=True, rope_factor=32.0),
        _llama3("3b", 3072, 28, 24, head_dim=128, ffn_dim=8192, tied=True, rope_factor=32.0),
        _llama3("8b", 4096, 32, 32, head_dim=128, ffn_dim=14336, tied=False, rope_factor=8.0),
        TINY,
        TINY_GPU,
        TINY_TOOLS,
    )
}


def sizes(family: str) -> list[str]:
    """The sizes known for `family`, in table order."""
    return [size for fam, size in ARCHITECTURES if fam == family]


def architecture(family: str, size: str) -> Arch:
    """The architecture named by `family` and `size` (e.g. "qwen3", "8b")."""
    try:
        return ARCHITECTURES[(family, size)]
    except KeyError:
        known = ", ".join(sizes(family)) or "none"
        raise UserError(f"unknown {family} size '{size}'; known sizes: {known}") from None


def same_shapes(recorded: Mapping[str, Any], family: str, size: str) -> bool:
    """Whether the model a run recorded (its config.json's `model`: family, size) has the
    parameter shapes of `family` `size`; True where the recorded one is not a known
    architecture (nothing to compare: loading the weights says what does not fit)."""
    old_family, old_size = recorded.get("family"), recorded.get("size")
    if (old_family, old_size) == (family, size):
        return True
    try:
        old = architecture(str(old_family), str(old_size))
    except UserError:
        return True
    return old.shapes == architecture(family, size).shapes


class ModelRecipe:
    """What every recipe kind (GRPO's recipes.schema.Recipe, SFT's recipes.sft.SftRecipe) derives
    from its `model` and `resources` sections."""

    @property
    def arch(self) -> Arch:
        """The architecture the model family and size name."""
        return architecture(self.model.family, self.model.size)  # type: ignore[attr-defined]

    @property
    def cpu(self) -> bool:
        return self.resources.accelerator == "cpu"  # type: ignore[attr-defined]
