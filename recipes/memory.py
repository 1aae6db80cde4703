"""Per-GPU memory estimate for each service, in GB (1e9 bytes).

A deliberately simple model, used to reject layouts that cannot fit before paying for GPUs:

- trainer: 16 bytes per parameter (fp32 master weights 4 + fp32 gradients 4 + AdamW moments 8),
  sharded over its GPUs (FSDP; built on meta and filled a block at a time, so start-up adds one
  tensor, not a copy of the model); with the push weight path also the flat bf16 buffer of a
  version on rank 0 (2 bytes per parameter, added by the planner, which plans the store path,
  streamed a block at a time, where that buffer does not fit); plus activations under full
  activation checkpointing, counted as
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

A LoRA run (`model.lora`) trains an adapter of A parameters (recipes/lora.py) on a frozen base:
the trainer holds the base in bf16 (2 bytes a parameter, sharded; on one rank the embedding stays
float32, 2 x vocab x dim more) and 16 bytes an adapter parameter (float32 weights, gradients and
AdamW moments, sharded); its reference is that base with the adapter off, in the trainer's
processes, so it has no entry of its own; a version, a checkpoint and the exported model are the
adapter's; the generator adds vLLM's LoRA slots (recipes.lora.slot_bytes), and with
`generator.lora_specialize_active` the second set of CUDA graphs that option captures
(`lora_graph_bytes`).

The accelerators hold 85.5 GB (H100, sold as 80 GB) and 150.8 GB (H200, sold as 141 GB), as CUDA
reports them; a CPU recipe is not checked.

`trainer_memory_plan` is the finer model the trainer's micro-batch and activation checkpointing
are planned with (recipes/settings.py), calibrated on measured peaks.
"""

from __future__ import annotations

import math
from typing import Any

from recipes.architectures import architecture
from recipes.gpus import GPUS
from recipes.lora import adapter_params, max_lora_rank, slot_bytes

Recipe = Any  # recipes.schema.Recipe, which imports this module

GB = 1e9
RUNTIME_OVERHEAD_GB = 3.0
# What CUDA reports as the device's memory (recipes/gpus.py; an H100 81559 MiB, sold as
# "80 GB"): what every estimate is checked against, in GB of 10^9 bytes.
ACCELERATOR_BYTES: dict[str, int] = {k: g.memory_mib * 2**20 for k, g in GPUS.items()}
ACCELERATOR_GB: dict[str, float] = {k: round(v / GB, 1) for k, v in ACCELERATOR_BYTES.items()}


def estimate_memory(
    recipe: Recipe,
    generator_replicas: int | None = None,
    trainer_gpus: int | None = None,
) -> dict[str, float]:
    """GB per GPU for "generator", "trainer" and (if enabled) "reference".

    `generator_replicas` and `trainer_gpus` default to the recipe's layout; the planner passes
    the grown values when it hands out extra GPUs.
    """
    arch = architecture(recipe.model.family, recipe.model.size)
    layout, grpo = recipe.layout, recipe.grpo
    replicas = generator_replicas or layout.generator.replicas
    shards = trainer_gpus or layout.trainer.gpus
    seq = grpo.max_prompt_tokens + grpo.max_response_tokens

    activations = arch.n_layers * seq * arch.dim * 2 + seq * arch.vocab_size * 4
    trainer = trainer_state_bytes(arch, shards, recipe.model.lora) + activations

    step_sequences = grpo.prompts_per_step * grpo.group_size * grpo.steps_per_call
    kv_sequences = max(math.ceil(step_sequences / replicas), grpo.group_size)
    generator = 2 * arch.params / layout.generator.tp + kv_gb(recipe, kv_sequences) * GB
    generator += lora_generator_bytes(recipe) / layout.generator.tp

    memory = {"generator": generator, "trainer": trainer}
    if layout.reference.on_gpu:
        reference = 2 * arch.params / layout.reference.gpus + activations
        if layout.reference.gpus == 1:
            # one GPU: the trainer's one-rank precision, which keeps the embedding in fp32
            reference += 2 * arch.vocab_size * arch.dim
        memory["reference"] = reference
    return {k: round(v / GB + RUNTIME_OVERHEAD_GB, 1) for k, v in sorted(memory.items())}


