"""Loading pretrained weights: Hugging Face Hub (or a local HF folder) → safetensors → TorchTitan."""

from __future__ import annotations

import abc
import contextlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from recipes.errors import UserError
from runtime.models.hf import from_hf
from runtime.models.spec import ModelSpec

# config.json keys that must agree with the spec for the weights to fit the model.
_CONFIG_CHECKS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
}


def snapshot(hf_id: str, token: str | None = None, revision: str | None = None) -> Path:
    """A local folder with the model's config and safetensors: `hf_id` itself if it is a folder,
    otherwise a Hugging Face Hub download (cached)."""
    local = Path(hf_id).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from runtime.hub import UNREACHABLE, quiet_retries

    try:
        with quiet_retries() as failed_requests:
            path = snapshot_download(
                hf_id,
                revision=revision,
                token=token,
                allow_patterns=["*.safetensors", "*.json"],
            )
    except LocalEntryNotFoundError as e:  # no network, and not in the cache
        why = failed_requests[0] if failed_requests else str(e).splitlines()[0]
        why = why.removeprefix("Got: ")
        raise UserError(
            f"model {hf_id}: {UNREACHABLE} ({why}) and the model is "
            "not in the local cache; check the network, or set model.hf_id to a local folder"
        ) from None
    except GatedRepoError as e:
        raise UserError(
            f"model {hf_id} is gated: accept its licence on huggingface.co and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise UserError(
            f"model {hf_id} not found on the Hugging Face Hub (or it is private: set HF_TOKEN)"
        ) from e
    return Path(path)


