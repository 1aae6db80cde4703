"""LoRA on the TorchTitan side: which projections an adapter wraps, how the model is converted
(TorchTitan's `LoRAConverter`: W x + (alpha / rank) B A x, the base frozen), its first weights,
switching it off, and its names in the two spaces it lives in.

A recipe's `model.lora` (recipes.run_sections.Lora) names its targets as Hugging Face
projections; the model holds them as TorchTitan's:

    q_proj k_proj v_proj o_proj gate_proj up_proj down_proj  ->  wq wk wv wo w1 w3 w2

An adapter's tensors under TorchTitan names (`layers.0.attention.qkv_linear.wq.lora_a.weight`,
`layers.0.feed_forward.w2.lora_b.weight`) are what the trainer holds and checkpoints. Under
PEFT names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
`base_model.model.model.layers.0.mlp.down_proj.lora_B.weight`) they are what generators load,
vLLM reads and an exported adapter folder holds. Two functions convert between them:

- `peft_state(titan_adapter, family, lora, spec) -> dict[str, Tensor]`: TorchTitan -> PEFT;
- `titan_state(peft_adapter, family, lora, spec) -> dict[str, Tensor]`: PEFT -> TorchTitan.

`family` is the model family's name (spec.family). B's rows are the projection's output rows, so
where a family's full weights change layout between the two sides (llama3 permutes q and k to
HF's rotary layout; qwen3 keeps it) B's rows move the same way and A stays as it is. Either
function takes part of an adapter too (one block), and refuses a name or shape that is not
`lora`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from runtime.models.peft_format import adapter_key
from runtime.models.spec import ModelSpec

# Hugging Face projection -> TorchTitan module name (recipes.names.LORA_TARGETS' order)
TITAN_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
HF_NAMES = {titan: hf for hf, titan in TITAN_NAMES.items()}
# where each projection sits in a TorchTitan block (PEFT's side: peft_format.adapter_key)
_TITAN_PLACE = {
    "wq": "attention.qkv_linear",
    "wk": "attention.qkv_linear",
    "wv": "attention.qkv_linear",
    "wo": "attention",
    "w1": "feed_forward",
    "w3": "feed_forward",
    "w2": "feed_forward",
}
_TITAN_KEY = re.compile(
    r"^layers\.(\d+)\.(?:attention\.qkv_linear|attention|feed_forward)\.(\w+)\.lora_([ab])\.weight$"
)
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def titan_targets(lora: Any) -> list[str]:
    """The TorchTitan module names `lora` wraps."""
    return [TITAN_NAMES[name] for name in lora.modules]


def converter(lora: Any) -> Any:
    """TorchTitan's `LoRAConverter` for the recipe's `model.lora`."""
    from torchtitan.components.lora import LoRAConverter

    if lora.dropout:
        raise ValueError(f"LoRA dropout {lora.dropout}: TorchTitan's LoRA has none")
    return LoRAConverter(
        LoRAConverter.Config(
            rank=lora.rank, alpha=lora.scaling_alpha, target_modules=titan_targets(lora)
        )
    )


def _projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a block."""
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    d, f = spec.dim, spec.ffn_dim
    return {
        "wq": (d, q),
        "wk": (d, kv),
        "wv": (d, kv),
        "wo": (q, d),
        "w1": (d, f),
        "w3": (d, f),
        "w2": (f, d),
    }