def trainer_state_bytes(arch: Any, ranks: int, lora: Any = None) -> float:
    """Bytes of a trainer rank's weights, gradients and optimizer state: 16 a parameter
    (float32 weights and gradients, AdamW's two moments), sharded over the ranks; with `lora`,
    the frozen base in bf16 (on one rank with the embedding in float32) and 16 bytes an adapter
    parameter."""
    if lora is None:
        return 16 * arch.params / ranks
    base = 2 * arch.params / ranks + (2 * arch.vocab_size * arch.dim if ranks == 1 else 0)
    return base + 16 * adapter_params(arch, lora) / ranks


def version_bytes(recipe: Recipe) -> int:
    """Bytes of a policy version in bf16, as it goes to the generators: the whole model, or a
    LoRA run's adapter."""
    lora = recipe.model.lora
    return 2 * (recipe.arch.params if lora is None else adapter_params(recipe.arch, lora))


def lora_slot_bytes(recipe: Recipe) -> int:
    """Bytes vLLM reserves for a LoRA run's adapters on a generator replica (before TP): its
    slots at the planned max_lora_rank; 0 without LoRA or on the CPU's generator."""
    lora = recipe.model.lora
    vllm = recipe.generator.backend == "vllm" or (
        recipe.generator.backend == "auto" and not recipe.cpu
    )
    if lora is None or not vllm:
        return 0
    return slot_bytes(recipe.arch, max_lora_rank(lora.rank) or lora.rank)


# vLLM's CUDA graphs of qwen3-8b-lora (36 layers of 4,096) on one H200: 1.22 GiB, and 4.01 GiB
# with `specialize_active_lora`, which captures each batch size again with adapters active
# (204 graphs a mode against 102; bench/results/gpu_h200_2026-12-01c-lora-ng). The runtime's
# 3 GB covers the first set; the second is this, scaled by layers x width for other models.
LORA_SPECIALIZE_GRAPH_BYTES = (4.01 - 1.22) * 2**30
LORA_SPECIALIZE_MEASURED_ON = 36 * 4096


def lora_graph_bytes(recipe: Recipe) -> float:
    """Bytes the CUDA graphs of `generator.lora_specialize_active` add on a generator replica
    (before TP): 0 where it is off, without LoRA, on the CPU's generator or with
    `enforce_eager` (no graphs)."""
    gen = recipe.generator
    if not lora_slot_bytes(recipe) or not gen.lora_specialize_active or gen.enforce_eager:
        return 0.0
    scale = recipe.arch.n_layers * recipe.arch.dim / LORA_SPECIALIZE_MEASURED_ON
    return LORA_SPECIALIZE_GRAPH_BYTES * scale


def lora_generator_bytes(recipe: Recipe) -> float:
    """What LoRA adds to a generator replica (before TP): its slots and the graphs of
    `lora_specialize_active`."""
    return lora_slot_bytes(recipe) + lora_graph_bytes(recipe)


def kv_gb(recipe: Recipe, sequences: int) -> float:
    """GB of KV cache per GPU of a generator replica for `sequences` sequences of the recipe's
    maximum length (prompt + response), split over its TP group."""
    g = recipe.grpo
    tokens = sequences * (g.max_prompt_tokens + g.max_response_tokens)
    return tokens * recipe.arch.kv_bytes_per_token / recipe.layout.generator.tp / GB


def generator_weights_gb(recipe: Recipe) -> float:
    """GB of bf16 weights on each GPU of a generator replica (split over its TP group)."""
    return 2 * recipe.arch.params / recipe.layout.generator.tp / GB


def shared_generator_gb(recipe: Recipe, kv_cache_gb: float) -> float:
    """GB a generator replica with a fixed KV cache (where it shares its GPUs) holds on each of
    them: its weights (and a LoRA run's adapter slots), the cache and the runtime's overhead."""
    slots = lora_generator_bytes(recipe) / recipe.layout.generator.tp / GB
    return generator_weights_gb(recipe) + slots + kv_cache_gb + RUNTIME_OVERHEAD_GB


