"""Versioned policy weights on TorchStore: the trainer publishes, generators fetch.

Layout in the store: each version is a few 1-D byte buffers ("buckets") and a manifest.

    policy/v000012/bucket_0000     uint8[<= bucket_bytes]: tensors of one dtype, end to end
    policy/v000012/bucket_0001     ...
    policy/v000012/__manifest__    written last:
        {"buckets": [nbytes, ...],
         "tensors": {hf_name: (bucket, offset, numel, shape, dtype)}}

``offset`` is the byte where the tensor starts in ``bucket``; a tensor larger than what is left
there continues in the next buckets (:mod:`runtime.weights.layout` has the packing rules). The
cap is ``bucket_bytes`` of the :class:`WeightStore` handle, :data:`BUCKET_BYTES` (32 MiB) unless
given. ``fetch`` returns views into the fetched buckets (copies for tensors split across buckets),
or fills ``into``.

Why: through TorchStore 0.1.2 small transfers cost per key, not per byte: a put is 2 RPCs
(storage volume, controller), a get 3 (controller twice, volume). With one key per parameter,
the tiny recipe (~30 tensors, < 1 MB; 2 shared CPU cores) spent 0.07-0.21 s a step publishing
(mean 0.12) and 0.18-0.44 s on publish plus the generator's load (``time/weight_sync_s``, mean
0.31), most of a 0.4 s step; in buckets, 0.01-0.03 s (mean 0.02) and 0.03-0.07 s (mean 0.05).
Between two procs, 100 MB in 300 tensors took 2.5-6.9 s to publish and fetch with one key per
tensor and 0.6-1.8 s in 32 MiB buckets. Bigger buckets are slower on this path (Monarch RPC):
800 MB took about 10 s in 256 MiB buckets and 2 s in 32 MiB ones.

A version exists for readers once its manifest exists: ``publish`` writes every bucket first and
the manifest last, ``drop`` deletes the manifest first and then every other key of the version
(also buckets that a publish which died left behind). The controller process owns the store
(``start_store`` / ``stop_store``); it hands the returned :class:`WeightStore` (a small picklable
handle: the store's name and bucket cap) to actors in other proc meshes, which call ``publish``
/ ``fetch`` on it. There, torchstore looks its controller actor up by that name with monarch's
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from runtime.compat.torchstore import ensure_torchstore_compatible
from runtime.procs.mesh import proc_bootstrap_cmd
from runtime.weights.layout import (
    BUCKET_BYTES,
    Packer,
    TensorEntry,
    Unpacker,
    parse_dtype,
)

# Actor procs that only import this module must be patched before they unpickle a reference to
# torchstore's controller (see runtime/compat/torchstore.py).
ensure_torchstore_compatible()

import torchstore as ts  # noqa: E402
from monarch.actor import HostMesh, ProcMesh, this_host  # noqa: E402

PREFIX = "policy"
MANIFEST = "__manifest__"
_KEY_RE = re.compile(rf"{PREFIX}/v(\d{{6,}})/(.+)", re.DOTALL)
# Buckets in flight per publish or fetch: overlaps round trips while bounding the extra memory
# (each one is packed only when its turn comes).
_MAX_IN_FLIGHT = 4


def version_prefix(version: int) -> str:
    """The key prefix shared by every key of ``version`` (ends with '/')."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"policy version must be a non-negative int, got {version!r}")
    return f"{PREFIX}/v{version:06d}/"


def weight_key(version: int, name: str) -> str:
    """Store key of item ``name`` (a bucket, see :func:`bucket_key`) in ``version``."""
    if not name or name == MANIFEST:
        raise ValueError(f"invalid parameter name {name!r}")
    return version_prefix(version) + name


