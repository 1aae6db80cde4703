"""From a recipe and its planned settings to what every service builds: model shape, tokenizer,
first weights, device, and one config per service whose `build()` makes its backend.

Each actor builds in its own proc, so the controller ships only the (small, picklable) recipe
and settings.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from recipes import UserError, architecture
from recipes.sft import packed_attention
from runtime.hub import hf_token
from runtime.models import ModelSpec
from runtime.models.loading import WeightSource, weight_source


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

    from runtime.hub import UNREACHABLE, quiet_retries

    try:
        with quiet_retries() as failed_requests:
            return AutoTokenizer.from_pretrained(name, token=hf_token())
    except OSError as e:
        if failed_requests and recipe.model.init != "random":
            raise UserError(
                f"model.tokenizer {name!r}: {UNREACHABLE} ({failed_requests[0]}) and it is "
                "not in the local cache; check the network, "
                "or set model.tokenizer to a local folder"
            ) from None
        if recipe.model.init != "random":
            raise
        # A random-weight run needs no download but its tokenizer: say how to do without.
        why = f"{UNREACHABLE}: {failed_requests[0]}" if failed_requests else str(e).splitlines()[0]
        raise UserError(
            f"model.tokenizer {name!r} could not be loaded ({why}); a random-init run without "
            "the Hub can use --set model.tokenizer=builtin:arith"
        ) from None


def initial_weights(recipe: Any, spec: ModelSpec) -> WeightSource | None:
    """The pretrained checkpoint as a source read a block at a time (a GPU backend copies
    each rank's shards out of it), or None for a seeded random init (`init: random`)."""
    if recipe.model.init == "random":
        return None
    return weight_source(recipe.model.hf_id, spec, token=hf_token())


def write_model(
    recipe: Any,
    groups: Any,
    layout: Mapping[str, torch.Tensor],
    folder: Any,
    provenance: dict[str, Any],
) -> Any:
    """The recipe's policy as a Hugging Face folder (runtime.models.export), from its weights
    under HF names a group at a time, with the recipe's tokenizer, dtype and sampling, and in
    its forgesky.json `provenance` and the recipe itself (what `forgesky eval` reads)."""
    from runtime.models.export import write_hf_model_groups

    return write_hf_model_groups(
        groups,
        dict(layout),
        model_spec(recipe),
        folder,
        tokenizer=load_tokenizer(recipe),
        dtype=recipe.model.dtype,
        # the sampling a GRPO run trained at; an SFT model samples as its family does
        temperature=recipe.grpo.temperature if recipe.kind == "grpo" else 1.0,
        top_p=recipe.grpo.top_p if recipe.kind == "grpo" else 1.0,
        provenance={**provenance, "recipe_config": recipe.model_dump(mode="json")},
    )


def base_id(recipe: Any) -> str | None:
    """The base a LoRA adapter of the recipe names: its Hub id or folder, or None for a random
    init (no name finds those weights again)."""
    return recipe.model.hf_id if recipe.model.init == "hub" else None


def write_adapter(
    recipe: Any, tensors: Mapping[str, torch.Tensor], folder: Any, provenance: dict[str, Any]
) -> Any:
    """The recipe's LoRA adapter (PEFT names) as a PEFT folder (runtime.models.peft_format), in
    fp32, with the recipe and `provenance` in its forgesky.json (what `forgesky eval` reads)."""
    from runtime.models.peft_format import write_adapter_folder

    return write_adapter_folder(
        folder,
        {k: v.float() for k, v in tensors.items()},
        recipe.model.lora,
        base_id(recipe),
        recipe.model_dump(mode="json"),
        provenance,
    )


def eos_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer)[0]


def encode_messages(
    tokenizer: Any, messages: list[dict[str, str]], limit: int, thinking: bool | None = None
) -> list[int]:
    """A prompt's chat messages as the token ids a generator continues: through the tokenizer's
    chat template where it has one (with the generation prompt; `thinking`, unless None, as its
    enable_thinking), else the contents joined by newlines; an over-long prompt keeps its last
    `limit` tokens (where the question and the instructions are)."""
    if getattr(tokenizer, "chat_template", None):
        extra = {} if thinking is None else {"enable_thinking": thinking}
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
        # transformers 5 returns a BatchEncoding (a Mapping, not a dict), 4 a list of ids
        ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    else:
        text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return ids[-limit:] if len(ids) > limit else ids


# --- backends: each service's config, built in its own proc ------------------------------------


def _model_args(recipe: Any) -> dict[str, Any]:
    """What every trainer and reference backend is built from: shape, sampling temperature,
    first weights (pretrained, or None for the seeded random init), seed and device."""
    spec = model_spec(recipe)
    return {
        "spec": spec,
        # an SFT recipe samples nothing: its trainer scores at temperature 1
        "temperature": recipe.grpo.temperature if recipe.kind == "grpo" else 1.0,
        "weights": initial_weights(recipe, spec),
        "seed": recipe.seed,
        "device": device(),
    }


