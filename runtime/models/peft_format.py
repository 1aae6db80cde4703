"""A LoRA adapter in PEFT's format: what `peft.PeftModel.from_pretrained` and vLLM's LoRA loading
read, and the merge of an adapter into its base.

An adapter folder holds `adapter_model.safetensors` (for each targeted projection of each block,
`lora_A` of shape rank x in and `lora_B` of shape out x rank, under PEFT's names such as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), `adapter_config.json` (rank,
alpha, the targeted projections, the base model) and, when forgesky wrote it, `forgesky.json`
with the recipe (what `forgesky eval` reads). The targeted projection computes
W0 x + (alpha / rank) B A x, so merging sets W = W0 + (alpha / rank) B A. Qwen3 and Llama 3 name
their projections alike on the Hugging Face side, so one naming serves both families.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from recipes import UserError
from recipes.names import LORA_TARGETS
from recipes.run_sections import Lora
from runtime.models.spec import ModelSpec

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
RECORD_FILE = "forgesky.json"

# PEFT wraps the causal LM (`base_model`) around the transformers model (`model`), whose decoder
# is `model` again: hence the doubled name.
PREFIX = "base_model.model."
_BLOCK_PART = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.\w+\.(\w+))\.lora_([AB])\.weight$")


def module_name(layer: int, target: str) -> str:
    """The HF module path of projection `target` in block `layer`."""
    return f"model.layers.{layer}.{_BLOCK_PART[target]}.{target}"


def adapter_key(layer: int, target: str, which: str) -> str:
    """PEFT's name of the `which` ("A" or "B") matrix on `target` in block `layer`."""
    return f"{PREFIX}{module_name(layer, target)}.lora_{which}.weight"


def is_adapter_key(name: str) -> bool:
    """Whether `name` is an adapter matrix under PEFT's naming."""
    return _KEY.match(name) is not None


def adapter_only(names: Iterable[str]) -> bool:
    """Whether a version's `names` are the adapter alone (True) or base weights alone (False);
    KeyError for a version that mixes the two (a bug of whoever sent it)."""
    adapter, base = [], []
    for name in names:
        (adapter if is_adapter_key(name) else base).append(name)
    if adapter and base:
        raise KeyError(
            f"a version mixes adapter matrices ({adapter[0]}) with base weights ({base[0]})"
        )
    return bool(adapter)


def base_weight_name(key: str) -> str:
    """The HF name of the weight an adapter matrix `key` adds to."""
    match = _KEY.match(key)
    if match is None:
        raise KeyError(f"{key!r} is not a LoRA adapter key")
    return f"{match.group(1)}.weight"


