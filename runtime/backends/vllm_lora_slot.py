"""A LoRA version written into the GPU slot vLLM already gave the adapter, instead of vLLM
building and activating it anew (TP=1, the engine's one worker in this process).

vLLM's LoRA layers hold every slot's matrices in stacked tensors, one pair per slice of the layer
(q, k, v of a packed `qkv_proj`; gate, up of `gate_up_proj`; a single slice otherwise):
`lora_a_stacked[s]` of shape (max_loras, 1, max_rank, in) and `lora_b_stacked[s]` of shape
(max_loras, 1, out, max_rank). Activating an adapter (`set_lora`) zeroes its slot and copies A
(rank x in) into `[slot, 0, :rank, :in]` and B (out x rank) into `[slot, 0, :out, :rank]`, B
with the scale folded in: vLLM's build casts each matrix to its LoRA dtype and multiplies B by
`vllm_lora_scaling_factor` (alpha / rank; alpha / sqrt(rank) for rsLoRA) in that dtype
(`LoRALayerWeights.optimize`). The built adapter (vLLM's `LoRAModel`) stays registered under its
id: vLLM copies from it again if it ever activates the adapter anew.

`plan_slot` maps each PEFT name of a version, once, to its two homes: the registered
`LoRAModel`'s tensor and the view of the slot. `SlotWrite.write` then puts a version in with
three multi-tensor ops: the version into the registered tensors (cast to the LoRA dtype), the
B's scaled in place, and those into the slot. The slot ends as vLLM's build and `set_lora` of the
same version would leave it, to the bit, and the registered adapter is always the slot's
version. What a version does not write stays as the activation left it, zero: the slot's
padding (ranks past the adapter's; every version must have the shapes of the adapter in the
slot, which is checked) and the LoRA layers it does not target (the embedding's and the output
head's, which vLLM wraps too).

Whatever vLLM's layout does not let this write exactly (a targeted layer of a type whose
`set_lora` slices or splits, tensor parallelism, a name, shape or dtype that differs, a matrix
of the adapter in the slot that the version lacks) raises `NotInPlace` with the reason before
anything is written; `InPlace` (what the generator calls) then says the reason on stderr, once,
and answers None, and the version is registered the ordinary way.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# vLLM 0.24's LoRA layers (vllm/lora/layers/) whose `set_lora`, with TP=1, copies each slice's
# A and B unsliced into `[slot, 0, :rows, :cols]` of that slice's stacked tensors. Exact types:
# a subclass may copy otherwise (MergedColumnParallelLinearVariableSliceWithLoRA splits one B
# into slices; the fully sharded variants slice A or B).
PLAIN_LAYERS = frozenset(
    {
        "ColumnParallelLinearWithLoRA",
        "MergedColumnParallelLinearWithLoRA",
        "QKVParallelLinearWithLoRA",
        "MergedQKVParallelLinearWithLoRA",
        "RowParallelLinearWithLoRA",
        "ReplicatedLinearWithLoRA",
    }
)


class NotInPlace(Exception):
    """Why a version cannot be written into the slot of the adapter before it."""


@dataclass
class SlotWrite:
    """Where each matrix of a version goes: `own[i]` (the registered adapter's tensor) and
    `views[i]` (its place in the slot) take the version's `names[i]`; `scaled` are the B's among
    `own`, multiplied by `scale` as vLLM's build does."""

    lora_id: int
    slot: int
    config: dict[str, Any]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    own: list[Tensor]
    views: list[Tensor]
    scaled: list[Tensor]
    scale: float
    _keys: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._keys = frozenset(self.names)

    def check(self, tensors: Mapping[str, Tensor]) -> None:
        """NotInPlace unless `tensors` have exactly the planned names and shapes."""
        if tensors.keys() != self._keys:
            odd = sorted(self._keys.symmetric_difference(tensors.keys()))
            raise NotInPlace(
                f"the version's matrices are not the adapter's in the slot ({odd[:2]})"
            )
        for name, shape in zip(self.names, self.shapes, strict=True):
            if tensors[name].shape != shape:
                raise NotInPlace(
                    f"{name} has shape {tuple(tensors[name].shape)}, the adapter in the slot {shape}"
                )

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Put `tensors` (PEFT names, any device and float dtype; not modified) in the slot and
        the registered adapter; returns once the copies are done (the sender may reuse its
        memory then)."""
        self.check(tensors)
        sources = [tensors[name] for name in self.names]
        # Inference mode: vLLM may have made its tensors as inference tensors, which accept
        # in-place writes only there.
        with torch.inference_mode():
            torch._foreach_copy_(self.own, sources)
            if self.scale != 1:  # as optimize(): a scale of 1 is left alone
                torch._foreach_mul_(self.scaled, self.scale)
            torch._foreach_copy_(self.views, self.own)
        if self.views and self.views[0].is_cuda:
            torch.cuda.synchronize(self.views[0].device)


def _held(weights: Any, is_a: bool, index: int) -> Tensor | None:
    """The registered adapter's A or B of slice `index` of one vLLM module (a list of them for
    a packed module, one tensor otherwise)."""
    held = weights.lora_a if is_a else weights.lora_b
    if isinstance(held, (list, tuple)):
        return held[index] if index < len(held) else None
    return held if index == 0 else None


def _count(adapter: Mapping[str, Any]) -> int:
    """How many matrices the registered adapter holds."""
    n = 0
    for weights in adapter.values():
        for held in (weights.lora_a, weights.lora_b):
            if isinstance(held, (list, tuple)):
                n += sum(t is not None for t in held)
            else:
                n += held is not None
    return n


def _homes(
    layers: Mapping[str, Any], packed: Mapping[str, Sequence[str]]
) -> dict[str, tuple[str, int]]:
    """Module name of each matrix's module (a packed module's parts by their own names) ->
    (vLLM's LoRA layer name, slice)."""
    homes: dict[str, tuple[str, int]] = {}
    for name in layers:
        for index, part in enumerate(packed.get(name, (name,))):
            homes[part] = (name, index)
    return homes


def _check_layer(name: str, layer: Any, parts: int) -> None:
    """NotInPlace for a layer whose slot this does not write as its `set_lora` would."""
    kind = type(layer).__name__
    if kind not in PLAIN_LAYERS:
        raise NotInPlace(f"{name} is vLLM's {kind}, whose slot is not written in place")
    if getattr(layer, "tp_size", 1) != 1:
        raise NotInPlace(f"{name} is split over {layer.tp_size} GPUs")
    if not len(layer.lora_a_stacked) == len(layer.lora_b_stacked) == parts:
        raise NotInPlace(f"{name} has {len(layer.lora_a_stacked)} slices for {parts} projections")


def plan_slot(
    *,
    lora_id: int,
    slot: int,
    layers: Mapping[str, Any],
    packed: Mapping[str, Sequence[str]],
    adapter: Mapping[str, Any],
    where: Mapping[str, tuple[str, bool]],
    tensors: Mapping[str, Tensor],
    scale: float,
    config: dict[str, Any],
) -> SlotWrite:
    """Where each of `tensors` (a version, PEFT names) goes, for the adapter `lora_id` in GPU
    slot `slot`. From vLLM: `layers` (its LoRA layers by module name: the model manager's
    `modules`), `packed` (a packed module's parts: `packed_modules`), `adapter` (the registered
    `LoRAModel`'s `loras`), `where` (each PEFT name's module and whether it is A:
    `parse_fine_tuned_lora_name`) and `scale` (`vllm_lora_scaling_factor` of `config`, the
    adapter_config). NotInPlace with the reason where the slot cannot take the version as
    vLLM's own activation would put it."""
    homes = _homes(layers, packed)
    names = tuple(tensors)
    shapes, own, views, scaled = [], [], [], []
    taken: set[tuple[str, int, bool]] = set()
    checked: set[str] = set()
    for name in names:
        module, is_a = where[name]
        if module not in homes:
            raise NotInPlace(f"{name}: vLLM has no LoRA layer for {module}")
        layer_name, index = homes[module]
        layer = layers[layer_name]
        if layer_name not in checked:  # only layers the version writes: the others stay zero
            _check_layer(layer_name, layer, len(packed.get(layer_name, (layer_name,))))
            checked.add(layer_name)
        if (layer_name, index, is_a) in taken:
            raise NotInPlace(f"{name}: a second matrix for slice {index} of {layer_name}")
        taken.add((layer_name, index, is_a))
        weights = adapter.get(layer_name)
        held = None if weights is None else _held(weights, is_a, index)
        if held is None:
            raise NotInPlace(f"{name}: the adapter in the slot has none for {layer_name}")
        shape = tuple(tensors[name].shape)
        if tuple(held.shape) != shape or len(shape) != 2:
            raise NotInPlace(
                f"{name} has shape {shape}, the adapter in the slot {tuple(held.shape)}"
            )
        stacked = (layer.lora_a_stacked if is_a else layer.lora_b_stacked)[index]
        rows, cols = shape
        # A fills every input column of its slot and the first `rows` ranks, B every output row
        # and the first `cols` ranks; set_lora left the other ranks zero.
        fits = (
            stacked.dim() == 4
            and stacked.shape[1] == 1
            and 0 <= slot < stacked.shape[0]
            and rows <= stacked.shape[2]
            and cols <= stacked.shape[3]
            and (cols == stacked.shape[3] if is_a else rows == stacked.shape[2])
        )
        if not fits:
            raise NotInPlace(
                f"{name} of shape {shape} does not fill slice {index} of {layer_name}, "
                f"{tuple(stacked.shape)}"
            )
        if held.dtype != stacked.dtype or held.device != stacked.device:
            raise NotInPlace(
                f"{name}: the adapter in the slot is {held.dtype} on {held.device}, the slot "
                f"{stacked.dtype} on {stacked.device}"
            )
        shapes.append(shape)
        own.append(held)
        views.append(stacked[slot, 0, :rows, :cols])
        if not is_a:
            scaled.append(held)
    held_count = _count(adapter)
    if held_count != len(names):
        raise NotInPlace(
            f"the adapter in the slot has {held_count} matrices, the version {len(names)}"
        )
    return SlotWrite(
        lora_id=lora_id,
        slot=slot,
        config=dict(config),
        names=names,
        shapes=tuple(shapes),
        own=own,
        views=views,
        scaled=scaled,
        scale=float(scale),
    )


def _say(line: str) -> None:
    print(f"vLLM generator: {line}", file=sys.stderr, flush=True)


class InPlace:
    """Writes each version into the slot of the adapter before it: `plan(lora_id, tensors,
    config)` makes the `SlotWrite` (on vLLM's worker: runtime.backends.vllm_worker), once per
    adapter. Called with a version, answers the seconds its parts took (`plan_s` when a plan was
    made, `write_s`), or None where the version cannot go in place (the reason said on stderr,
    once per reason): the caller then registers it the ordinary way."""

    def __init__(
        self,
        plan: Callable[[int, Mapping[str, Tensor], dict[str, Any]], SlotWrite],
        say: Callable[[str], None] = _say,
    ):
        self.plan = plan
        self.say = say
        self.current: SlotWrite | None = None
        self.said: set[str] = set()

    def __call__(
        self, lora_id: int, tensors: Mapping[str, Tensor], config: dict[str, Any]
    ) -> dict[str, float] | None:
        parts: dict[str, float] = {}
        plan = self.current
        if plan is None or plan.lora_id != lora_id or plan.config != config:
            self.current = None
            start = time.perf_counter()
            try:
                plan = self.plan(lora_id, tensors, config)
            except NotInPlace as e:
                return self._cannot(str(e))
            except Exception as e:  # noqa: BLE001 (a plan only reads vLLM's private parts)
                return self._cannot(f"vLLM's LoRA manager is not as this reads it ({e!r})")
            parts["plan_s"] = time.perf_counter() - start
            self.current = plan
        start = time.perf_counter()
        try:
            plan.write(tensors)  # checks the version before it writes anything
        except NotInPlace as e:
            self.current = None
            return self._cannot(str(e))
        parts["write_s"] = time.perf_counter() - start
        return parts

    def _cannot(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            self.say(f"a LoRA version goes in by vLLM's add and activate, not in place: {reason}")
