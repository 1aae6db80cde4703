"""Byte layout of a published policy version: a state dict as a few 1-D uint8 buckets.

Tensors are grouped by dtype (in order of first appearance); each dtype's tensors lie end to end,
in state-dict order, in one byte stream that is cut into buckets of ``bucket_bytes`` (rounded
down to whole elements). A tensor that does not fit in what is left of a bucket continues at
offset 0 of the next one, so every bucket respects the cap. Each bucket holds one dtype and its
boundaries fall on element boundaries, so a tensor inside one bucket is a view of its bytes; one
that spans buckets is copied together when fetched. Bytes are moved as uint8, so every dtype
(bfloat16 included) round-trips bit-exactly.

Pure torch, no store: :mod:`runtime.weights.store` moves the buckets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

# On the Monarch RPC path a few large messages are slow and many small keys pay per-key RPCs:
# publish plus fetch of 800 MB in 300 tensors between two procs (2 shared CPU cores, one noisy
# run each) took 1.9-2.0 s in 32 MiB buckets, 2.8-3.4 s in 16 MiB, 5.2-6.0 s in 64 MiB,
# 9.7-10.7 s in 256 MiB, and 3.5-4.4 s with one key per tensor.
BUCKET_BYTES = 32 * 2**20


class TensorEntry(NamedTuple):
    """Where one tensor starts: byte ``offset`` of ``bucket`` (-1 for a tensor with no bytes)."""

    bucket: int
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * parse_dtype(self.dtype).itemsize


class Segment(NamedTuple):
    """``length`` bytes of tensor ``name`` from its byte ``src`` at byte ``dst`` of a bucket."""

    name: str
    src: int
    dst: int
    length: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in manifest")
    return dtype


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_buckets(
    state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> tuple[dict[str, TensorEntry], list[int]]:
    """Place each tensor: ``({name: entry} in state-dict order, [bucket sizes in bytes])``."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in state_dict.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    entries: dict[str, TensorEntry] = {}
    sizes: list[int] = []
    for dtype, names in by_dtype.items():
        # Cut on element boundaries, so that each offset in a bucket can be viewed as ``dtype``.
        chunk = max(bucket_bytes // dtype.itemsize, 1) * dtype.itemsize
        first, pos = len(sizes), 0
        for name in names:
            tensor = state_dict[name]
            where = (first + pos // chunk, pos % chunk) if tensor.numel() else (-1, 0)
            entries[name] = TensorEntry(
                *where, tensor.numel(), tuple(tensor.shape), dtype_name(dtype)
            )
            pos += nbytes(tensor)
        sizes += [chunk] * (pos // chunk) + ([pos % chunk] if pos % chunk else [])
    return {name: entries[name] for name in state_dict}, sizes


def bucket_segments(entries: Mapping[str, TensorEntry], sizes: list[int]) -> list[list[Segment]]:
    """For each bucket, the pieces of tensors it holds, in byte order."""
    segments: list[list[Segment]] = [[] for _ in sizes]
    for name, entry in entries.items():
        src, dst, bucket, left = 0, entry.offset, entry.bucket, entry.nbytes
        while left:
            if not 0 <= bucket < len(sizes) or dst >= sizes[bucket]:
                raise ValueError(f"manifest places {name!r} outside its buckets")
            length = min(left, sizes[bucket] - dst)
            segments[bucket].append(Segment(name, src, dst, length))
            src, dst, bucket, left = src + length, 0, bucket + 1, left - length
    for pieces in segments:
        pieces.sort(key=lambda s: s.dst)
    return segments


def _typed_view(bucket: torch.Tensor, dst: int, entry: TensorEntry) -> torch.Tensor:
    """The whole tensor at byte ``dst`` of ``bucket``, with its dtype and shape (no copy)."""
    raw = bucket[dst : dst + entry.nbytes]
    return raw.view(parse_dtype(entry.dtype)).view(entry.shape)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes in row-major order (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops single-threaded, then restore the thread count (per thread under OpenMP).

    Each parallel copy waits for all its worker threads; where cores are oversubscribed some
    are descheduled, so packing 100 MB from 300 CPU tensors took 0.8-3.5 s with 2 threads and
    0.11-0.19 s with 1 on 2 shared cores. A copy is memory-bound: one thread loses little.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Packer:
    """Builds the buckets of one state dict, one at a time (publish side)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> None:
        self.state_dict = state_dict
        self.entries, self.sizes = plan_buckets(state_dict, bucket_bytes)
        self.segments = bucket_segments(self.entries, self.sizes)
        # Bytes of tensors split across buckets, kept until their last piece is packed.
        self._split: dict[str, torch.Tensor] = {}

    def bucket(self, index: int) -> torch.Tensor:
        """Bucket ``index`` as a new CPU uint8 tensor holding exactly its bytes."""
        bucket = torch.empty(self.sizes[index], dtype=torch.uint8)
        with torch.no_grad(), one_intra_op_thread():
            for name, src, dst, length in self.segments[index]:
                entry, tensor = self.entries[name], self.state_dict[name]
                if length == entry.nbytes:
                    # A same-dtype copy moves the bits as they are (from GPU or a strided view).
                    _typed_view(bucket, dst, entry).copy_(tensor.detach())
                    continue
                if name not in self._split:
                    self._split[name] = _flat_bytes(tensor)
                bucket[dst : dst + length].copy_(self._split[name][src : src + length])
                if src + length == entry.nbytes:
                    del self._split[name]
        return bucket


class Unpacker:
    """Rebuilds the tensors of one version from its buckets, in any order (fetch side).

    A tensor inside one bucket becomes a view of it, or is copied into ``into[name]``; one split
    across buckets is copied together into ``into[name]`` (when contiguous) or a new tensor.
    """

    def __init__(
        self,
        entries: dict[str, TensorEntry],
        sizes: list[int],
        into: Mapping[str, torch.Tensor],
    ) -> None:
        self.entries, self.sizes, self.into = entries, sizes, into
        self.segments = bucket_segments(entries, sizes)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, entry in entries.items():
            if entry.nbytes and entry.offset + entry.nbytes <= sizes[entry.bucket]:
                continue  # inside one bucket
            target = into.get(name)
            if target is None or not target.is_contiguous():
                target = torch.empty(entry.shape, dtype=parse_dtype(entry.dtype))
            self.tensors[name] = target

    def add(self, index: int, bucket: torch.Tensor) -> None:
        """Take in bucket ``index`` as fetched."""
        size = self.sizes[index]
        is_bytes = isinstance(bucket, torch.Tensor) and bucket.dtype == torch.uint8
        if not is_bytes or tuple(bucket.shape) != (size,):
            raise ValueError(f"bucket {index} is not the {size}-byte uint8 tensor of its manifest")
        # no_grad: ``into`` may hold a model's parameters.
        with torch.no_grad(), one_intra_op_thread():
            for name, src, dst, length in self.segments[index]:
                entry = self.entries[name]
                if length == entry.nbytes:
                    view = _typed_view(bucket, dst, entry)
                    self.tensors[name] = self.into[name].copy_(view) if name in self.into else view
                else:
                    target = _flat_bytes(self.tensors[name])
                    target[src : src + length].copy_(bucket[dst : dst + length])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, in manifest order, once every bucket was added."""
        with torch.no_grad(), one_intra_op_thread():
            for name, target in self.into.items():
                if self.tensors[name] is not target:
                    self.tensors[name] = target.copy_(self.tensors[name])
        return {name: self.tensors[name] for name in self.entries}