def load_hf_state_dict(
    hf_id: str, token: str | None = None, revision: str | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under its HF name (the generator's format)."""
    return _read_safetensors(snapshot(hf_id, token, revision), hf_id)


def _read_safetensors(folder: Path, hf_id: str) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"model {hf_id}: no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def check_config(folder: Path, spec: ModelSpec, hf_id: str) -> None:
    """Fail with one line if the checkpoint's config.json disagrees with the architecture."""
    config_path = folder / "config.json"
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    for hf_key, field_name in _CONFIG_CHECKS.items():
        if hf_key in config and config[hf_key] != getattr(spec, field_name):
            raise UserError(
                f"model {hf_id}: config.json has {hf_key}={config[hf_key]} but the recipe's "
                f"architecture has {field_name}={getattr(spec, field_name)}; fix model.size"
            )


def load_pretrained(
    hf_id: str, spec: ModelSpec, token: str | None = None, revision: str | None = None
) -> dict[str, torch.Tensor]:
    """TorchTitan-named weights of `hf_id` for a model built from `spec`."""
    folder = snapshot(hf_id, token, revision)
    check_config(folder, spec, hf_id)
    return from_hf(_read_safetensors(folder, hf_id), spec)


# --- streaming: weights into a (sharded) model one block at a time ---------------------------

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _group_key(name: str) -> int:
    """-1 for tensors outside the blocks (embedding, final norm, output projection), else the
    block's index: the order a source hands its groups out."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


class WeightSource(abc.ABC):
    """A model's first weights, handed out a group at a time under TorchTitan names: first the
    tensors outside the blocks, then one transformer block per group. A loader never holds more
    than one group (`load_into`); `state_dict()` is everything at once, for the single-process
    CPU backends."""

    @abc.abstractmethod
    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """The groups, in order (TorchTitan names, CPU tensors)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for group in self.groups():
            out.update(group)
        return out


class GivenWeights(WeightSource):
    """TorchTitan-named tensors already in memory (a test's model, an evaluated checkpoint)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = dict(state)

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        by_group: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in self.state.items():
            by_group.setdefault(_group_key(name), {})[name] = tensor
        for key in sorted(by_group):
            yield by_group[key]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)


class SeededWeights(WeightSource):
    """`init: random`: the seeded initialisation `build_model(spec, seed=seed)` gives on the CPU,
    the same whatever the rank count, device or dtype the model is then laid out in (a trainer
    on two ranks and a reference on one start from the same numbers). Built whole in fp32 on
    the host by each process that loads it (tests and benchmarks: 4 bytes a parameter)."""

    def __init__(self, spec: ModelSpec, seed: int):
        self.spec, self.seed = spec, seed

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        from runtime.models.titan import build_model

        model = build_model(self.spec, device="cpu", dtype=torch.float32, seed=self.seed)
        yield from GivenWeights(model.state_dict()).groups()


class HFWeights(WeightSource):
    """A Hugging Face checkpoint folder: its safetensors are memory-mapped and read one block at
    a time (each tensor converted to TorchTitan's layout as it is read), so no process ever
    holds the whole model in host memory."""

    def __init__(self, folder: Path, spec: ModelSpec, hf_id: str):
        self.folder, self.spec, self.hf_id = folder, spec, hf_id
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise UserError(f"model {hf_id}: no *.safetensors weights in {folder}")

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        from safetensors import safe_open

        from runtime.models.hf import from_hf_part

        with contextlib.ExitStack() as stack:
            handles = [
                stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in self.files
            ]
            where: dict[int, list[tuple[str, Any]]] = {}
            for handle in handles:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    where.setdefault(_group_key(name), []).append((name, handle))
            for key in sorted(where):
                part = {name: handle.get_tensor(name) for name, handle in where[key]}
                yield from_hf_part(part, self.spec)


def weight_source(
    hf_id: str, spec: ModelSpec, token: str | None = None, revision: str | None = None
) -> HFWeights:
    """The checkpoint `hf_id` (a local folder, else downloaded from the Hub) as a source."""
    folder = snapshot(hf_id, token, revision)
    check_config(folder, spec, hf_id)
    return HFWeights(folder, spec, hf_id)


def as_source(
    weights: WeightSource | Mapping[str, torch.Tensor] | None,
    spec: ModelSpec,
    seed: int,
    lora: Any = None,
) -> WeightSource:
    """What a backend's `weights` argument means: a source, a state dict, or the seeded init;
    with `lora` (a recipe's model.lora), followed by the adapter's first weights where they
    do not give them (`AdapterInit`, seeded by `seed` too)."""
    if weights is None:
        source: WeightSource = SeededWeights(spec, seed)
    elif isinstance(weights, WeightSource):
        source = weights
    else:
        source = GivenWeights(weights)
    if lora is None:
        return source
    return AdapterInit(source, spec, lora, seed)


def _merge_fused(model: torch.nn.Module, group: dict[str, torch.Tensor]) -> None:
    """q/k/v (how checkpoints name them) into the fused projection the model holds, with the
    fused module's own load hook (the conversion TorchTitan's `load_state_dict` applies)."""
    for name in [n for n in group if n.endswith(".wq.weight")]:
        prefix = name[: -len("wq.weight")]
        module = model.get_submodule(prefix[:-1])
        merge = getattr(type(module), "_merge_qkv_on_load", None)
        if merge is not None:
            merge(module, group, prefix)


def _local_piece(target: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the storage this process holds of `target`, the part of `full` that belongs there)."""
    if not hasattr(target, "device_mesh"):
        return target, full
    mesh, piece = target.device_mesh, full
    for axis, placement in enumerate(target.placements):
        if placement.is_shard():
            # DTensor's Shard(d): torch.chunk along d; trailing ranks may hold nothing.
            chunks = torch.chunk(piece, mesh.size(axis), dim=placement.dim)
            index = mesh.get_local_rank(axis)
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return target.to_local(), piece


def load_into(model: torch.nn.Module, source: WeightSource, what: str = "the model") -> None:
    """Copy `source` into `model`'s parameters (plain or FSDP2-sharded), one group at a time;
    each process copies only its own shard. Every parameter must be given, with its shape."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    with torch.no_grad():
        for group in source.groups():
            _merge_fused(model, group)
            for name, full in group.items():
                target = targets.get(name)
                if target is None:
                    raise UserError(f"weights for {what}: {name} is not a parameter of the model")
                if tuple(full.shape) != tuple(target.shape):
                    raise UserError(
                        f"weights for {what}: {name} has shape {tuple(full.shape)}, the model "
                        f"{tuple(target.shape)}"
                    )
                local, piece = _local_piece(target, full)
                if piece.device.type == "cpu" and piece.dtype != local.dtype:
                    # Converted on the host: the copy to the GPU then needs no temporary there.
                    piece = piece.to(local.dtype)
                local.copy_(piece)
                filled.add(name)
            del group
    missing = sorted(set(targets) - filled)
    if missing:
        raise UserError(
            f"weights for {what}: {len(missing)} parameter(s) not given, e.g. {missing[:3]}"
        )


class AdapterInit(WeightSource):
    """The base's weights from `base`, then, as a last group, the adapter's first weights that
    `base` did not give: A as TorchTitan's LoRA draws it (Kaiming uniform, a = sqrt(5)) from a
    generator seeded by `seed` (the recipe's grpo.seed), the same on any rank count; B zeros,
    so the policy starts as the base."""

    def __init__(self, base: WeightSource, spec: ModelSpec, lora: Any, seed: int):
        self.base, self.spec, self.lora, self.seed = base, spec, lora, seed

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        from runtime.models.lora import adapter_shapes

        given: set[str] = set()
        for group in self.base.groups():
            given.update(group)
            yield group
        generator = torch.Generator().manual_seed(self.seed)
        adapter = {}
        for name, shape in adapter_shapes(self.spec, self.lora).items():
            tensor = torch.zeros(shape)
            if name.endswith("lora_a.weight"):
                torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
            if name not in given:
                adapter[name] = tensor
        if adapter:
            yield adapter
