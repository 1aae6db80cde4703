"""Reading a trainer checkpoint (runtime.backends.trainer_state writes it) without a trainer:
what it holds, from its metadata, and its weights for export, evaluation and inspection.

A folder from before DCP (one `trainer.pt`) still reads.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

# The folder inside a checkpoint directory (runtime.control.checkpoint) that DCP writes.
TRAINER_DIR = "trainer"
LEGACY_FILE = "trainer.pt"

# DCP warns that a single process is assumed, which is what no_dist says; a checkpoint
# write's background thread warns too, so the filter is the process's, for that message alone.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


def is_legacy(directory: str | Path) -> bool:
    return (Path(directory) / LEGACY_FILE).exists() and not (Path(directory) / TRAINER_DIR).exists()


def saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the weights a DCP checkpoint holds (its metadata only)."""
    reader = dcp.FileSystemReader(str(Path(directory) / TRAINER_DIR))
    out = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            out[key.removeprefix("model.")] = tuple(meta.size)
    return out


def model_weights(directory: str | Path, spec: Any) -> dict[str, torch.Tensor]:
    """The policy's weights in a checkpoint, as a one-process model of `spec` holds them: full
    fp32 CPU tensors under TorchTitan's checkpoint names (q/k/v split), for export and eval."""
    directory = Path(directory)
    if is_legacy(directory):
        state = torch.load(
            directory / LEGACY_FILE, map_location="cpu", mmap=True, weights_only=True
        )
        return dict(state["model"])
    from runtime.models.titan import materialize, meta_model

    model = materialize(meta_model(spec), "cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        dcp.load({"model": params}, checkpoint_id=str(directory / TRAINER_DIR), no_dist=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


def model_weight_groups(
    directory: str | Path, spec: Any, dtype: torch.dtype = torch.float32
) -> tuple[list[dict[str, torch.Tensor]], Iterator[dict[str, torch.Tensor]]]:
    """`model_weights` a group at a time: (each group's names and shapes as meta tensors, in
    the order the groups come; the groups: the tensors outside the blocks, then each block),
    each group's parameters read from the checkpoint straight into `dtype` when it is asked
    for and given up before the next, so an export of any size holds one block (a legacy
    checkpoint, memory-mapped, comes as one group)."""
    directory = Path(directory)
    if is_legacy(directory):
        whole = model_weights(directory, spec)
        return [{k: v.to("meta") for k, v in whole.items()}], iter([whole])
    from runtime.models.titan import meta_model

    model = meta_model(spec)
    outside = torch.nn.ModuleDict({n: m for n, m in model.named_children() if n != "layers"})
    groups = [("", outside), *((f"layers.{i}.", b) for i, b in model.layers.items())]
    layout = []
    for prefix, module in groups:
        buffers = {prefix + n for n, _ in module.named_buffers()}  # RoPE tables: not stored
        layout.append(
            {
                k: torch.empty(v.shape, dtype=dtype, device="meta")
                for k, v in module.state_dict(prefix=prefix).items()
                if k not in buffers
            }
        )

    def read() -> Iterator[dict[str, torch.Tensor]]:
        for prefix, module in groups:
            # every alias of a parameter (a tied embedding is also the output projection)
            aliases: dict[int, list[tuple[torch.nn.Module, str]]] = {}
            named: dict[str, torch.nn.Parameter] = {}
            for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
                named[name] = param
            for owner in module.modules():
                for leaf, param in owner.named_parameters(recurse=False):
                    aliases.setdefault(id(param), []).append((owner, leaf))
            loaded = {n: torch.empty(p.shape, dtype=dtype) for n, p in named.items()}
            with torch.no_grad():
                dcp.load(
                    {"model": loaded}, checkpoint_id=str(directory / TRAINER_DIR), no_dist=True
                )
            for name, param in named.items():
                real = torch.nn.Parameter(loaded[name], requires_grad=False)
                for owner, leaf in aliases[id(param)]:
                    setattr(owner, leaf, real)
            part = {
                k: v.detach()
                for k, v in module.state_dict(prefix=prefix).items()
                if v.device.type != "meta"  # RoPE tables: computed, not stored
            }
            yield part
            del part, loaded
            for param in named.values():  # back to meta: the block's memory goes
                for owner, leaf in aliases[id(param)]:
                    setattr(owner, leaf, param)

    return layout, read()


def read_all(directory: str | Path) -> dict[str, Any]:
    """Everything the trainer wrote, as full tensors in one nested dict (tests, inspection)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = Path(directory)
    if is_legacy(directory):
        return torch.load(directory / LEGACY_FILE, map_location="cpu", weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(directory / TRAINER_DIR), str(out))
        return torch.load(out, weights_only=False)


def saved_kind(directory: str | Path) -> tuple[str] | tuple[str, int, tuple[str, ...]]:
    """What a checkpoint trained, from its metadata alone: `("lora", rank, targets)` (targets
    as Hugging Face projection names, in recipes.names.LORA_TARGETS' order) for a LoRA
    adapter, else `("full",)` (a checkpoint from before DCP predates LoRA)."""
    if is_legacy(directory):
        return ("full",)
    from recipes.names import LORA_TARGETS
    from runtime.models.lora import HF_NAMES

    shapes = {k: v for k, v in saved_shapes(directory).items() if ".lora_a." in k}
    if not shapes:
        return ("full",)
    ranks = {shape[0] for shape in shapes.values()}
    if len(ranks) != 1:
        raise ValueError(f"checkpoint {directory}: LoRA adapters of ranks {sorted(ranks)}")
    found = {HF_NAMES[k.split(".lora_a.")[0].rsplit(".", 1)[-1]] for k in shapes}
    return ("lora", ranks.pop(), tuple(t for t in LORA_TARGETS if t in found))


def adapter_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The LoRA adapter a checkpoint holds: fp32 CPU tensors under TorchTitan names
    (runtime.models.lora.peft_state gives PEFT's), read into tensors the size of its metadata."""
    shapes = {k: v for k, v in saved_shapes(directory).items() if ".lora_" in k}
    if not shapes:
        raise ValueError(f"checkpoint {directory} holds no LoRA adapter")
    weights = {k: torch.empty(shape) for k, shape in shapes.items()}
    with torch.no_grad():
        dcp.load({"model": weights}, checkpoint_id=str(Path(directory) / TRAINER_DIR), no_dist=True)
    return weights
