"""The recipe: one YAML file describing a GRPO run (model, data, algorithm, layout, resources).

Its sections, each with the checks that see it alone, are in recipes/run_sections.py (model,
dataset, grpo, eval) and recipes/service_sections.py (layout, resources, the services'
settings). Checks that span sections (tensor-parallel sizes against the architecture, trainer
ranks against its GPUs, the memory estimate against the accelerator) live here, in
`Recipe._check_consistency`. Every message names the dotted field path.

Placement is `layout` (which service gets how many GPUs); how each service runs is its own
section (`generator`, `trainer`, `reference`, `weight_sync`), where "auto" values are planned
from the GPU type and the layout (recipes/settings.py) and shown by `forgesky plan`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from recipes.architectures import ARCHITECTURES, Arch, ModelRecipe, sizes
from recipes.buckets import is_url
from recipes.environment import Environment
from recipes.fields import Identifier, Strict
from recipes.files import looks_local, same_local
from recipes.lora import VLLM_LORA_RANKS
from recipes.memory import estimate_memory, memory_errors
from recipes.names import ALL_LINEAR, BUILTIN_SPLITS, LORA_TARGETS, TOOL_FAMILIES
from recipes.run_sections import Dataset, Eval, Grpo, Model
from recipes.service_sections import (
    GeneratorSettings,
    Layout,
    ReferenceSettings,
    Resources,
    TrainerSettings,
    WatchdogSettings,
    WeightSyncSettings,
)


class Recipe(ModelRecipe, Strict):
    """A complete, validated GRPO run description."""

    name: Identifier
    description: str
    model: Model
    dataset: Dataset
    grpo: Grpo
    layout: Layout = Layout()
    resources: Resources = Resources()
    eval: Eval = Eval()
    generator: GeneratorSettings = GeneratorSettings()
    trainer: TrainerSettings = TrainerSettings()
    reference: ReferenceSettings = ReferenceSettings()
    weight_sync: WeightSyncSettings = WeightSyncSettings()
    watchdog: WatchdogSettings = WatchdogSettings()
    # Multi-turn episodes with tool calls (recipes/environment.py); none: single-turn rollouts.
    env: Environment | None = None

    @property
    def seed(self) -> int:
        """The seed of the run's random init, data order and sampling."""
        return self.grpo.seed

    @property
    def kind(self) -> str:
        """What the recipe trains by: "grpo" (an SFT recipe's, recipes/sft.py, is "sft")."""
        return "grpo"

    @model_validator(mode="after")
    def _check_consistency(self) -> Recipe:
        errors = _consistency_errors(self)
        if errors:
            # The message names its own field path; the loader prints it as is.
            raise PydanticCustomError("recipe", errors[0])
        return self


def _episode_errors(r: Recipe) -> list[str]:
    e = r.env
    if e is None:
        return [] if r.dataset.rewards else ["dataset.rewards: List should have at least 1 item"]
    errors = []
    if r.model.family not in TOOL_FAMILIES:
        errors.append(f"env: no tool-call format for the {r.model.family} family")
    if e.max_turn_tokens is not None and e.max_turn_tokens > r.grpo.max_response_tokens:
        errors.append(
            f"env.max_turn_tokens: {e.max_turn_tokens} exceeds the episode's "
            f"grpo.max_response_tokens {r.grpo.max_response_tokens}"
        )
    if r.eval.enabled and r.eval.reward is not None:
        errors.append(
            f"eval.reward: {r.eval.reward!r}: a recipe with env is evaluated by its "
            "environment's reward (eval.correct_at says what is correct); leave it unset"
        )
    return errors