def reference_host_gb(recipe: Recipe) -> float:
    """Host memory a reference on the CPU takes: float32 weights (4 bytes a parameter), one
    micro-batch's activations and logits, plus 2 GB."""
    arch = architecture(recipe.model.family, recipe.model.size)
    seq = recipe.grpo.max_prompt_tokens + recipe.grpo.max_response_tokens
    activations = arch.n_layers * seq * arch.dim * 4 + seq * arch.vocab_size * 4
    return round((4 * arch.params + activations) / GB + 2.0, 1)


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
                    f"{capacity:.1f} GB; {_remedy(service)}"
                )
    return errors


def _remedy(service: str) -> str:
    return {
        "trainer": "raise layout.trainer.gpus (more FSDP shards)",
        "generator": "raise layout.generator.tp or replicas, or lower grpo.prompts_per_step",
        "reference": "raise layout.reference.gpus (more FSDP shards)",
    }[service]


# --- disk -----------------------------------------------------------------------------------------

# The node's software (the environment with torch and vLLM, compile and kernel caches, logs).
SOFTWARE_DISK_GB = 60.0
# A trainer checkpoint: fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter.
CHECKPOINT_BYTES_PER_PARAM = 12


def checkpoint_bytes(arch: Any, lora: Any = None) -> float:
    """Bytes of the trainer's part of a checkpoint (and of its host copy) for `arch`: what it
    trains, every parameter or a LoRA adapter's."""
    trained = arch.params if lora is None else adapter_params(arch, lora)
    return CHECKPOINT_BYTES_PER_PARAM * trained


def disk_plan(recipe: Recipe, *, bucket: bool = False) -> dict[str, float]:
    """GB of node disk a run needs, by what fills it, and "total" (rounded up to 50 GB, at
    least 100): the model download (bf16), the kept checkpoints plus one being written (with a
    checkpoint bucket, the one being uploaded plus the one being written stay local), the
    exported model (in `model.dtype`) and the software."""
    from recipes.names import KEPT_CHECKPOINTS

    arch = architecture(recipe.model.family, recipe.model.size)
    bf16 = 2 * arch.params / GB
    local_checkpoints = 2 if bucket else KEPT_CHECKPOINTS + 1
    parts = {
        "model download": 0.0 if recipe.model.init == "random" else bf16,
        "checkpoints": local_checkpoints * checkpoint_bytes(arch, recipe.model.lora) / GB,
        "exported model": model_file_bytes(recipe) / GB,
        "software": SOFTWARE_DISK_GB,
    }
    total = max(100, math.ceil(sum(parts.values()) / 50) * 50)
    return {k: round(v, 1) for k, v in parts.items()} | {"total": float(total)}


def disk_errors(recipe: Recipe, *, bucket: bool) -> list[str]:
    """Where the recipe sets resources.disk_gb: a line if that is less than a node of the run
    fills (disk_plan's parts, with or without a checkpoint bucket), else nothing."""
    given = recipe.resources.disk_gb
    if given == "auto":
        return []
    parts = {k: v for k, v in disk_plan(recipe, bucket=bucket).items() if k != "total"}
    least = math.ceil(sum(parts.values()))
    if given >= least:
        return []
    listed = ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if v)
    where = "even with a checkpoint bucket" if bucket else "without a checkpoint bucket"
    return [
        f"resources.disk_gb {given} is less than the {least} GB a node of {recipe.name} fills "
        f"{where} ({listed}); set at least {least}, or auto"
    ]


# --- host memory ----------------------------------------------------------------------------------

# Host memory allowed each GPU process (its CUDA context, Python, the loaders' buffers) and the
# rest of node 0 (the controller, the reward procs, the system): allowances, not measurements.
PROCESS_HOST_GB = 8.0
BASE_HOST_GB = 16.0


# The export's safetensors files: at most this many bytes each (runtime.models.export).
EXPORT_FILE_BYTES = 5 * 10**9


