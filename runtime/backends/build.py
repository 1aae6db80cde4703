"""From a recipe to the parts every service builds: model shape, tokenizer, first weights, device.

Each actor calls these in its own proc, so the controller ships only the (small, picklable) recipe.
"""

from __future__ import annotations

import importlib.util
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
        from runtime.tasks.registry import shipped_task

        task = shipped_task(name.removeprefix("builtin:"), field="model.tokenizer")
        if task.tokenizer is None:
            raise UserError(f"model.tokenizer {name!r}: the shipped task has no tokenizer")
        # Shipped tokenizers may size themselves to the model's vocabulary (arith).
        return task.tokenizer(model_spec(recipe).vocab_size)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, token=hf_token())
    except OSError as e:
        if recipe.model.init != "random":
            raise
        # A random-weight run needs no download but its tokenizer: say how to do without.
        raise UserError(
            f"model.tokenizer {name!r} could not be loaded ({str(e).splitlines()[0]}); a "
            "random-init run without the Hub can use --set model.tokenizer=builtin:arith"
        ) from None


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


# --- backends: which implementation serves each service on this proc --------------------------

GENERATOR_ENV = "FORGESKY_GENERATOR"  # auto (vLLM on a GPU when installed) | vllm | hf
GPU_MEMORY_ENV = "FORGESKY_GPU_MEMORY_UTILIZATION"  # vLLM's share of its GPU (default 0.85)
# A fixed KV cache for vLLM when services share a GPU (no memory profiling; see VLLMGenerator).
KV_CACHE_ENV = "FORGESKY_VLLM_KV_CACHE_GB"
EAGER_ENV = "FORGESKY_VLLM_EAGER"  # 1: no torch.compile / CUDA graphs (faster start)
# Trainer/reference tokens per micro-batch; default: fsdp_trainer.memory_plan (see
# trainer_memory_plan).
MICRO_BATCH_ENV = "FORGESKY_TOKENS_PER_MICRO_BATCH"
# Trainer procs (FSDP ranks): default one per trainer GPU, 1 on CPU (more: gloo, for tests).
TRAINER_PROCS_ENV = "FORGESKY_TRAINER_PROCS"
# 1: recompute each block in backward (about 1/3 more FLOPs, much less memory); default: only
# where the memory plan needs it.
ACTIVATION_CHECKPOINTING_ENV = "FORGESKY_ACTIVATION_CHECKPOINTING"
# torch.compile each trainer/reference block; default on a GPU (1.7B at 2048 tokens on an H200:
# 0.39 MFU compiled against 0.25 eager, with activation checkpointing), off on a CPU
TRAINER_COMPILE_ENV = "FORGESKY_TRAINER_COMPILE"


def env_flag(name: str, default: bool) -> bool:
    """A 0/1 knob from the environment."""
    raw = os.environ.get(name, "").strip()
    if raw in ("", "0", "1"):
        return default if raw == "" else raw == "1"
    raise UserError(f"{name}={raw!r}: expected 0 or 1")