def adapter_shapes(spec: ModelSpec, lora: Any) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor of `lora` on `spec`, TorchTitan name -> shape, block by block."""
    sizes, out = _projections(spec), {}
    for layer in range(spec.n_layers):
        for target in titan_targets(lora):
            fan_in, fan_out = sizes[target]
            base = f"layers.{layer}.{_TITAN_PLACE[target]}.{target}"
            out[f"{base}.lora_a.weight"] = (lora.rank, fan_in)
            out[f"{base}.lora_b.weight"] = (fan_out, lora.rank)
    return out


def check_converted(model: torch.nn.Module, spec: ModelSpec, lora: Any) -> None:
    """Fail unless the trainable parameters of a converted `model` are exactly `lora`'s adapter
    (TorchTitan's converter only logs a target that matched nothing, and trains nothing)."""
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    expected = adapter_shapes(spec, lora)
    if trainable != expected:
        missing = sorted(expected.keys() - trainable.keys())
        extra = sorted(trainable.keys() - expected.keys())
        raise RuntimeError(
            f"LoRA on {', '.join(lora.modules)}: {sum(math.prod(s) for s in trainable.values())} "
            f"trainable parameters, the adapter has {sum(math.prod(s) for s in expected.values())}"
            f"; not wrapped: {missing[:4]}, trainable but not the adapter's: {extra[:4]}"
        )


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's parameters of a converted `model` (live; DTensors when sharded), by
    TorchTitan name."""
    return {n: p for n, p in model.named_parameters() if ".lora_a." in n or ".lora_b." in n}


class AdapterParameters:
    """`adapter_state` of one model, read every version without walking the whole model: where
    each adapter parameter is registered (its module and attribute) is found once, and each
    call reads what is registered there now (FSDP swaps sharded and gathered parameters in and
    out of their modules; the modules stay)."""

    def __init__(self, model: torch.nn.Module):
        self.places = []
        for name in adapter_state(model):
            owner, _, attr = name.rpartition(".")
            self.places.append((name, model.get_submodule(owner), attr))

    def __call__(self) -> dict[str, Tensor]:
        return {name: module._parameters[attr] for name, module, attr in self.places}


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` as its frozen base: every LoRA projection's scaling 0 (base + 0 * BAx is the
    base's output to the bit), restored on the way out, an exception's too."""
    wrapped = [m for m in model.modules() if hasattr(m, "lora_a") and hasattr(m, "_lora_scaling")]
    if not wrapped:
        raise RuntimeError("adapter_off: the model has no LoRA projection")
    scalings = [m._lora_scaling for m in wrapped]
    for module in wrapped:
        module._lora_scaling = 0.0
    try:
        yield model
    finally:
        for module, scaling in zip(wrapped, scalings, strict=True):
            module._lora_scaling = scaling


@functools.lru_cache(maxsize=8)
def _hf_rows(spec: ModelSpec) -> dict[str, Tensor]:
    """For each attention projection whose output rows the family's HF conversion reorders,
    `rows` with hf_weight = titan_weight[rows], read off the family's own `to_hf` (the rows do
    not depend on the input width, so a width-2 probe suffices)."""
    from runtime.models.hf import to_hf

    narrow = dataclasses.replace(spec, dim=2)
    sizes = _projections(spec)
    probe = {
        f"layers.0.attention.qkv_linear.{t}.weight": torch.arange(sizes[t][1], dtype=torch.float64)[
            :, None
        ].repeat(1, 2)
        for t in ("wq", "wk", "wv")
    }
    hf = to_hf(probe, narrow)
    out = {}
    for target in ("wq", "wk", "wv"):
        rows = hf[f"model.layers.0.self_attn.{HF_NAMES[target]}.weight"][:, 0].long()
        if not torch.equal(rows, torch.arange(len(rows))):
            out[target] = rows
    return out


def _checked(
    name: str, tensor: Tensor, titan_name: str, shapes: dict[str, tuple[int, ...]], lora: Any
) -> None:
    shape = shapes.get(titan_name)
    if shape is None:
        raise KeyError(f"{name} is not a tensor of the LoRA adapter on {', '.join(lora.modules)}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; the adapter's is {shape}")


def _rows(tensor: Tensor, rows: Tensor) -> Tensor:
    return tensor.index_select(0, rows.to(tensor.device))


@functools.lru_cache(maxsize=32)
def _rows_on(spec: ModelSpec, target: str, device: torch.device) -> Tensor:
    """`_hf_rows(spec)[target]` on `device`, copied there once (not once per block a version)."""
    return _hf_rows(spec)[target].to(device)


@functools.lru_cache(maxsize=8)
def _peft_names(
    spec: ModelSpec, rank: int, modules: tuple[str, ...]
) -> dict[str, tuple[str, tuple[int, ...], str | None]]:
    """Every tensor's TorchTitan name -> (its PEFT name, its shape, the target whose B rows move
    to HF's layout, else None), for an adapter of `rank` on `modules`: `peft_state`'s table,
    made once, not per version (a recipe's Lora is not hashable: its targets are a list)."""
    reorder = _hf_rows(spec)
    out = {}
    lora = types.SimpleNamespace(rank=rank, modules=modules)
    for name, shape in adapter_shapes(spec, lora).items():
        match = _TITAN_KEY.match(name)
        assert match is not None, name
        layer, target, side = match.groups()
        moved = target if side == "b" and target in reorder else None
        out[name] = (adapter_key(int(layer), HF_NAMES[target], side.upper()), shape, moved)
    return out


def peft_state(
    titan_adapter: dict[str, Tensor], family: str, lora: Any, spec: ModelSpec
) -> dict[str, Tensor]:
    """An adapter (or part of one) under PEFT's names, B's rows in HF's layout (see the module
    docstring)."""
    if family != spec.family:
        raise ValueError(f"family {family!r} is not the model's ({spec.family!r})")
    names, out = _peft_names(spec, lora.rank, tuple(lora.modules)), {}
    for name, tensor in titan_adapter.items():
        known = names.get(name)
        if known is None:
            if _TITAN_KEY.match(name) is None:
                raise KeyError(f"{name} is not a LoRA adapter tensor's name")
            raise KeyError(
                f"{name} is not a tensor of the LoRA adapter on {', '.join(lora.modules)}"
            )
        peft, shape, moved = known
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; the adapter's is {shape}")
        if moved is not None:
            tensor = tensor.index_select(0, _rows_on(spec, moved, tensor.device))
        out[peft] = tensor
    return out


def titan_state(
    peft_adapter: dict[str, Tensor], family: str, lora: Any, spec: ModelSpec
) -> dict[str, Tensor]:
    """An adapter (or part of one) under PEFT's names, as the TorchTitan model holds it: the
    inverse of `peft_state`."""
    if family != spec.family:
        raise ValueError(f"family {family!r} is not the model's ({spec.family!r})")
    reorder, out, shapes = _hf_rows(spec), {}, adapter_shapes(spec, lora)
    for name, tensor in peft_adapter.items():
        match = _PEFT_KEY.match(name)
        if match is None or match.group(2) not in TITAN_NAMES:
            raise KeyError(f"{name} is not a PEFT LoRA tensor's name")
        layer, hf, side = match.groups()
        target = TITAN_NAMES[hf]
        titan = f"layers.{layer}.{_TITAN_PLACE[target]}.{target}.lora_{side.lower()}.weight"
        _checked(name, tensor, titan, shapes, lora)
        if side == "B" and target in reorder:
            tensor = _rows(tensor, torch.argsort(reorder[target]))
        out[titan] = tensor
    return out