def model_file_bytes(recipe: Recipe) -> int:
    """Bytes of the recipe's model in safetensors of its dtype (`model.dtype`): the exported
    folder's weights; a LoRA run exports its adapter, in float32."""
    if recipe.model.lora is not None:
        return 4 * adapter_params(recipe.arch, recipe.model.lora)
    return (2 if recipe.model.dtype == "bfloat16" else 4) * recipe.arch.params


def export_host_bytes(recipe: Recipe) -> float:
    """Bytes trainer rank 0 holds in host memory while it writes the HF folder at the end of a
    run (beside the checkpoint copy, which is kept), in the dtype it writes: the weights of the
    file being filled and the gathered group in hand (the largest: the embedding and the output
    projection), or the whole model where that is less; a LoRA run's adapter whole."""
    arch = recipe.arch
    if recipe.model.lora is not None:
        return float(model_file_bytes(recipe))
    size = model_file_bytes(recipe) / arch.params
    outside = arch.vocab_size * arch.dim * (1 if arch.tie_embeddings else 2)
    return size * min(arch.params, EXPORT_FILE_BYTES / size + outside)


def host_plan(
    recipe: Recipe, gpus_on_node0: int, reference_host_gb: float | None = None
) -> dict[str, float]:
    """GB of node 0's host memory a run needs, by what fills it, and "total" (rounded up to 16
    GB): the copy of the trainer's state a checkpoint write stages there (pinned, kept for the
    next write), what the export at the end holds there (a file at a time), a reference on the
    CPU, and the allowance for the processes."""
    arch = architecture(recipe.model.family, recipe.model.size)
    parts = {
        "checkpoint copy": checkpoint_bytes(arch, recipe.model.lora) / GB,
        "export": export_host_bytes(recipe) / GB,
        "reference on CPU": reference_host_gb or 0.0,
        "processes": BASE_HOST_GB + PROCESS_HOST_GB * gpus_on_node0,
    }
    total = math.ceil(sum(parts.values()) / 16) * 16
    return {k: round(v, 1) for k, v in parts.items() if v} | {"total": float(total)}


# --- the trainer's micro-batch and activation checkpointing --------------------------------------

# Micro-batch sizes the memory plan tries, largest first (more tokens per micro-batch: fewer
# weight casts and gradient additions per step; 8192 -> 16384 was 5 % faster at 2048 tokens).
PLAN_TOKENS = (16384, 8192, 4096)
# Share of the GPU's memory the trainer plans to use (the rest: allocator slack, NCCL, spikes).
PLAN_HEADROOM = 0.9
# A LoRA trainer on one rank without activation checkpointing: bytes a base parameter allowed
# for the compiled blocks' and cuBLAS workspaces beyond the activations. None needed: qwen3-8b
# rank 16, one H200, 8192 tokens a micro-batch, compiled, peaked at 67.4 GB in its step, where
# the model without any says 82.5 (bench/results/gpu_h200_2026-11-28-lora; 1 a parameter was
# assumed before and said 90.7).
LORA_ONE_RANK_WORKSPACE = 0