def generator_kind() -> str:
    """ "vllm" or "hf": vLLM on a GPU when it is installed, unless `FORGESKY_GENERATOR` says."""
    choice = os.environ.get(GENERATOR_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "vllm", "hf"):
        raise UserError(f"{GENERATOR_ENV}={choice!r}: expected auto, vllm or hf")
    if choice == "hf":
        return "hf"
    on_gpu = device().type == "cuda"
    installed = importlib.util.find_spec("vllm") is not None
    if choice == "vllm" and not (on_gpu and installed):
        missing = "no GPU in this proc" if not on_gpu else "vllm is not installed"
        raise UserError(f"{GENERATOR_ENV}=vllm but {missing}; install forgesky[gpu] on a GPU host")
    return "vllm" if on_gpu and installed else "hf"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return default if raw is None else float(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not a number") from None


def build_generator(recipe: Any, tokenizer: Any) -> Any:
    """The recipe's sampling backend for this proc: `VLLMGenerator` on a GPU, else `HFGenerator`.

    Its weights are random until the first `load_weights` (the trainer publishes version 0).
    """
    spec, g = model_spec(recipe), recipe.grpo
    if generator_kind() == "vllm":
        from runtime.backends.vllm_generator import VLLMGenerator

        tp = recipe.layout.generator.tp
        if torch.cuda.device_count() < tp:
            raise UserError(
                f"layout.generator.tp={tp} but this generator proc sees "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        kv_gb = _env_float(KV_CACHE_ENV, 0.0)
        # With a fixed KV cache the utilisation only gates start-up: that much must be free.
        utilisation = _env_float(GPU_MEMORY_ENV, 0.05 if kv_gb else 0.85)
        return VLLMGenerator(
            spec,
            eos_token_id=eos_ids(tokenizer),
            pad_token_id=pad_id(tokenizer),
            max_model_len=g.max_prompt_tokens + g.max_response_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            dtype=dtype(recipe),
            tensor_parallel_size=tp,
            gpu_memory_utilization=utilisation,
            kv_cache_memory_bytes=int(kv_gb * 2**30) if kv_gb else None,
            seed=g.seed,
            enforce_eager=os.environ.get(EAGER_ENV, "0") == "1",
        )
    from runtime.backends import HFGenerator

    return HFGenerator(
        spec,
        eos_token_id=eos_ids(tokenizer),
        pad_token_id=pad_id(tokenizer),
        device=device(),
        dtype=dtype(recipe),
        seed=g.seed,
    )


def _model_args(recipe: Any) -> dict[str, Any]:
    """What every trainer and reference backend is built from: shape, sampling temperature,
    first weights (pretrained, or None for the seeded random init), seed and device."""
    spec, g = model_spec(recipe), recipe.grpo
    return {
        "spec": spec,
        "temperature": g.temperature,
        "weights": initial_weights(recipe, spec),
        "seed": g.seed,
        "device": device(),
    }


def trainer_memory_plan(recipe: Any) -> tuple[int, bool]:
    """Tokens per micro-batch and activation checkpointing for this proc's trainer (and the
    reference's micro-batch). Each knob set in the environment wins. Otherwise, a GPU that this
    proc has to itself gets `fsdp_trainer.memory_plan` for its size; a GPU that services share
    (a fixed vLLM KV cache is set) or a CPU gets 8192 tokens with checkpointing."""
    from runtime.backends.fsdp_trainer import WORLD_ENV, memory_plan

    tokens, checkpointing = 8192, True
    alone = device().type == "cuda" and not os.environ.get(KV_CACHE_ENV)
    if alone:
        world = int(os.environ.get(WORLD_ENV, "1"))
        total = torch.cuda.get_device_properties(device()).total_memory
        tokens, checkpointing, _ = memory_plan(model_spec(recipe), world, total)
    return (
        int(_env_float(MICRO_BATCH_ENV, tokens)),
        env_flag(ACTIVATION_CHECKPOINTING_ENV, checkpointing),
    )


def build_trainer(recipe: Any) -> Any:
    """The policy backend: `FSDPTrainer` (bf16 compute, fp32 master weights) on a GPU or across
    several trainer ranks (gloo on CPU), else the single-process CPU `TitanTrainer`. Weights: the
    recipe's pretrained ones or the seeded random init."""
    from runtime.backends import OptimizerConfig
    from runtime.backends.fsdp_trainer import WORLD_ENV

    args = _model_args(recipe)
    optim = OptimizerConfig.from_grpo(recipe.grpo)
    if device().type == "cuda" or int(os.environ.get(WORLD_ENV, "1")) > 1:
        from runtime.backends.fsdp_trainer import FSDPTrainer

        tokens, checkpointing = trainer_memory_plan(recipe)
        return FSDPTrainer(
            optim=optim,
            compute_dtype=dtype(recipe),
            publish_dtype=dtype(recipe),
            tokens_per_micro_batch=tokens,
            activation_checkpointing=checkpointing,
            compile=env_flag(TRAINER_COMPILE_ENV, device().type == "cuda"),
            **args,
        )
    from runtime.backends import TitanTrainer

    return TitanTrainer(optim=optim, dtype=dtype(recipe), **args)


def build_reference(recipe: Any) -> Any:
    """The frozen reference: `GPUReference` (bf16, micro-batched) on a GPU, else `TitanReference`."""
    args = _model_args(recipe)
    if device().type == "cuda":
        from runtime.backends.fsdp_trainer import GPUReference

        return GPUReference(
            dtype=dtype(recipe),
            tokens_per_micro_batch=trainer_memory_plan(recipe)[0],
            compile=env_flag(TRAINER_COMPILE_ENV, device().type == "cuda"),
            **args,
        )
    from runtime.backends import TitanReference

    return TitanReference(dtype=dtype(recipe), **args)
