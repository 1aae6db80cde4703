"""Versioned policy weights on TorchStore: the trainer publishes, generators fetch.

Layout in the store, one key per parameter (HF names are the wire format):

    policy/v000012/model.layers.0.self_attn.q_proj.weight   tensor
    policy/v000012/__manifest__                            {name: (shape, dtype)}, written last

A version exists for readers once its manifest exists: ``publish`` writes every tensor first and
the manifest last, ``drop`` deletes the manifest first. The controller process owns the store
(``start_store`` / ``stop_store``); it hands the returned :class:`WeightStore` (a small picklable
handle, just the store's name) to actors in other proc meshes, which call ``publish`` / ``fetch``
on it. There, torchstore looks its controller actor up by that name with monarch's
``get_or_spawn_controller``: the registry behind it is an actor in the controller process, and
every actor spawned from that process (directly or through its children) holds a reference to
it, so the lookup returns the one controller, which lives in the controller process. Unpickling
the handle imports this module, which applies the torchstore compat patch in that proc.

``publish`` and ``fetch`` speak in plain state dicts and :class:`SyncStats`, not in transport
terms, so a faster byte path (CUDA IPC, NCCL) can sit behind them while TorchStore stays the
index of versions.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from runtime.compat.torchstore import ensure_torchstore_compatible

# Actor procs that only import this module must be patched before they unpickle a reference to
# torchstore's controller (see runtime/compat/torchstore.py).
ensure_torchstore_compatible()

import torchstore as ts  # noqa: E402
from monarch.actor import HostMesh, ProcMesh, this_host  # noqa: E402

PREFIX = "policy"
MANIFEST = "__manifest__"
_KEY_RE = re.compile(rf"{PREFIX}/v(\d{{6,}})/(.+)", re.DOTALL)
# Bounded so that a large model is not copied into in-flight messages all at once.
_MAX_IN_FLIGHT = 16


def version_prefix(version: int) -> str:
    """The key prefix shared by every key of ``version`` (ends with '/')."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"policy version must be a non-negative int, got {version!r}")
    return f"{PREFIX}/v{version:06d}/"


def weight_key(version: int, name: str) -> str:
    """Store key of parameter ``name`` (an HF parameter name) in ``version``."""
    if not name or name == MANIFEST:
        raise ValueError(f"invalid parameter name {name!r}")
    return version_prefix(version) + name


def manifest_key(version: int) -> str:
    """Store key of the manifest that marks ``version`` complete."""
    return version_prefix(version) + MANIFEST


def parse_weight_key(key: str) -> tuple[int, str]:
    """Inverse of :func:`weight_key` (and :func:`manifest_key`): ``(version, name)``."""
    match = _KEY_RE.fullmatch(key)
    if match is None:
        raise ValueError(f"not a policy weight key: {key!r}")
    return int(match.group(1)), match.group(2)


class VersionNotPublished(LookupError):
    """The requested policy version has no manifest in the store (not yet, or dropped)."""


@dataclass(frozen=True)
class SyncStats:
    """What one publish or fetch moved, for ``time/weight_sync_s`` and throughput logs."""

    version: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else math.inf


class Fetched(NamedTuple):
    state_dict: dict[str, torch.Tensor]
    stats: SyncStats


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in manifest")
    return dtype


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes: pickling a view would ship its whole storage."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != _nbytes(tensor):
        return tensor.contiguous().clone()
    return tensor