def trainer_fixed_bytes(
    arch: Any, ranks: int, checkpointing: bool = False, lora: Any = None, gathered: bool = False
) -> float:
    """Bytes a trainer rank holds whatever the micro-batch: fp32 weights, gradients and AdamW
    moments (16 bytes a parameter, sharded over the ranks); on one rank without activation
    checkpointing also autocast's bf16 weights, kept for the backward of every layer, their bf16
    gradients and the compiled blocks' and cuBLAS workspaces (10 more); several ranks, or one
    recomputing its layers, instead hold two blocks' bf16 weights and fp32 gradients at a time;
    plus 3 GB. (Qwen3-1.7B, one rank, 8192 tokens, checkpointing: 36.5 GB compiled, 43.7 and
    40.2 uncompiled, where the 10 bytes a parameter would have said 17 GB more.)

    With `lora`, the frozen base in bf16 and the adapter's state (`trainer_state_bytes`); several
    ranks hold two gathered blocks of bf16 base weights (no gradients); one rank needs no
    autocast copies of a bf16 base, and without checkpointing keeps LORA_ONE_RANK_WORKSPACE
    bytes a parameter for the compiled blocks' and cuBLAS workspaces (measured: none); plus
    3 GB.

    `gathered` (several ranks, trainer.gather_once): the step's weights stay gathered and its
    gradients accumulate unsharded, so the rank holds every block's bf16 weights and fp32
    gradients for the whole step (`gathered_bytes`) instead of two blocks' at a time."""
    params = arch.params
    if lora is not None:
        if ranks > 1:
            held = gathered_bytes(arch, lora) if gathered else 2 * 2 * params / arch.n_layers
        else:
            held = 0 if checkpointing else LORA_ONE_RANK_WORKSPACE * params
        return trainer_state_bytes(arch, ranks, lora) + held + 3e9
    if ranks > 1 and gathered:
        held = gathered_bytes(arch)
    else:
        held = 10 * params if ranks == 1 and not checkpointing else 2 * 6 * params / arch.n_layers
    return 16 * params / ranks + held + 3e9


def gathered_bytes(arch: Any, lora: Any = None) -> float:
    """Bytes a trainer rank of several holds through a step that gathers its weights once
    (trainer.gather_once): the bf16 weights of the whole model (2 bytes a parameter) and the
    unsharded fp32 gradients FSDP accumulates until the step's last micro-batch reduces them
    (4 bytes a trained parameter: the adapter's alone with LoRA)."""
    trained = arch.params if lora is None else adapter_params(arch, lora)
    return 2 * arch.params + 4 * trained


def trainer_checkpoint_bytes(arch: Any, ranks: int, lora: Any = None) -> float:
    """Bytes a trainer rank holds on its GPU while a checkpoint write copies its shards to host
    memory (after a step; nothing is gathered): what it holds whatever the micro-batch, less the
    bf16 weights and gradients a rank without activation checkpointing keeps only within a step
    (Qwen3-1.7B, one rank without checkpointing: 25.3 GB measured, where the step's fixed bytes
    say 47.7)."""
    return trainer_fixed_bytes(arch, ranks, checkpointing=True, lora=lora)


def trainer_publish_gb(arch: Any, ranks: int, lora: Any = None) -> float:
    """GB on trainer rank 0 while a version goes out by a flat buffer that lives only until the
    generators have loaded it (the ipc path): weights and AdamW moments (12 bytes a parameter,
    sharded; gradients are freed after the update), the version's bf16 buffer (2 bytes a
    parameter), the largest gathered group (the embedding and output projection in bf16, one
    of them in fp32 on its way), plus the runtime's overhead. With `lora`: the bf16 base, the
    adapter's weights and moments, its bf16 version and the gathered adapter in fp32."""
    if lora is not None:
        adapter = adapter_params(arch, lora)
        held = trainer_state_bytes(arch, ranks, lora) - 4 * adapter / ranks  # no gradients
        return round((held + 2 * adapter + 4 * adapter) / GB + RUNTIME_OVERHEAD_GB, 1)
    outside = arch.vocab_size * arch.dim
    group = 2 * outside * (1 if arch.tie_embeddings else 2) + 4 * outside
    total = 12 * arch.params / ranks + 2 * arch.params + group
    return round(total / GB + RUNTIME_OVERHEAD_GB, 1)