@dataclass(frozen=True)
class GeneratorConfig:
    """One generator proc: the recipe's model and sampling, its planned settings
    (recipes.settings.GeneratorSettings)."""

    recipe: Any
    settings: Any

    def build(self, tokenizer: Any) -> Any:
        """`VLLMGenerator` (backend vllm) or `HFGenerator` (hf). Its weights are random until
        the first `load_weights` (the trainer publishes version 0), except under LoRA: there
        the generator loads the frozen base itself, here (`lora_base`), and every version the
        trainer publishes is the adapter alone."""
        recipe, s = self.recipe, self.settings
        spec, g = model_spec(recipe), recipe.grpo
        model_dir, weights = lora_base(recipe, spec, vllm=s.backend == "vllm")
        if s.backend == "vllm":
            from runtime.backends.vllm_generator import VLLMGenerator

            if device().type != "cuda":
                raise UserError("generator.backend vllm needs a GPU; this generator proc has none")
            if importlib.util.find_spec("vllm") is None:
                raise UserError(
                    "generator.backend vllm: vllm is not installed; install forgesky[gpu] "
                    "or set generator.backend=hf"
                )
            tp = recipe.layout.generator.tp
            if torch.cuda.device_count() < tp:
                raise UserError(
                    f"layout.generator.tp={tp} but this generator proc sees "
                    f"{torch.cuda.device_count()} GPU(s)"
                )
            return VLLMGenerator(
                spec,
                eos_token_id=eos_ids(tokenizer),
                pad_token_id=pad_id(tokenizer),
                max_model_len=g.max_prompt_tokens + g.max_response_tokens,
                temperature=g.temperature,
                top_p=g.top_p,
                dtype=dtype(recipe),
                tensor_parallel_size=tp,
                gpu_memory_utilization=s.gpu_memory_utilization,
                kv_cache_memory_bytes=None if s.kv_cache_gb is None else int(s.kv_cache_gb * 1e9),
                seed=g.seed,
                enforce_eager=s.enforce_eager,
                engine_in_process=s.engine == "in-process",
                lora=recipe.model.lora,
                lora_dual_stream=bool(s.lora_dual_stream),
                lora_specialize_active=bool(s.lora_specialize_active),
                model_dir=model_dir,
                weights=weights,
            )
        from runtime.backends import HFGenerator

        return HFGenerator(
            spec,
            eos_token_id=eos_ids(tokenizer),
            pad_token_id=pad_id(tokenizer),
            device=device(),
            dtype=dtype(recipe),
            seed=g.seed,
            lora=recipe.model.lora,
            weights=weights,
        )


def lora_base(recipe: Any, spec: ModelSpec, vllm: bool) -> tuple[Any, Any]:
    """A LoRA run's frozen base for a generator, (a Hugging Face folder vLLM reads itself, or
    the weights under HF names); (None, None) for a full-parameter run, whose versions carry
    every weight. The base is the trainer's own: the same checkpoint, or the same seeded
    init (built whole on the host, 4 bytes a parameter, as the trainer builds it)."""
    if recipe.model.lora is None:
        return None, None
    source = initial_weights(recipe, spec)
    if vllm and source is not None:
        return source.folder, None
    from runtime.models.hf import to_hf
    from runtime.models.loading import SeededWeights

    source = source or SeededWeights(spec, recipe.seed)
    return None, to_hf(source.state_dict(), spec)


@dataclass(frozen=True)
class TrainerConfig:
    """One trainer rank: the recipe's model and optimizer, its planned settings
    (recipes.settings.TrainerSettings)."""

    recipe: Any
    settings: Any

    def build(self) -> Any:
        """`FSDPTrainer` (bf16 compute, fp32 master weights) on a GPU or across several
        trainer ranks (gloo on CPU), else the one-process CPU `TitanTrainer`. Weights: the
        recipe's pretrained ones or the seeded random init; with the recipe's model.lora, that
        base frozen and a seeded adapter on it (the trainer is then the reference too)."""
        from runtime.backends import OptimizerConfig

        recipe, s = self.recipe, self.settings
        args = _model_args(recipe)
        sft = recipe.kind == "sft"
        optim = OptimizerConfig.from_grpo(recipe.sft if sft else recipe.grpo)
        if device().type == "cuda" or s.ranks > 1:
            from runtime.backends.fsdp_trainer import FSDPTrainer

            # SFT's packed rows attend each to itself (runtime.models.packing): sft.attention,
            # varlen where auto. TorchTitan 0.3.0's flex document mask passes create_block_mask
            # a `separate_full_blocks` that the nodes' torch 2.11 lacks
            # (bench/results/gpu_h200_2026-11-29-sft-step).
            attention = packed_attention(recipe, gpu=device().type == "cuda") if sft else "sdpa"
            return FSDPTrainer(
                optim=optim,
                attention=attention,
                compute_dtype=dtype(recipe),
                publish_dtype=dtype(recipe),
                tokens_per_micro_batch=s.tokens_per_micro_batch,
                activation_checkpointing=s.activation_checkpointing,
                compile=s.compile,
                gather_once=s.gather_once,
                lora=recipe.model.lora,
                **args,
            )
        from runtime.backends import TitanTrainer

        return TitanTrainer(
            optim=optim,
            attention="document" if sft else "sdpa",
            dtype=dtype(recipe),
            tokens_per_micro_batch=s.tokens_per_micro_batch,
            activation_checkpointing=s.activation_checkpointing,
            lora=recipe.model.lora,
            **args,
        )


@dataclass(frozen=True)
class ReferenceConfig:
    """The reference proc: the recipe's model, frozen, and its planned settings
    (recipes.settings.ReferenceSettings)."""

    recipe: Any
    settings: Any

    def build(self) -> Any:
        """`GPUReference` (bf16, micro-batched; sharded when it has several ranks) on a GPU or
        across several CPU ranks (gloo), else the one-process `TitanReference`."""
        args = _model_args(self.recipe)
        if device().type == "cuda" or self.settings.ranks > 1:
            from runtime.backends.fsdp_reference import GPUReference

            return GPUReference(
                dtype=dtype(self.recipe),
                tokens_per_micro_batch=self.settings.tokens_per_micro_batch,
                compile=self.settings.compile,
                **args,
            )
        from runtime.backends import TitanReference

        return TitanReference(dtype=dtype(self.recipe), **args)