def _eval_errors(r: Recipe) -> list[str]:
    e = r.eval
    if not e.enabled:
        return []
    errors = []
    if e.k > e.samples_drawn:
        errors.append(
            f"eval.k: pass@{e.k} needs at least {e.k} samples a prompt, but eval.samples is "
            f"{e.samples_drawn}"
        )
    path = e.path or r.dataset.path
    # one file or folder however spelt (relative, ~, absolute): what the node will see as one
    same = path == r.dataset.path or same_local(path, r.dataset.path)
    if path.startswith("builtin:"):
        if e.split not in BUILTIN_SPLITS:
            errors.append(
                f"eval.split: the shipped task {path} has no split {e.split!r} "
                f"(it has {', '.join(BUILTIN_SPLITS)})"
            )
    elif same and e.split == r.dataset.split:
        errors.append(
            f"eval.split: {e.split!r} is the split the run trains on (dataset.split); name a "
            "held-out one, or held-out data as eval.path"
        )
    else:
        errors += local_split_errors(path, e.split, same_data=same)
    names = [w.name for w in r.dataset.rewards]
    if e.reward is not None and e.reward not in names and r.env is None:
        errors.append(
            f"eval.reward: {e.reward!r} is not one of the recipe's rewards ({', '.join(names)})"
        )
    return errors