async def _bounded(coros: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(_MAX_IN_FLIGHT)

    async def run(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(run(c) for c in coros))


@dataclass(frozen=True)
class WeightStore:
    """Handle to a running store. Picklable: pass it to actors in other proc meshes."""

    name: str

    async def _client(self) -> Any:
        ensure_torchstore_compatible()
        return await ts.client(self.name)

    async def _keys(self, prefix: str) -> list[str]:
        # torchstore's prefix filter splits keys on '.', so a '/'-ended prefix never matches.
        client = await self._client()
        return [k for k in await client.keys() if k.startswith(prefix)]

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> SyncStats:
        """Store ``state_dict`` (HF names) as ``version``; readers see it once this returns."""
        if not state_dict:
            raise ValueError("refusing to publish an empty state dict")
        client = await self._client()
        if await client.exists(manifest_key(version)):
            raise ValueError(f"policy version {version} is already published in {self.name}")
        start = time.perf_counter()
        tensors = {name: _wire_tensor(t) for name, t in state_dict.items()}
        await _bounded([client.put(weight_key(version, n), t) for n, t in tensors.items()])
        manifest = {n: (tuple(t.shape), _dtype_name(t.dtype)) for n, t in tensors.items()}
        await client.put(manifest_key(version), manifest)
        seconds = time.perf_counter() - start
        moved = sum(_nbytes(t) for t in tensors.values())
        return SyncStats(version, len(tensors), moved, seconds)

    async def manifest(self, version: int, *, wait_s: float = 0.0) -> dict[str, tuple]:
        """``{name: (shape, dtype name)}`` of ``version``, waiting up to ``wait_s`` for it."""
        client = await self._client()
        key = manifest_key(version)
        deadline = time.monotonic() + wait_s
        delay = 0.02
        while not await client.exists(key):
            if time.monotonic() >= deadline:
                raise VersionNotPublished(
                    f"policy version {version} is not published in store {self.name} "
                    f"(no {key} after waiting {wait_s:g} s)"
                )
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        return await client.get(key)

    async def fetch(
        self,
        version: int,
        *,
        into: dict[str, torch.Tensor] | None = None,
        wait_s: float = 0.0,
    ) -> Fetched:
        """Read ``version`` (manifest first, then tensors), optionally into preallocated tensors.

        ``into`` maps HF names to tensors of the published shape and dtype; they are filled in
        place and returned in the state dict. Raises :class:`VersionNotPublished` when the
        manifest does not appear within ``wait_s`` seconds.
        """
        start = time.perf_counter()
        manifest = await self.manifest(version, wait_s=wait_s)
        into = into or {}
        for name, target in into.items():
            if name not in manifest:
                raise KeyError(f"{name!r} is not in policy version {version}")
            shape, dtype = manifest[name]
            if tuple(target.shape) != tuple(shape) or target.dtype != _dtype(dtype):
                raise ValueError(
                    f"preallocated {name!r} is {tuple(target.shape)} {target.dtype}, "
                    f"version {version} has {tuple(shape)} {dtype}"
                )
        client = await self._client()
        names = list(manifest)
        values = await _bounded(
            [client.get(weight_key(version, n), inplace_tensor=into.get(n)) for n in names]
        )
        state_dict = dict(zip(names, values, strict=True))
        seconds = time.perf_counter() - start
        moved = sum(_nbytes(t) for t in state_dict.values())
        return Fetched(state_dict, SyncStats(version, len(state_dict), moved, seconds))

    async def versions(self) -> list[int]:
        """Complete (manifested) versions in the store, ascending."""
        found = []
        for key in await self._keys(PREFIX + "/"):
            version, name = parse_weight_key(key)
            if name == MANIFEST:
                found.append(version)
        return sorted(found)

    async def latest_version(self) -> int | None:
        """The newest complete version, or None when nothing is published."""
        found = await self.versions()
        return found[-1] if found else None

    async def drop(self, version: int) -> int:
        """Delete every key of ``version`` (manifest first); returns how many were deleted."""
        client = await self._client()
        keys = await self._keys(version_prefix(version))
        manifest = manifest_key(version)
        if manifest in keys:
            await client.delete(manifest)
        rest = [k for k in keys if k != manifest]
        await _bounded([client.delete(k) for k in rest])
        return len(keys)


# Proc meshes this process spawned for its stores' storage volumes, by store name.
_volume_meshes: dict[str, ProcMesh] = {}


async def start_store(name: str | None = None, host: HostMesh | None = None) -> WeightStore:
    """Start TorchStore (controller here, one storage volume in its own proc). Controller only.

    ``host`` (one host; default: this one) is where the storage volume's proc runs. The default
    name is unique per call, so two stores (or two runs) never share a name.
    """
    ensure_torchstore_compatible()
    name = name or f"forgesky-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if name in _volume_meshes:
        raise ValueError(f"weight store {name!r} is already running")
    procs = (host or this_host()).spawn_procs(per_host={"procs": 1})
    try:
        await ts.initialize(num_storage_volumes=1, store_name=name, mesh=procs)
    except BaseException:
        await procs.stop()
        raise
    _volume_meshes[name] = procs
    return WeightStore(name)


async def stop_store(store: WeightStore) -> None:
    """Shut the store down: forget all keys and stop its storage proc.

    TorchStore's controller actor stays, idle and empty, in this process until it exits: monarch's
    controller registry owns it and hands out only references, which cannot be stopped.
    """
    procs = _volume_meshes.pop(store.name, None)
    if procs is None:
        raise ValueError(f"weight store {store.name!r} was not started by this process")
    try:
        await ts.shutdown(store.name)
    finally:
        ts.reset_client(store.name)
        await procs.stop()