def projection_shape(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(out, in) of projection `target`: the shape of its HF weight."""
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return {
        "q_proj": (q, spec.dim),
        "k_proj": (kv, spec.dim),
        "v_proj": (kv, spec.dim),
        "o_proj": (spec.dim, q),
        "gate_proj": (spec.ffn_dim, spec.dim),
        "up_proj": (spec.ffn_dim, spec.dim),
        "down_proj": (spec.dim, spec.ffn_dim),
    }[target]


@functools.lru_cache(maxsize=8)
def _layout(spec: ModelSpec, rank: int, modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    layout: dict[str, tuple[int, int]] = {}
    for layer in range(spec.n_layers):
        for target in modules:
            out, inp = projection_shape(spec, target)
            layout[adapter_key(layer, target, "A")] = (rank, inp)
            layout[adapter_key(layer, target, "B")] = (out, rank)
    return layout


def adapter_layout(spec: ModelSpec, lora: Lora) -> dict[str, tuple[int, int]]:
    """Every adapter matrix of `lora` on a model of `spec`, name -> shape, block by block."""
    return dict(_layout(spec, lora.rank, tuple(lora.modules)))


def check_adapter(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, lora: Lora) -> None:
    """KeyError unless `tensors` are exactly `lora`'s matrices on `spec`, with their shapes."""
    layout = _layout(spec, lora.rank, tuple(lora.modules))  # made once: checked every version
    if tensors.keys() != layout.keys():
        missing = sorted(layout.keys() - tensors.keys())
        unexpected = sorted(tensors.keys() - layout.keys())
        raise KeyError(
            f"the adapter does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, shape in layout.items():
        if tuple(tensors[name].shape) != shape:
            raise KeyError(
                f"the adapter does not fit: {name} has shape {tuple(tensors[name].shape)}, "
                f"the model's is {shape}"
            )


def _alpha(lora: Lora) -> int | float:
    alpha = lora.scaling_alpha
    return int(alpha) if float(alpha).is_integer() else alpha


def adapter_config(lora: Lora, base_id: str | None) -> dict[str, Any]:
    """The `adapter_config.json` of `lora` on the base `base_id` (None: a random init, which no
    name finds again)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_id,
        "r": lora.rank,
        "lora_alpha": _alpha(lora),
        "lora_dropout": 0.0,
        "target_modules": list(lora.modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def lora_of(config: Mapping[str, Any], where: str) -> Lora:
    """The LoRA an `adapter_config.json` describes, as a recipe section; UserError (naming
    `where`) for an adapter forgesky cannot apply the same way PEFT would."""
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    # what PEFT can express and forgesky's merge and vLLM would not apply the same way
    plain = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none"}
    odd_fields = [k for k, v in plain.items() if config.get(k, v) != v]
    odd_fields += [k for k in ("modules_to_save", "rank_pattern", "alpha_pattern") if config.get(k)]
    if odd_fields:
        what = odd_fields[0]
        raise UserError(f"{where}: {what}={config[what]!r} is not a plain LoRA; not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise UserError(
            f"{where}: target_modules {targets!r} is not a list of projection names "
            f"({', '.join(LORA_TARGETS)})"
        )
    odd = [t for t in targets if t not in LORA_TARGETS]
    if odd:
        raise UserError(
            f"{where}: target_modules has {odd[0]!r}; the projections are {', '.join(LORA_TARGETS)}"
        )
    try:
        return Lora(rank=config["r"], alpha=config.get("lora_alpha"), targets=sorted(set(targets)))
    except (KeyError, ValueError) as e:
        raise UserError(f"{where}: r and lora_alpha must be positive numbers ({e!r})") from None


def write_adapter_folder(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor],
    lora: Lora,
    base_id: str | None,
    recipe_config: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write the adapter `tensors` (PEFT names, written in their own dtype) into `folder`
    (replaced if it exists) through `<folder>.partial` and a rename, so a folder that exists is
    whole; with `recipe_config`, also forgesky.json (`provenance` and the recipe)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        # safetensors refuses views into a larger buffer (what a flat published version is)
        own = {k: _own(v.detach().to("cpu")) for k, v in tensors.items()}
        save_file(own, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        config = adapter_config(lora, base_id)
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if recipe_config is not None:
            record = {**(provenance or {}), "recipe_config": recipe_config}
            (partial / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        for file in partial.iterdir():
            file.chmod(0o644)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder


def read_adapter_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the adapter's tensors under PEFT names, its adapter_config.json)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    return load_file(str(folder / WEIGHTS_FILE), device="cpu"), config


def _own(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter as base weight name -> (A, B); KeyError for a matrix without its partner."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        which = _KEY.match(key)
        if which is None:
            raise KeyError(f"{key!r} is not a LoRA adapter key")
        found.setdefault(base_weight_name(key), {})[which.group(3)] = tensor
    half = [name for name, ab in found.items() if len(ab) != 2]
    if half:
        raise KeyError(f"the adapter has only one of lora_A/lora_B for {half[0]}")
    return {name: (ab["A"], ab["B"]) for name, ab in found.items()}


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling x B A, in fp32 (what the adapter adds to its weight)."""
    return (b.float() @ a.float()) * scaling


def merged(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W0 + scaling x B A computed in fp32, in W0's dtype and device."""
    return (w0.float() + delta(a, b, scaling).to(w0.device)).to(w0.dtype)


def merge(
    state: Mapping[str, torch.Tensor],
    adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> dict[str, torch.Tensor]:
    """`state` (HF names: a whole model or one group of it) with the adapter (`pairs`) merged
    into the weights it holds; other weights are passed through untouched."""
    out = dict(state)
    for name, weight in state.items():
        if name in adapter:
            a, b = adapter[name]
            out[name] = merged(weight, a, b, scaling)
    return out


def merge_groups(
    groups: Iterable[Mapping[str, torch.Tensor]],
    tensors: Mapping[str, torch.Tensor],
    lora: Lora,
) -> Iterator[dict[str, torch.Tensor]]:
    """`merge` over a base handed out a group at a time; KeyError at the end when a weight the
    adapter targets never came."""
    adapter = pairs(tensors)
    done: set[str] = set()
    for group in groups:
        done.update(adapter.keys() & group.keys())
        yield merge(group, adapter, lora.scaling)
    never = sorted(adapter.keys() - done)
    if never:
        raise KeyError(f"the base has no weight {never[0]} that the adapter targets")