def local_split_errors(path: str, split: str, *, same_data: bool) -> list[str]:
    """What a look at local data (where it is on this machine) says about an eval split: a data
    file has no splits of its own, a saved dataset lists its splits. Hub data is checked when
    the run loads it."""
    local = Path(path).expanduser()
    if local.is_file() and same_data:
        return [
            f"eval: {path} is one data file, the one the run trains on; name a held-out file "
            "as eval.path"
        ]
    listing = local / "dataset_dict.json"
    if listing.is_file():
        try:
            splits = json.loads(listing.read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            return []
        if split not in splits:
            return [f"eval.split: {path} has no split {split!r} (it has {', '.join(splits)})"]
    return []


def _vllm(r: Recipe) -> bool:
    """Whether the generators are vLLM's: set so, or auto on GPUs."""
    return r.generator.backend == "vllm" or (r.generator.backend == "auto" and not r.cpu)


def lora_shape_errors(lora: Any, arch: Arch, fam: str, size: str) -> list[str]:
    """model.lora against the architecture: its targets the family's projections, its rank
    at most the hidden size (GRPO and SFT recipes alike)."""
    errors = []
    listed = [] if lora.targets == ALL_LINEAR else lora.targets
    unknown = [name for name in listed if name not in LORA_TARGETS]
    if unknown:
        errors.append(
            f"model.lora.targets: '{unknown[0]}' is not a {fam} projection "
            f"({', '.join(LORA_TARGETS)}, or {ALL_LINEAR})"
        )
    if lora.rank > arch.dim:
        errors.append(
            f"model.lora.rank: {lora.rank} exceeds the {fam} {size} hidden size {arch.dim}"
        )
    return errors


def _lora_errors(r: Recipe) -> list[str]:
    """model.lora against the architecture and the services it needs, and a reference in the
    trainer's processes (a LoRA run's) against the settings that do not compose with it."""
    lora, ref, fam, size = r.model.lora, r.layout.reference, r.model.family, r.model.size
    errors = []
    for key in ("lora_dual_stream", "lora_specialize_active"):
        if not getattr(r.generator, key):
            continue
        if lora is None:
            errors.append(
                f"generator.{key}: tunes vLLM's LoRA kernels, and this recipe trains every "
                "parameter (no model.lora); leave it false"
            )
        elif not _vllm(r):
            errors.append(
                f"generator.{key}: tunes vLLM's LoRA kernels, and this recipe's generators are "
                "transformers' (generator.backend hf, or a CPU recipe); leave it false"
            )
    if lora is not None:
        errors += lora_shape_errors(lora, r.arch, fam, size)
        if lora.rank > VLLM_LORA_RANKS[-1] and lora.rank <= r.arch.dim and _vllm(r):
            errors.append(
                f"model.lora.rank: {lora.rank} exceeds {VLLM_LORA_RANKS[-1]}, the largest LoRA "
                "rank vLLM serves (the GPU generator); lower it"
            )
        if r.arch.vocab_size < r.arch.dim and _vllm(r):
            # vLLM 0.24 warms its LoRA layers up with a dummy adapter on the output head too,
            # sized by the hidden size along the vocabulary (a copy that fails when it is larger)
            errors.append(
                f"model.lora: vLLM serves LoRA only for a vocabulary at least the hidden size "
                f"(the {fam} {size} model has {r.arch.vocab_size} tokens, hidden size "
                f"{r.arch.dim}); set generator.backend=hf"
            )
        if r.weight_sync.push_buffer == "groups":
            errors.append(
                "weight_sync.push_buffer: groups streams a full model's blocks; a LoRA version "
                "is the adapter alone and goes whole; leave it auto"
            )
        if ref.enabled and not ref.in_trainer:
            errors.append(
                "layout.reference.device: a LoRA run's reference is its base with the adapter "
                "off, in the trainer's processes; set layout.reference.device=trainer (or "
                "layout.reference.enabled=false)"
            )
    elif ref.in_trainer:
        errors.append(
            "layout.reference.device: trainer scores the reference as the base with the "
            "adapter off, which only a LoRA run has (model.lora); set "
            "layout.reference.device=gpu (or cpu)"
        )
    if not ref.in_trainer:
        return errors
    # the reference runs on the trainer's ranks and GPUs: settings of its own would do nothing
    where = "a reference in the trainer's processes"
    if ref.gpus != 1:
        errors.append(
            f"layout.reference.gpus: {where} takes no GPU of its own (it runs on the "
            f"trainer's); set it to 1, got {ref.gpus}"
        )
    if ref.spread:
        errors.append(
            f"layout.reference.spread: {where} runs on every trainer GPU already; set it to false"
        )
    if r.reference.ranks != "auto":
        errors.append(
            f"reference.ranks: {where} runs on the trainer's ranks (trainer.ranks); leave it "
            f"auto, got {r.reference.ranks}"
        )
    if r.reference.compile != "auto":
        errors.append(
            f"reference.compile: {where} runs the trainer's model, compiled as trainer.compile "
            "says; leave it auto"
        )
    if r.layout.mps_sm_percent.reference < 100:
        errors.append(
            f"layout.mps_sm_percent.reference: {where} runs under the trainer's share "
            "(layout.mps_sm_percent.trainer); leave it 100"
        )
    return errors


def unread_model_errors(model: Any) -> list[str]:
    """model.hf_id naming a model folder (local or in a bucket) that nothing reads: random
    weights with a tokenizer of their own take neither from it. Said rather than ignored: a
    run meant to start from an SFT run's model would start from random weights."""
    named = looks_local(model.hf_id) or is_url(model.hf_id)
    if named and model.init == "random" and model.tokenizer is not None:
        return [
            f"model.hf_id: {model.hf_id!r} is a model folder, but model.init is random and "
            "model.tokenizer is set, so nothing reads it; add --set model.init=hub to start "
            "from its weights"
        ]
    return []


def _consistency_errors(r: Recipe) -> list[str]:
    fam, size = r.model.family, r.model.size
    if (fam, size) not in ARCHITECTURES:
        return [f"model.size: unknown {fam} size '{size}'; known sizes: {', '.join(sizes(fam))}"]
    arch = r.arch
    errors = _episode_errors(r) + unread_model_errors(r.model)
    if r.model.thinking is not None and fam != "qwen3":
        errors.append(
            f"model.thinking: {fam} models have no thinking mode (Qwen3 has); leave it unset"
        )
    errors += _lora_errors(r)
    seq = r.grpo.max_prompt_tokens + r.grpo.max_response_tokens
    if seq > arch.max_seq_len:
        errors.append(
            f"grpo.max_prompt_tokens + grpo.max_response_tokens: {seq} exceeds the "
            f"{fam} {size} context of {arch.max_seq_len} tokens"
        )
    g = r.grpo
    mean = r.dataset.prompt_tokens_mean
    if mean is not None and mean > g.max_prompt_tokens:
        errors.append(
            f"dataset.prompt_tokens_mean: {mean} exceeds grpo.max_prompt_tokens "
            f"{g.max_prompt_tokens} (prompts are cut to it)"
        )
    mean = r.dataset.response_tokens_mean
    if mean is not None and mean > g.max_response_tokens:
        errors.append(
            f"dataset.response_tokens_mean: {mean} exceeds grpo.max_response_tokens "
            f"{g.max_response_tokens} (completions stop at it)"
        )
    errors += _eval_errors(r)
    if r.env is not None and (r.env.max_episode_tokens or 0) > arch.max_seq_len:
        errors.append(
            f"env.max_episode_tokens: {r.env.max_episode_tokens} exceeds the {fam} {size} "
            f"context of {arch.max_seq_len} tokens"
        )
    elif r.env is not None and (r.env.max_episode_tokens or 0) > seq:
        errors.append(
            f"env.max_episode_tokens: {r.env.max_episode_tokens} exceeds grpo.max_prompt_tokens "
            f"+ grpo.max_response_tokens ({seq}), the longest sequence the generator's context "
            "and the memory plan hold: raise those instead"
        )
    if g.overlong_buffer > g.max_response_tokens:
        errors.append(
            f"grpo.overlong_buffer_tokens: {g.overlong_buffer} exceeds grpo.max_response_tokens "
            f"{g.max_response_tokens}"
        )
    if g.kl_placement == "reward" and not r.layout.reference.enabled and g.kl_beta:
        errors.append("grpo.kl_placement: reward needs a reference (layout.reference.enabled)")
    if g.steps_per_call > g.max_policy_age + 1:
        errors.append(
            f"grpo.steps_per_call: {g.steps_per_call} needs grpo.max_policy_age >= "
            f"{g.steps_per_call - 1} (the call's last step is trained on that many versions "
            f"later), got {g.max_policy_age}"
        )
    lay = r.layout
    tps = [("layout.generator.tp", lay.generator.tp)]
    ref = lay.reference
    if ref.enabled and (r.cpu or ref.device == "cpu") and ref.gpus != 1:
        errors.append(
            f"layout.reference.gpus: a reference on the CPU takes no GPU; set it to 1 "
            f"(reference.ranks sets its processes), got {ref.gpus}"
        )
    elif ref.enabled and ref.gpus > r.resources.gpus_per_node:
        errors.append(
            f"layout.reference.gpus: {ref.gpus} exceeds resources.gpus_per_node "
            f"{r.resources.gpus_per_node}; the reference's GPUs must sit on one node"
        )
    rranks = r.reference.ranks
    if ref.on_gpu and not r.cpu and rranks != "auto" and rranks != ref.gpus:
        errors.append(
            f"reference.ranks: {rranks} must be auto or layout.reference.gpus ({ref.gpus}): "
            "one reference process per GPU"
        )
    for path, tp in tps:
        if arch.n_heads % tp or arch.n_kv_heads % tp:
            errors.append(
                f"{path}: {tp} must divide the {fam} {size} head counts "
                f"(n_heads {arch.n_heads}, n_kv_heads {arch.n_kv_heads})"
            )
        elif r.cpu and tp != 1:
            errors.append(f"{path}: must be 1 on accelerator cpu, got {tp}")
        elif tp > r.resources.gpus_per_node:
            errors.append(
                f"{path}: {tp} exceeds resources.gpus_per_node {r.resources.gpus_per_node}; "
                "a tensor-parallel group must sit on one node"
            )
    limited = lay.mps_sm_percent.limited()
    if limited and lay.sharing != "mps":
        name = limited[0][0]
        errors.append(
            f"layout.mps_sm_percent.{name}: a share of the SMs applies under layout.sharing mps "
            "(services calling a GPU at once); with turns each call has the whole GPU"
        )
    t = lay.trainer
    if r.cpu and t.gpus != 1:
        errors.append(
            f"layout.trainer.gpus: must be 1 on accelerator cpu (trainer.ranks sets its "
            f"processes), got {t.gpus}"
        )
    ranks = r.trainer.ranks
    if not r.cpu and ranks != "auto" and ranks != t.gpus:
        errors.append(
            f"trainer.ranks: {ranks} must be auto or layout.trainer.gpus ({t.gpus}): one "
            "trainer process per GPU"
        )
    if errors:
        return errors
    return memory_errors(r, estimate_memory(r))
