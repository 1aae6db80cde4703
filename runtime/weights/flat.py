"""One flat byte buffer holding a whole policy version: what the direct paths (CUDA IPC, NCCL
push) move. Every tensor starts on a 256-byte boundary, so each is a view of the buffer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runtime.weights.layout import TensorEntry, dtype_name, parse_dtype

ALIGN = 256  # bytes; every tensor of a flat buffer starts on such a boundary


def flat_layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, TensorEntry], int]:
    """Byte offsets of every tensor in one flat buffer (`ALIGN`-aligned); its total size."""
    entries, offset = {}, 0
    for name, tensor in state_dict.items():
        entries[name] = TensorEntry(
            0, offset, tensor.numel(), tuple(tensor.shape), dtype_name(tensor.dtype)
        )
        nbytes = tensor.numel() * tensor.element_size()
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def views(buffer: torch.Tensor, entries: Mapping[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Tensors of `entries` as views into a flat uint8 `buffer` (which may itself be a view of
    a larger one).

    One `as_strided` each, on a view of the buffer per dtype: a LoRA version is hundreds of
    small matrices, each taken as a view twice a version (the sender's copy into the buffer,
    the generator's load from it), and a slice and two views each took twice as long."""
    out = {}
    typed: dict[str, tuple[int, torch.Tensor]] = {}  # by dtype name: cheap to look up
    size = buffer.numel()
    for name, e in entries.items():
        if e.dtype not in typed:
            dtype = parse_dtype(e.dtype)
            typed[e.dtype] = (dtype.itemsize, buffer[: size - size % dtype.itemsize].view(dtype))
        itemsize, whole = typed[e.dtype]
        if e.offset % itemsize or e.offset + e.numel * itemsize > size:
            raise ValueError(
                f"{name} ({e.numel} x {e.dtype} at byte {e.offset}) is not in the buffer"
            )
        stride, step = [], 1
        for dim in reversed(e.shape):
            stride.append(step)
            step *= dim
        out[name] = whole.as_strided(
            e.shape, stride[::-1], whole.storage_offset() + e.offset // itemsize
        )
    return out


def fill(buffer: torch.Tensor, entries: Mapping[str, TensorEntry], state_dict: Any) -> None:
    """Copy `state_dict` into `buffer` at `entries` (asynchronously on a GPU)."""
    targets = views(buffer, entries)
    names = list(targets)
    with torch.no_grad():
        # one multi-tensor copy: a LoRA version is hundreds of small matrices
        torch._foreach_copy_([targets[n] for n in names], [state_dict[n] for n in names], True)


def cast_together(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`tensors` in `dtype`: those of another dtype as views of one new flat buffer, filled by
    one multi-tensor copy (a LoRA version's hundreds of small casts would each allocate and
    launch on their own), those already in `dtype` as they are (as `.to` gives them). Tensors
    on more than one device are cast one by one."""
    moved = [name for name, t in tensors.items() if t.dtype != dtype]
    out = dict(tensors)
    if not moved:
        return out
    if len({tensors[name].device for name in moved}) > 1:
        out.update((name, tensors[name].to(dtype)) for name in moved)
        return out
    sizes = [tensors[name].numel() for name in moved]
    flat = torch.empty(sum(sizes), dtype=dtype, device=tensors[moved[0]].device)
    parts = [p.view(tensors[name].shape) for name, p in zip(moved, flat.split(sizes), strict=True)]
    with torch.no_grad():
        torch._foreach_copy_(parts, [tensors[name] for name in moved])
    out.update(zip(moved, parts, strict=True))
    return out


def indexed(device: torch.device) -> torch.device:
    """`cuda` as the current CUDA device (`cuda:N`): threads need the index to set it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def entries_of(direct: Mapping[str, Any]) -> dict[str, TensorEntry]:
    """The flat layout a manifest's `direct` entry carries (plain tuples on the wire)."""
    return {name: TensorEntry(*fields) for name, fields in direct["tensors"].items()}


def load_flat(backend: Any, flat: torch.Tensor, entries: Mapping[str, TensorEntry]) -> None:
    """Load a version lying in one flat buffer of this process into a generator backend:
    through its own `load_flat` where it has one (vLLM with TP>1: the workers open the buffer
    by CUDA IPC), else from views of the buffer."""
    if hasattr(backend, "load_flat"):
        backend.load_flat(flat, entries)
    else:
        backend.load_weights(views(flat, entries))