def trainer_token_bytes(arch: Any, checkpointing: bool, compiled: bool = True) -> float:
    """Bytes each token of a micro-batch keeps for backward: per layer 24 x dim + 6 x ffn_dim
    (the bf16 inputs of each matmul, the fp32 residual stream and norms) plus the bf16 logits
    of the output projection (2 x vocab); with checkpointing, each layer's fp32 input (4 x dim)
    plus one layer's activations being recomputed. 15 % on top.

    An uncompiled head (`trainer.compile` off) materialises the fp32 log-softmax and its
    gradient: 4 x vocab in all, 9 x vocab with checkpointing, where it is most of what a token
    keeps. Measured, compile off: Qwen3-8B, two ranks, 16384 tokens, checkpointing: 109.2 GB
    (this: 111.4; 2 x vocab would say 91.3); Qwen3-1.7B, 16384 tokens, no checkpointing: 102.3
    GB on one rank (104.5), 71.9 on two (74.3); one rank, 8192 tokens, checkpointing: 43.7 GB,
    against 36.5 compiled.
    """
    layer = 24 * arch.dim + 6 * arch.ffn_dim
    logits = (2 if compiled else 9 if checkpointing else 4) * arch.vocab_size
    if checkpointing:
        return 1.15 * (arch.n_layers * 4 * arch.dim + layer + logits)
    return 1.15 * (arch.n_layers * layer + logits)


def trainer_step_bytes(
    arch: Any,
    ranks: int,
    tokens: int,
    checkpointing: bool,
    compiled: bool = True,
    lora: Any = None,
    gathered: bool = False,
) -> float:
    """Bytes a trainer rank peaks at in a step of `tokens` tokens a micro-batch: what it holds
    whatever the micro-batch and what each token keeps for backward (the same with LoRA: the
    base's activations are kept for the input gradients, which is conservative)."""
    per_token = trainer_token_bytes(arch, checkpointing, compiled)
    return trainer_fixed_bytes(arch, ranks, checkpointing, lora, gathered) + tokens * per_token


def planned_peak(
    peak: float,
    gather: bool,
    arch: Any,
    ranks: int,
    tokens: int,
    checkpointing: bool,
    compiled: bool = True,
    lora: Any = None,
) -> float:
    """A trainer rank's step bytes as planned: `peak` (planned without trainer.gather_once), or
    where `gather` the step's with the whole model gathered (`trainer_step_bytes`)."""
    if not gather:
        return peak
    return trainer_step_bytes(arch, ranks, tokens, checkpointing, compiled, lora, gathered=True)


def gather_once_fits(
    arch: Any,
    ranks: int,
    gpu_bytes: float,
    tokens: int,
    checkpointing: bool,
    compiled: bool = True,
    lora: Any = None,
) -> bool:
    """Whether a trainer rank of several can gather its weights once a step
    (trainer.gather_once) at the micro-batch and checkpointing planned without it: its step
    with the whole model gathered still within PLAN_HEADROOM of `gpu_bytes`. The plan takes a
    larger micro-batch or no recomputation over it (qwen3-1.7b-sft on two H200s: 16384 tokens
    and about 12 GB more a rank, on; qwen3-8b-sft: about 49 GB more, off)."""
    if ranks < 2:
        return False
    peak = trainer_step_bytes(arch, ranks, tokens, checkpointing, compiled, lora, gathered=True)
    return peak <= PLAN_HEADROOM * gpu_bytes


def trainer_memory_plan(
    arch: Any,
    ranks: int,
    gpu_bytes: float,
    *,
    tokens: int | None = None,
    checkpointing: bool | None = None,
    compiled: bool = True,
    lora: Any = None,
) -> tuple[int, bool, float] | None:
    """Tokens per micro-batch and activation checkpointing for a trainer rank with a GPU of
    `gpu_bytes` to itself, and the estimated peak in bytes; None if nothing fits.

    The largest of `PLAN_TOKENS` (or `tokens`, if given) that fits in `PLAN_HEADROOM` of the GPU
    without checkpointing (unless `checkpointing` is given), else with it.
    Calibrated on Qwen3-1.7B on one H200 (compiled blocks and head, 64 x 2048 tokens, 3/4
    response): peaks 68, 91 and 137 GB at 8192, 16384 and 32768 tokens; this estimates 73, 99
    and 150.
    """
    budget = PLAN_HEADROOM * gpu_bytes
    choices = (False, True) if checkpointing is None else (checkpointing,)
    sizes = PLAN_TOKENS if tokens is None else (tokens,)
    for ckpt in choices:
        for size in sizes:
            peak = trainer_step_bytes(arch, ranks, size, ckpt, compiled, lora)
            if peak <= budget:
                return size, ckpt, peak
    return None
