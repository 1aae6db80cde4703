"""runtime.compat.torchstore: torchstore 0.1.2 on torchmonarch 0.7, with real procs."""

from __future__ import annotations

import asyncio
import os
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torchstore as ts
import torchstore.transport.buffers as ts_buffers
from monarch._src.actor.actor_mesh import _actor_kind
from monarch.actor import Actor, endpoint, this_host
from monarch.rdma import is_ibverbs_available
from torchstore.controller import Controller
from torchstore.storage_volume import StorageVolume

from runtime.compat.torchstore import (
    ensure_torchstore_compatible,
    sync_endpoints,
    torchstore_needs_compat,
)

UPSTREAM_SYNC_ENDPOINTS = [
    "get_controller_strategy",
    "keys",
    "locate_volumes",
    "notify_delete",
    "notify_put",
]


class StorePeer(Actor):
    """Runs in its own proc: reads what the test process put, writes an answer back."""

    @endpoint
    async def double(self, store_name: str, key_in: str, key_out: str) -> torch.Tensor:
        # This proc unpickles a reference to torchstore's Controller, so it must be patched too.
        ensure_torchstore_compatible()
        got = await ts.get(key_in, store_name=store_name)
        await ts.put(key_out, got * 2, store_name=store_name)
        return got


@pytest.fixture(scope="module")
def procs_can_import_tests():
    """Spawned procs import this module by name to build StorePeer."""
    here = str(Path(__file__).parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here if not old else here + os.pathsep + old
    yield
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


def test_canary_upstream_still_mixes_sync_and_async():
    assert torchstore_needs_compat(), (
        "The installed torchstore no longer mixes sync and async endpoints in one Actor class: "
        "upstream fixed it. Delete runtime/compat/ (the compat layer), its "
        "ensure_torchstore_compatible() calls in runtime/weights/store.py, and "
        "tests/test_torchstore_compat.py."
    )
    assert sync_endpoints(Controller) == UPSTREAM_SYNC_ENDPOINTS


def test_patched_classes_pass_monarchs_spawn_check():
    ensure_torchstore_compatible()
    for cls in (Controller, StorageVolume):
        _actor_kind(cls)  # raises ValueError for a class that mixes kinds
    # The check looks through the wrappers, so it still reports what upstream declares.
    assert torchstore_needs_compat()
    assert sync_endpoints(Controller) == UPSTREAM_SYNC_ENDPOINTS


def test_patch_is_idempotent():
    ensure_torchstore_compatible()
    before = {name: Controller.__dict__[name] for name in UPSTREAM_SYNC_ENDPOINTS}
    ensure_torchstore_compatible()
    after = {name: Controller.__dict__[name] for name in UPSTREAM_SYNC_ENDPOINTS}
    assert before == after


def test_transport_choice_is_silent_and_matches_ibverbs():
    ensure_torchstore_compatible()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ts_buffers.rdma_available() == is_ibverbs_available()


def test_initialize_put_get_across_procs(procs_can_import_tests):
    ensure_torchstore_compatible()
    name = f"compat-test-{uuid.uuid4().hex[:8]}"
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    async def scenario() -> None:
        volume_procs = this_host().spawn_procs(per_host={"procs": 1})
        peer_procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            await ts.initialize(store_name=name, mesh=volume_procs)
            await ts.put("compat/in", sent, store_name=name)
            peer = peer_procs.spawn("store_peer", StorePeer)
            echoed = await peer.double.call_one(name, "compat/in", "compat/out")
            assert torch.equal(echoed, sent)
            assert torch.equal(await ts.get("compat/out", store_name=name), sent * 2)

            into = torch.empty(3, 4)
            got = await ts.get("compat/out", inplace_tensor=into, store_name=name)
            assert got is into and torch.equal(into, sent * 2)

            await ts.delete("compat/in", store_name=name)
            assert not await ts.exists("compat/in", store_name=name)
            assert await ts.exists("compat/out", store_name=name)
        finally:
            await peer_procs.stop()
            await ts.shutdown(name)
            await volume_procs.stop()

    asyncio.run(scenario())
