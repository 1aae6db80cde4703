"""Make torchstore 0.1.2 run on torchmonarch 0.7.0 without editing site-packages.

torchstore 0.1.2 was written for torchmonarch 0.1.2. Since monarch 0.2 an Actor class must have
either only ``def`` endpoints (a "sync" actor, run on its own thread) or only ``async def``
endpoints; monarch checks this in ``_actor_kind`` both when a class is spawned and whenever an
``ActorMesh`` of it is built, which includes *unpickling a reference* to it in another process.

What :func:`ensure_torchstore_compatible` patches, in place on the imported classes:

1. ``torchstore.controller.Controller``: five endpoints are plain ``def`` while ``init`` and
   ``teardown`` are ``async def``, so ``ts.initialize()`` fails inside
   ``get_or_spawn_controller`` ("mixes both async and sync endpoints"). Each sync endpoint
   (``get_controller_strategy``, ``locate_volumes``, ``notify_put``, ``keys``,
   ``notify_delete``) is replaced by an ``async def`` endpoint that calls the original
   function. The bodies only touch in-memory dicts and never await, so running them on the
   actor's event loop keeps their semantics (each still runs to completion without
   interleaving). The same rule is applied to every other torchstore Actor class
   (``StorageVolume`` is already all-async in 0.1.2 and is left alone).
2. ``torchstore.transport.buffers.monarch_rdma_available``: bound to monarch's deprecated
   ``is_rdma_available``, which emits a DeprecationWarning on every put/get. It is rebound to
   ``is_ibverbs_available``, which monarch documents as the same answer. On a CPU host both
   say False, so torchstore moves tensors inside its ``MonarchTransportBuffer`` over Monarch
   RPC; ``RDMATransportBuffer`` is only used where ibverbs exists, and its calls
   (``RDMABuffer(t)``, ``read_into``, ``write_from``, ``drop``) match monarch 0.7.

Also, before torchstore is first imported, ``HYPERACTOR_CODEC_MAX_FRAME_LENGTH`` is set to the
value torchstore would set itself: when it is missing, torchstore's import prints a warning and
calls its ``init_logging()``, which lowers the root logger to INFO and adds a stdout handler in
every process. (monarch 0.7 reads the variable once, at its first use in a process, and its
default, 10 GiB per message, already fits any single parameter we send.)

Where the patch must run: monarch re-checks the class in every process that builds an
``ActorMesh`` for it. The torchstore ``Controller`` lives in the process that called
``ts.initialize()`` (monarch's controller registry spawns it on its own proc), but any actor in
another proc mesh that calls ``ts.put``/``ts.get`` receives a pickled ``Controller`` reference
and fails there unless that process is patched too. ``runtime.weights.store`` calls
:func:`ensure_torchstore_compatible` at import and before each store operation, so importing
it (as every actor module that syncs weights does) is enough.

When upstream fixes this, :func:`torchstore_needs_compat` returns False (it inspects the
classes, looking through this module's wrappers), the canary test in
``tests/test_torchstore_compat.py`` fails, and this module should be deleted.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

# torchstore's own value (its __init__ sets it when missing); see the module docstring.
_FRAME_LENGTH = "910737418240"
os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", _FRAME_LENGTH)

import torchstore.controller  # noqa: E402  (the env var must be set first)
import torchstore.storage_volume  # noqa: E402
import torchstore.transport.buffers  # noqa: E402
from monarch._src.actor.endpoint import EndpointProperty  # noqa: E402
from monarch.actor import Actor, endpoint  # noqa: E402
from monarch.rdma import is_ibverbs_available  # noqa: E402

# Marks a wrapper made here and points at the upstream function it wraps.
_ORIGINAL_ATTR = "__forgesky_compat_original__"
_lock = threading.Lock()
_applied = False


def _torchstore_actor_classes() -> list[type[Actor]]:
    return [torchstore.controller.Controller, torchstore.storage_volume.StorageVolume]


def _upstream_endpoints(cls: type) -> dict[str, tuple[EndpointProperty, Callable[..., Any]]]:
    """Endpoint name -> (descriptor, upstream function), seeing through our wrappers."""
    found = {}
    for name in dir(cls):
        prop = getattr(cls, name, None)
        if isinstance(prop, EndpointProperty):
            found[name] = (prop, getattr(prop._method, _ORIGINAL_ATTR, prop._method))
    return found


def sync_endpoints(cls: type) -> list[str]:
    """Names of ``cls``'s endpoints that upstream declares as plain ``def``."""
    return sorted(
        name
        for name, (_, fn) in _upstream_endpoints(cls).items()
        if not inspect.iscoroutinefunction(fn)
    )


def _mixes_sync_and_async(cls: type) -> bool:
    kinds = {inspect.iscoroutinefunction(fn) for _, fn in _upstream_endpoints(cls).values()}
    return kinds == {True, False}


def torchstore_needs_compat() -> bool:
    """True while the installed torchstore declares an Actor mixing sync and async endpoints.

    Inspects the upstream functions (not version strings), so the answer is the same before and
    after :func:`ensure_torchstore_compatible` ran.
    """
    return any(_mixes_sync_and_async(cls) for cls in _torchstore_actor_classes())


def _asyncify(prop: EndpointProperty) -> EndpointProperty:
    sync_fn = prop._method

    @functools.wraps(sync_fn)
    async def async_fn(self: Any, *args: Any, **kwargs: Any) -> Any:
        return sync_fn(self, *args, **kwargs)

    setattr(async_fn, _ORIGINAL_ATTR, sync_fn)
    return endpoint(
        async_fn,
        propagate=prop._propagator,
        explicit_response_port=prop._explicit_response_port,
        instrument=prop._instrument,
    )


def ensure_torchstore_compatible() -> None:
    """Patch torchstore's classes for this monarch, once per process (idempotent, thread-safe)."""
    global _applied
    if _applied:
        return
    with _lock:
        if _applied:
            return
        for cls in _torchstore_actor_classes():
            if not _mixes_sync_and_async(cls):
                continue
            for name, (prop, fn) in _upstream_endpoints(cls).items():
                if not inspect.iscoroutinefunction(prop._method) and fn is prop._method:
                    setattr(cls, name, _asyncify(prop))
        torchstore.transport.buffers.monarch_rdma_available = is_ibverbs_available
        _applied = True


def is_applied() -> bool:
    """Whether :func:`ensure_torchstore_compatible` has run in this process."""
    return _applied
