"""Small models for the GPU tests: real Qwen3 layer code, sizes that start in seconds."""

from __future__ import annotations

import gc

import torch

from runtime.models import ModelSpec, build_model

# Qwen3-1.7B's layer shape and vocabulary, 2 of its 28 layers: the trainer's real memory path.
QWEN3_1P7B_2_LAYERS = ModelSpec(
    family="qwen3",
    vocab_size=151936,
    dim=2048,
    n_layers=2,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    ffn_dim=6144,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    max_seq_len=4096,
    tie_embeddings=True,
)

# A 4-layer Qwen3 with a small vocabulary: vLLM builds and compiles it quickly.
SMALL = ModelSpec(
    family="qwen3",
    vocab_size=4096,
    dim=512,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=64,
    ffn_dim=1536,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    max_seq_len=1024,
    tie_embeddings=True,
)


def peaked_weights(
    spec: ModelSpec, seed: int, device: str = "cuda", logit_std: float = 3.0
) -> dict[str, torch.Tensor]:
    """TorchTitan-named fp32 weights whose next-token distributions are moderately peaked.

    TorchTitan's init (std 0.02) gives near-uniform outputs, where every log-prob is about
    -log(vocab) and any two implementations agree trivially. Scaling the tied embeddings up
    instead makes the residual stream the current token's embedding, whose logit (its squared
    norm) beats every other by tens of nats: each sequence repeats its last token with p = 1,
    whatever the weights, and every check passes vacuously. So the layers and embeddings keep
    their init (the layers' outputs dominate the residual stream, so context matters) and the
    final norm gets random weights (random signs: no token, the current one included, is
    favoured) scaled for logits of std `logit_std`. With 3.0 on `SMALL`, the entropy at
    temperature 0.7 spans ~0.3-4.5 nats (mean ~2.7) and the argmax varies with the context.
    """
    model = build_model(spec, device=device, seed=seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if spec.tie_embeddings and "lm_head.weight" in state:
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    projection = state.get("lm_head.weight", state["tok_embeddings.weight"])
    # logit_j = sum_k g_k n_k w_jk with n the unit-RMS normalised state: std ~ |g| std(w).
    scale = logit_std / (spec.dim**0.5 * float(projection.std()))
    g = torch.Generator(device=device).manual_seed(seed + 1)
    state["norm.weight"] = torch.randn(spec.dim, generator=g, device=device) * scale
    return state


def random_prompts(count: int, vocab: int, seed: int, low: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (count,), generator=g).tolist()
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def free_gpu_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
