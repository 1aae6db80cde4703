"""The architecture table against the published model sizes and HF config numbers."""

import pytest

from recipes import UserError, architecture
from recipes.architectures import ARCHITECTURES

# (family, size): (total params, non-embedding params or None) as the model cards state them.
PUBLISHED = {
    ("qwen3", "0.6b"): (0.6e9, 0.44e9),
    ("qwen3", "1.7b"): (1.7e9, 1.4e9),
    ("qwen3", "4b"): (4.0e9, 3.6e9),
    ("qwen3", "8b"): (8.19e9, 6.95e9),
    ("qwen3", "14b"): (14.8e9, 13.2e9),
    ("qwen3", "32b"): (32.8e9, 31.2e9),
    ("llama3", "8b"): (8.03e9, None),
    ("llama3", "1b"): (1.24e9, None),
    ("llama3", "3b"): (3.21e9, None),
}


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_param_counts_match_published_sizes(key):
    arch = architecture(*key)
    total, non_embedding = PUBLISHED[key]
    assert arch.params == pytest.approx(total, rel=0.02)
    if non_embedding is not None:
        embeddings = arch.vocab_size * arch.dim * (1 if arch.tie_embeddings else 2)
        assert arch.params - embeddings == pytest.approx(non_embedding, rel=0.02)


def test_qwen3_shared_numbers():
    for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b"):
        a = architecture("qwen3", size)
        assert (a.vocab_size, a.head_dim, a.n_kv_heads) == (151936, 128, 8)
        assert (a.rope_theta, a.norm_eps, a.rope_scaling) == (1e6, 1e-6, None)
        assert a.tie_embeddings == (size in ("0.6b", "1.7b", "4b"))
        assert a.qk_norm


def test_llama_numbers():
    a = architecture("llama3", "8b")
    assert (a.vocab_size, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim) == (
        128256,
        4096,
        32,
        32,
        8,
        14336,
    )
    assert a.rope_theta == 500000 and not a.tie_embeddings and not a.qk_norm
    assert a.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    one, three = architecture("llama3", "1b"), architecture("llama3", "3b")
    assert (one.dim, one.n_layers, one.n_heads, one.head_dim, one.ffn_dim) == (
        2048,
        16,
        32,
        64,
        8192,
    )
    assert (three.dim, three.n_layers, three.n_heads, three.head_dim) == (3072, 28, 24, 128)
    assert one.tie_embeddings and three.tie_embeddings


def test_tiny_is_small_enough_for_cpu():
    t = architecture("qwen3", "tiny")
    # a full training step (32 groups of 8) must take well under a second on two cores
    assert t.params < 200_000 and t.n_layers <= 2 and t.dim <= 64
    assert (t.ffn_dim, t.max_seq_len, t.tie_embeddings) == (128, 64, True)
    assert t.params < 200_000


def test_every_arch_is_self_consistent():
    for (family, size), a in ARCHITECTURES.items():
        assert (a.family, a.size) == (family, size)
        assert a.n_heads % a.n_kv_heads == 0


def test_unknown_size_names_the_known_ones():
    with pytest.raises(UserError, match=r"unknown qwen3 size '2b'; known sizes: 0.6b, 1.7b"):
        architecture("qwen3", "2b")