def bucket_key(version: int, index: int) -> str:
    """Store key of bucket ``index`` of ``version``, e.g. ``policy/v000012/bucket_0003``."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"bucket index must be a non-negative int, got {index!r}")
    return weight_key(version, f"bucket_{index:04d}")


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


async def _bounded(coros: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(_MAX_IN_FLIGHT)

    async def run(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(run(c) for c in coros))


@dataclass(frozen=True)
class WeightStore:
    """Handle to a running store. Picklable: pass it to actors in other proc meshes.

    ``bucket_bytes`` caps the buckets that ``publish`` writes through this handle; readers take
    the layout from the manifest, so handles with different caps share one store.
    """

    name: str
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")

    async def _client(self) -> Any:
        ensure_torchstore_compatible()
        return await ts.client(self.name)

    async def _keys(self, prefix: str) -> list[str]:
        # torchstore's prefix filter splits keys on '.', so a '/'-ended prefix never matches.
        client = await self._client()
        return [k for k in await client.keys() if k.startswith(prefix)]

    async def publish(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor],
        *,
        direct: dict[str, Any] | None = None,
    ) -> SyncStats:
        """Store `state_dict` (HF names) as `version`; readers see it once this returns.

        `direct` (how the direct paths read this version, see runtime/weights/transport.py)
        goes into the manifest too.
        """
        start = time.perf_counter()
        manifest = await self.put_buckets(version, state_dict)
        if direct is not None:
            manifest["direct"] = direct
        await self.put_manifest(version, manifest)
        nbytes = sum(manifest["buckets"])
        return SyncStats(version, len(manifest["tensors"]), nbytes, time.perf_counter() - start)

    async def put_buckets(
        self, version: int, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """Write `version`'s buckets (not yet readable); the manifest entries that index them."""
        if not state_dict:
            raise ValueError("refusing to publish an empty state dict")
        client = await self._client()
        if await client.exists(manifest_key(version)):
            raise ValueError(f"policy version {version} is already published in {self.name}")
        packer = Packer(state_dict, self.bucket_bytes)

        async def put(index: int) -> None:
            # Packed here, under the in-flight bound, so only a few packed copies exist at once.
            await client.put(bucket_key(version, index), packer.bucket(index))

        await _bounded([put(i) for i in range(len(packer.sizes))])
        # Plain builtins: the storage volume's proc unpickles it without importing this module.
        tensors = {n: tuple(entry) for n, entry in packer.entries.items()}
        return {"buckets": packer.sizes, "tensors": tensors}

    async def put_groups(
        self, version: int, groups: Iterable[Mapping[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """`put_buckets` for a version handed over a group at a time (a trainer gathering one
        block after another): each group is packed and written before the next is asked for,
        so the publisher never holds more than one group. Same manifest entries."""
        client = await self._client()
        if await client.exists(manifest_key(version)):
            raise ValueError(f"policy version {version} is already published in {self.name}")
        sizes: list[int] = []
        tensors: dict[str, tuple[Any, ...]] = {}
        for group in groups:
            if not group:
                continue
            packer = Packer(group, self.bucket_bytes)
            first = len(sizes)

            async def put(index: int, packer: Packer = packer, first: int = first) -> None:
                await client.put(bucket_key(version, first + index), packer.bucket(index))

            await _bounded([put(i) for i in range(len(packer.sizes))])
            sizes += packer.sizes
            for name, e in packer.entries.items():
                bucket = e.bucket + first if e.bucket >= 0 else e.bucket
                tensors[name] = tuple(e._replace(bucket=bucket))
            del packer
        if not tensors:
            raise ValueError("refusing to publish an empty state dict")
        return {"buckets": sizes, "tensors": tensors}

    async def put_manifest(
        self, version: int, manifest: dict[str, Any], *, check: bool = False
    ) -> None:
        """Make `version` exist for readers: its manifest, written after its bytes. With
        `check`, refuse a version already published (`put_buckets` checks it otherwise)."""
        client = await self._client()
        if check and await client.exists(manifest_key(version)):
            raise ValueError(f"policy version {version} is already published in {self.name}")
        await client.put(manifest_key(version), manifest)

    async def announce(self, version: int, direct: dict[str, Any]) -> None:
        """Index `version` without its bytes: a manifest that only says how to read it
        directly. `fetch` refuses such a version."""
        manifest = {"buckets": [], "tensors": {}, "direct": direct}
        await self.put_manifest(version, manifest, check=True)

    async def direct(self, version: int, *, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The ``direct`` entry of ``version``'s manifest (None if it has none), waiting up to
        ``wait_s`` for the manifest."""
        raw = await self._raw_manifest(version, wait_s)
        return raw.get("direct")

    async def _raw_manifest(self, version: int, wait_s: float) -> dict[str, Any]:
        client = await self._client()
        key = manifest_key(version)
        try:  # published already, as a load usually finds it: no `exists` lookup first
            return await client.get(key)
        except KeyError:
            pass
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

    async def _read_manifest(
        self, version: int, wait_s: float
    ) -> tuple[dict[str, TensorEntry], list[int]]:
        raw = await self._raw_manifest(version, wait_s)
        if not raw["tensors"] and raw.get("direct"):
            raise VersionNotPublished(
                f"policy version {version} in store {self.name} has no bytes in the store "
                "(it was announced for direct transport only)"
            )
        entries = {name: TensorEntry(*fields) for name, fields in raw["tensors"].items()}
        return entries, list(raw["buckets"])

    async def layout(self, version: int, *, wait_s: float = 0.0) -> dict[str, TensorEntry]:
        """Where each tensor of ``version`` lives (bucket, byte offset, numel, shape, dtype)."""
        entries, _ = await self._read_manifest(version, wait_s)
        return entries

    async def manifest(self, version: int, *, wait_s: float = 0.0) -> dict[str, tuple]:
        """``{name: (shape, dtype name)}`` of ``version``, waiting up to ``wait_s`` for it."""
        entries, _ = await self._read_manifest(version, wait_s)
        return {name: (e.shape, e.dtype) for name, e in entries.items()}

    async def fetch(
        self,
        version: int,
        *,
        into: dict[str, torch.Tensor] | None = None,
        wait_s: float = 0.0,
    ) -> Fetched:
        """Read ``version`` (manifest first, then its buckets), optionally into given tensors.

        Without ``into`` the tensors are views into the fetched buckets (copies where a tensor
        spans buckets). ``into`` maps HF names to tensors of the published shape and dtype; they
        are filled in place and returned in the state dict. Raises :class:`VersionNotPublished`
        when the manifest does not appear within ``wait_s`` seconds.
        """
        start = time.perf_counter()
        entries, sizes = await self._read_manifest(version, wait_s)
        into = into or {}
        for name, target in into.items():
            if name not in entries:
                raise KeyError(f"{name!r} is not in policy version {version}")
            entry = entries[name]
            if tuple(target.shape) != entry.shape or target.dtype != parse_dtype(entry.dtype):
                raise ValueError(
                    f"preallocated {name!r} is {tuple(target.shape)} {target.dtype}, "
                    f"version {version} has {entry.shape} {entry.dtype}"
                )
        client = await self._client()
        unpacker = Unpacker(entries, sizes, into)

        async def get(index: int) -> None:
            try:
                unpacker.add(index, await client.get(bucket_key(version, index)))
            except ValueError as e:
                raise RuntimeError(f"policy version {version} in {self.name}: {e}") from e

        await _bounded([get(i) for i in range(len(sizes))])
        state_dict = unpacker.state_dict()
        seconds = time.perf_counter() - start
        return Fetched(state_dict, SyncStats(version, len(state_dict), sum(sizes), seconds))

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


async def start_store(
    name: str | None = None,
    host: HostMesh | None = None,
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> WeightStore:
    """Start TorchStore (controller here, one storage volume in its own proc). Controller only.

    ``host`` (one host; default: this one) is where the storage volume's proc runs. The default
    name is unique per call, so two stores (or two runs) never share a name. ``bucket_bytes`` is
    the bucket cap of the returned handle's publishes.
    """
    ensure_torchstore_compatible()
    name = name or f"forgesky-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = WeightStore(name, bucket_bytes)
    if name in _volume_meshes:
        raise ValueError(f"weight store {name!r} is already running")
    # started like the services' procs: it prints its stacks on kill -USR1 too
    procs = (host or this_host()).spawn_procs(
        per_host={"procs": 1}, bootstrap_command=proc_bootstrap_cmd()
    )
    try:
        await ts.initialize(num_storage_volumes=1, store_name=name, mesh=procs)
    except BaseException:
        await procs.stop()
        raise
    _volume_meshes[name] = procs
    return store


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


# --- the store as a transport (any placement; the fallback) --------------------------------------


class StoreSender:
    """Trainer rank 0's end of the `store` path: the version's bytes in the store's buckets."""

    name = "store"

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    def open(self) -> None:
        return None

    async def stage(
        self, version: int, state: dict[str, torch.Tensor], entries: Any
    ) -> dict[str, Any]:
        return await self.store.put_buckets(version, state)

    def stats(self) -> dict[str, float]:
        return {}

    def release(self, version: int) -> None:
        return None

    def close(self) -> None:
        return None


class StoreReceiver:
    """A generator's end of the `store` path: fetch the buckets, load the state dict."""

    name = "store"

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    async def load(
        self, version: int, backend: Any, direct: dict[str, Any] | None = None
    ) -> tuple[int, int]:
        # the bytes are the store's own: a direct entry handed over has nothing for this path
        fetched = await self.store.fetch(version, wait_s=60.0)
        backend.load_weights(fetched.state_dict)
        return version, fetched.stats.bytes

    def close(self) -> None:
        return None
