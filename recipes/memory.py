"""Per-GPU memory estimate for each service, in GB (1e9 bytes).

A deliberately simple model, used to reject layouts that cannot fit before paying for GPUs:

- trainer: 16 bytes per parameter (fp32 master weights 4 + fp32 gradients 4 + AdamW moments 8),
  sharded over fsdp x tp GPUs; plus activations under full activation checkpointing, counted as
  n_layers x tokens x dim x 2 bytes (one bf16 layer input kept per layer) for one microbatch of
  one sequence of max_prompt_tokens + max_response_tokens tokens, plus that sequence's fp32
  logits (tokens x vocab x 4); plus a fixed 3 GB for the CUDA context, NCCL buffers and
  allocator fragmentation.
- generator: bf16 weights (2 bytes per parameter) split over its TP group; plus a KV-cache
  reserve big enough to hold one call's rollouts at once (prompts_per_step x group_size x
  steps_per_call sequences of max_prompt_tokens + max_response_tokens tokens, 2 x n_layers x
  n_kv_heads x head_dim bf16 values per token) spread over the replicas and split over TP, and
  never less than one full group (a replica must hold all samples of one prompt); plus 3 GB.
- reference: bf16 weights split over its TP group, the trainer's activation and logits term
  (it scores the same sequences, forward only), plus 3 GB.

The accelerators hold 80 GB (H100) and 141 GB (H200); a CPU recipe is not checked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from recipes.architectures import architecture

if TYPE_CHECKING:
    from recipes.schema import Recipe

GB = 1e9
RUNTIME_OVERHEAD_GB = 3.0
ACCELERATOR_GB: dict[str, float] = {"H100": 80.0, "H200": 141.0}


def estimate_memory(
    recipe: Recipe,
    generator_replicas: int | None = None,
    trainer_fsdp: int | None = None,
) -> dict[str, float]:
    """GB per GPU for "generator", "trainer" and (if enabled) "reference".

    `generator_replicas` and `trainer_fsdp` default to the recipe's layout; the planner passes
    the grown values when it hands out extra GPUs.
    """
    arch = architecture(recipe.model.family, recipe.model.size)
    layout, grpo = recipe.layout, recipe.grpo
    replicas = generator_replicas or layout.generator.replicas
    fsdp = trainer_fsdp or layout.trainer.resolved_fsdp
    seq = grpo.max_prompt_tokens + grpo.max_response_tokens

    activations = arch.n_layers * seq * arch.dim * 2 + seq * arch.vocab_size * 4
    trainer = 16 * arch.params / (fsdp * layout.trainer.tp) + activations

    step_sequences = grpo.prompts_per_step * grpo.group_size * grpo.steps_per_call
    kv_sequences = max(math.ceil(step_sequences / replicas), grpo.group_size)
    kv_cache = kv_sequences * seq * arch.kv_bytes_per_token
    generator = (2 * arch.params + kv_cache) / layout.generator.tp

    memory = {"generator": generator, "trainer": trainer}
    if layout.reference.enabled:
        memory["reference"] = 2 * arch.params / layout.reference.tp + activations
    return {k: round(v / GB + RUNTIME_OVERHEAD_GB, 1) for k, v in sorted(memory.items())}


def memory_errors(recipe: Recipe, memory: dict[str, float]) -> list[str]:
    """One message per (accelerator, service) whose estimate does not fit; [] on CPU."""
    res = recipe.resources
    if res.accelerator == "cpu":
        return []
    errors = []
    for where, accel in [("resources.accelerator", res.accelerator)] + [
        (f"resources.alternatives.{i}", a) for i, a in enumerate(res.alternatives)
    ]:
        capacity = ACCELERATOR_GB[accel]
        for service, need in memory.items():
            if need > capacity:
                errors.append(
                    f"{where}: {service} needs ~{need:.0f} GB per GPU but {accel} has "
                    f"{capacity:.0f} GB; {_remedy(service)}"
                )
    return errors


def _remedy(service: str) -> str:
    return {
        "trainer": "raise layout.trainer.gpus (more FSDP shards) or layout.trainer.tp",
        "generator": "raise layout.generator.tp or replicas, or lower grpo.prompts_per_step",
        "reference": "raise layout.reference.tp",
    }[service]
