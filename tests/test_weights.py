"""runtime.weights.store: versioned policy weights over real TorchStore between real Monarch procs."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest
import torch
import torchstore as ts
from hypothesis import given
from hypothesis import strategies as st
from monarch.actor import Actor, endpoint, this_host
from test_weight_layout import bits, check_layout, random_bits
from torch import nn

from runtime.weights.layout import plan_buckets
from runtime.weights.store import (
    BUCKET_BYTES,
    SyncStats,
    VersionNotPublished,
    WeightStore,
    bucket_key,
    manifest_key,
    parse_weight_key,
    start_store,
    stop_store,
    version_prefix,
    weight_key,
)

TESTS_DIR = str(Path(__file__).parent)


# --- a tiny policy with HF parameter names --------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim // 2, bias=False)
        self.v_proj = nn.Linear(dim, dim // 2, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)


class _MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = _Attention(dim)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.mlp = _MLP(dim)


class _Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)


class TinyPolicy(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.model = _Decoder(vocab, dim, layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def policy_state_dict(version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` of the policy: bf16 matrices, fp32 norms, as a trainer would hold."""
    with torch.random.fork_rng():
        torch.manual_seed(version)
        policy = TinyPolicy()
        for module in policy.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.normal_(module.weight)
    return {
        name: t if name.endswith("norm.weight") else t.to(torch.bfloat16)
        for name, t in policy.state_dict().items()
    }


def mixed_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype a policy may hold, raw bit patterns (NaN payloads, -0.0, inf), strided views,
    0-d and empty tensors."""
    base = torch.randn(24, 40, generator=torch.Generator().manual_seed(seed))
    return {
        "model.embed_tokens.weight": random_bits((96, 32), torch.bfloat16, seed),
        "model.layers.0.self_attn.q_proj.weight": random_bits(
            (32, 48), torch.bfloat16, seed + 6
        ).t(),
        "model.layers.0.mlp.up_proj.weight": base.t(),
        "model.layers.0.input_layernorm.weight": base[3],
        "model.layers.0.mlp.down_proj.weight": base[::2, 1::3],
        "model.norm.weight": random_bits((32,), torch.float32, seed + 1),
        "model.rotary_emb.inv_freq": random_bits((16,), torch.float64, seed + 2),
        "model.layers.0.attn_scale": random_bits((), torch.bfloat16, seed + 3),
        "model.step": torch.tensor(7, dtype=torch.int64),
        "model.half": torch.tensor([float("nan"), float("inf"), -0.0, 1e-7], dtype=torch.float16),
        "model.mask": random_bits((5, 3), torch.bool, seed + 4),
        "model.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "lm_head.weight": random_bits((96, 32), torch.bfloat16, seed + 5),
    }


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(bits(got[name]), bits(tensor)), name


# --- actors, each in its own proc mesh ------------------------------------------------------


class Trainer(Actor):
    @endpoint
    async def publish(self, store: WeightStore, version: int) -> SyncStats:
        return await store.publish(version, policy_state_dict(version))

    @endpoint
    async def publish_mixed(self, store: WeightStore, version: int) -> SyncStats:
        """Publish :func:`mixed_state_dict`, built here so its strided views are the trainer's."""
        state_dict = mixed_state_dict(version)
        assert not state_dict["model.layers.0.mlp.up_proj.weight"].is_contiguous()
        return await store.publish(version, state_dict)


class Generator(Actor):
    @endpoint
    async def fetch(
        self, store: WeightStore, version: int, wait_s: float = 0.0
    ) -> dict[str, torch.Tensor]:
        state_dict, _ = await store.fetch(version, wait_s=wait_s)
        # Fetched tensors are views into whole buckets: reply with only their own bytes.
        return {name: t.clone() for name, t in state_dict.items()}

    @endpoint
    async def fetch_in_place(self, store: WeightStore, version: int) -> bool:
        """True when every fetched tensor is the preallocated one, filled with the weights."""
        into = {n: torch.empty_like(t) for n, t in policy_state_dict(0).items()}
        state_dict, stats = await store.fetch(version, into=into)
        same = all(state_dict[n] is t for n, t in into.items())
        want = policy_state_dict(version)
        exact = all(torch.equal(into[n], t) for n, t in want.items())
        return same and exact and stats.bytes == sum(t.nbytes for t in want.values())

    @endpoint
    async def latest_version(self, store: WeightStore) -> int | None:
        return await store.latest_version()


@pytest.fixture(scope="module")
def procs_can_import_tests():
    """Spawned procs import this module by name to build the actors above."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = TESTS_DIR if not old else TESTS_DIR + os.pathsep + old
    yield
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


class Cluster:
    """A store owned by this process, a trainer proc and a generator proc."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def start(self) -> None:
        self.store = await start_store()
        self.trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
        self.generator_procs = this_host().spawn_procs(per_host={"procs": 1})
        self.trainer = self.trainer_procs.spawn("trainer", Trainer)
        self.generator = self.generator_procs.spawn("generator", Generator)

    async def stop(self) -> None:
        await self.generator_procs.stop()
        await self.trainer_procs.stop()
        await stop_store(self.store)


@pytest.fixture(scope="module")
def cluster(procs_can_import_tests):
    c = Cluster()
    c.run(c.start())
    yield c
    c.run(c.stop())
    c.loop.close()


# --- key naming -----------------------------------------------------------------------------


def test_weight_key_layout():
    name = "model.layers.0.self_attn.q_proj.weight"
    assert weight_key(12, name) == f"policy/v000012/{name}"
    assert bucket_key(12, 3) == "policy/v000012/bucket_0003"
    assert bucket_key(12, 12345) == "policy/v000012/bucket_12345"
    assert parse_weight_key(bucket_key(12, 3)) == (12, "bucket_0003")
    assert manifest_key(12) == "policy/v000012/__manifest__"
    assert weight_key(1234567, "lm_head.weight") == "policy/v1234567/lm_head.weight"
    assert parse_weight_key(weight_key(12, name)) == (12, name)
    assert parse_weight_key(manifest_key(3)) == (3, "__manifest__")


@pytest.mark.parametrize("bad", ["policy/v12/x", "policy/v000012/", "other/v000012/x", "x"])
def test_parse_weight_key_rejects_foreign_keys(bad):
    with pytest.raises(ValueError, match="not a policy weight key"):
        parse_weight_key(bad)


@pytest.mark.parametrize("version", [-1, 1.0, True, "3"])
def test_weight_key_rejects_bad_versions(version):
    with pytest.raises(ValueError, match="non-negative int"):
        weight_key(version, "lm_head.weight")


def test_weight_key_rejects_reserved_and_empty_names():
    for name in ("", "__manifest__"):
        with pytest.raises(ValueError, match="invalid parameter name"):
            weight_key(1, name)
    with pytest.raises(ValueError, match="bucket index"):
        bucket_key(1, -1)


@given(
    version=st.integers(min_value=0, max_value=10**9),
    name=st.text(min_size=1).filter(lambda s: s != "__manifest__"),
)
def test_key_round_trip(version, name):
    assert parse_weight_key(weight_key(version, name)) == (version, name)


def test_sync_stats_throughput():
    assert SyncStats(version=1, tensors=2, bytes=3_000_000_000, seconds=2.0).gb_per_s == 1.5


def test_store_handle_carries_a_valid_bucket_cap():
    assert WeightStore("x").bucket_bytes == BUCKET_BYTES
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="bucket_bytes"):
            WeightStore("x", bad)


# --- publish / fetch between procs ----------------------------------------------------------


def test_generator_fetches_each_published_version_bit_exactly(cluster):
    for version in (1, 2, 3):
        want = policy_state_dict(version)
        stats = cluster.run(cluster.trainer.publish.call_one(cluster.store, version))
        assert stats.version == version and stats.tensors == len(want)
        assert stats.bytes == sum(t.nbytes for t in want.values()) and stats.seconds > 0
        got = cluster.run(cluster.generator.fetch.call_one(cluster.store, version))
        assert_bit_exact(got, want)
    # Guard against a comparison that could not fail: versions really differ.
    assert not torch.equal(policy_state_dict(1)["lm_head.weight"], got["lm_head.weight"])
    assert cluster.run(cluster.generator.latest_version.call_one(cluster.store)) >= 3


def test_fetch_into_preallocated_tensors(cluster):
    cluster.run(cluster.trainer.publish.call_one(cluster.store, 5))
    assert cluster.run(cluster.generator.fetch_in_place.call_one(cluster.store, 5))


async def _raw_manifest(store: WeightStore, version: int) -> dict:
    return await ts.get(manifest_key(version), store_name=store.name)


async def _version_keys(store: WeightStore, version: int) -> set[str]:
    prefix = version_prefix(version)
    # ts.keys() takes no store name; the store's own client does.
    keys = await (await ts.client(store.name)).keys()
    return {k for k in keys if k.startswith(prefix)}


def test_mixed_dtypes_over_many_buckets_round_trip_bit_exactly(cluster):
    small = dataclasses.replace(cluster.store, bucket_bytes=4096)
    want = mixed_state_dict(10)
    stats = cluster.run(cluster.trainer.publish_mixed.call_one(small, 10))
    assert stats.tensors == len(want)
    assert stats.bytes == sum(t.numel() * t.element_size() for t in want.values())

    raw = cluster.run(_raw_manifest(small, 10))
    assert len(raw["buckets"]) > len({t.dtype for t in want.values()})
    assert cluster.run(_version_keys(small, 10)) == {
        *(bucket_key(10, i) for i in range(len(raw["buckets"]))),
        manifest_key(10),
    }
    for i, size in enumerate(raw["buckets"]):
        bucket = cluster.run(ts.get(bucket_key(10, i), store_name=small.name))
        assert bucket.dtype == torch.uint8 and bucket.shape == (size,)
    check_layout(want, cluster.run(small.layout(10)), raw["buckets"], 4096)

    # Another proc (the generator), then this one, where the tensors are views into buckets.
    assert_bit_exact(cluster.run(cluster.generator.fetch.call_one(small, 10)), want)
    got, fetch_stats = cluster.run(cluster.store.fetch(10))
    assert_bit_exact(got, want)
    assert fetch_stats.bytes == stats.bytes and fetch_stats.tensors == len(want)
    # Guard against a comparison that could not fail: NaN payloads and -0.0 are really there.
    assert torch.isnan(want["model.half"]).any() and torch.signbit(want["model.half"][2])

    into = {n: torch.empty_like(t) for n, t in want.items() if t.dtype == torch.bfloat16}
    got, _ = cluster.run(cluster.store.fetch(10, into=into))
    assert all(got[n] is t for n, t in into.items())
    assert_bit_exact(got, want)


def test_fetch_into_rejects_tensors_of_another_shape_or_dtype(cluster):
    cluster.run(cluster.trainer.publish.call_one(cluster.store, 11))
    wrong = {"lm_head.weight": torch.empty(96, 32, dtype=torch.float32)}
    with pytest.raises(ValueError, match="preallocated 'lm_head.weight'"):
        cluster.run(cluster.store.fetch(11, into=wrong))
    with pytest.raises(KeyError, match="not in policy version 11"):
        cluster.run(cluster.store.fetch(11, into={"nope": torch.empty(1)}))


def test_manifest_is_written_after_and_deleted_before_every_bucket(cluster):
    """Snapshots of the store's keys taken while a many-bucket version is published and
    dropped: whenever the manifest is there, so is every bucket it lists."""
    small = dataclasses.replace(cluster.store, bucket_bytes=1024)
    n_buckets = len(plan_buckets(mixed_state_dict(12), 1024)[1])
    buckets = {bucket_key(12, i) for i in range(n_buckets)}
    assert n_buckets >= 10

    async def snapshot_check(work) -> None:
        task = asyncio.ensure_future(work)
        while True:
            done = task.done()
            keys = await _version_keys(small, 12)
            if manifest_key(12) in keys:
                assert buckets <= keys, sorted(buckets - keys)[:3]
            if done:
                await task
                return

    cluster.run(snapshot_check(cluster.trainer.publish_mixed.call_one(small, 12)))
    assert cluster.run(_version_keys(small, 12)) == buckets | {manifest_key(12)}
    cluster.run(snapshot_check(small.drop(12)))
    assert cluster.run(_version_keys(small, 12)) == set()


def test_fetch_of_unpublished_version_raises_clearly(cluster):
    with pytest.raises(Exception, match="policy version 99 is not published"):
        cluster.run(cluster.generator.fetch.call_one(cluster.store, 99, 0.2))
    with pytest.raises(VersionNotPublished, match="policy version 99 is not published"):
        cluster.run(cluster.store.fetch(99))


def test_fetch_waits_until_the_manifest_is_written(cluster):
    async def scenario():
        waiting = asyncio.ensure_future(cluster.generator.fetch.call_one(cluster.store, 7, 120.0))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        await cluster.trainer.publish.call_one(cluster.store, 7)
        return await waiting

    assert_bit_exact(cluster.run(scenario()), policy_state_dict(7))


def test_publishing_a_version_twice_is_refused(cluster):
    cluster.run(cluster.trainer.publish.call_one(cluster.store, 8))
    with pytest.raises(Exception, match="policy version 8 is already published"):
        cluster.run(cluster.trainer.publish.call_one(cluster.store, 8))


def test_dropped_versions_are_gone(cluster):
    store = cluster.store
    for version in (20, 21):
        cluster.run(cluster.trainer.publish.call_one(store, version))
    assert cluster.run(store.latest_version()) == 21
    n_buckets = len(cluster.run(_raw_manifest(store, 21))["buckets"])
    assert n_buckets == 2  # bfloat16 matrices, float32 norms
    assert cluster.run(store.drop(21)) == n_buckets + 1
    assert cluster.run(_version_keys(store, 21)) == set()
    assert cluster.run(store.drop(21)) == 0
    assert 21 not in cluster.run(store.versions())
    assert cluster.run(store.latest_version()) == 20
    with pytest.raises(Exception, match="policy version 21 is not published"):
        cluster.run(cluster.generator.fetch.call_one(store, 21))
    assert_bit_exact(
        cluster.run(cluster.generator.fetch.call_one(store, 20)), policy_state_dict(20)
    )


def test_views_ship_only_their_own_bytes(cluster):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    state_dict = {"model.norm.weight": base[2], "lm_head.weight": base.t()}
    stats = cluster.run(cluster.store.publish(40, state_dict))
    assert stats.bytes == (8 + 64) * 4
    assert cluster.run(cluster.store.manifest(40)) == {
        "model.norm.weight": ((8,), "float32"),
        "lm_head.weight": ((8, 8), "float32"),
    }
    bucket = cluster.run(ts.get(bucket_key(40, 0), store_name=cluster.store.name))
    assert bucket.untyped_storage().nbytes() == (8 + 64) * 4
    got, _ = cluster.run(cluster.store.fetch(40))
    assert torch.equal(got["model.norm.weight"], base[2])
    assert torch.equal(got["lm_head.weight"], base.t())

    # Cut into 64-byte buckets, each stored bucket still holds only its own bytes.
    small = dataclasses.replace(cluster.store, bucket_bytes=64)
    cluster.run(small.publish(41, state_dict))
    assert cluster.run(_raw_manifest(small, 41))["buckets"] == [64, 64, 64, 64, 32]
    for i in range(5):
        bucket = cluster.run(ts.get(bucket_key(41, i), store_name=small.name))
        assert bucket.untyped_storage().nbytes() == (64 if i < 4 else 32)
    got, _ = cluster.run(small.fetch(41))
    assert torch.equal(got["model.norm.weight"], base[2])
    assert torch.equal(got["lm_head.weight"], base.t())


def test_unfinished_publish_is_invisible_and_drop_cleans_it(cluster):
    store = cluster.store
    # A trainer that died mid-publish leaves buckets without a manifest.
    bucket = torch.ones(8, dtype=torch.uint8)
    cluster.run(ts.put(bucket_key(30, 0), bucket, store_name=store.name))
    assert 30 not in cluster.run(store.versions())
    with pytest.raises(VersionNotPublished):
        cluster.run(store.fetch(30))
    assert cluster.run(store.drop(30)) == 1


# --- shutdown -------------------------------------------------------------------------------


def _shm_entries() -> set[str]:
    """Regular files under /dev/shm: what shm_open and torch's shared tensors create."""
    return {e.name for e in os.scandir("/dev/shm") if e.is_file(follow_symlinks=False)}


def _shm_in_use() -> set[str]:
    """Names under /dev/shm that some live process has open or mapped."""
    used = set()
    for proc in psutil.process_iter():
        try:
            used.update(Path(m.path).name for m in proc.memory_maps() if "/dev/shm/" in m.path)
            used.update(Path(f.path).name for f in proc.open_files() if "/dev/shm/" in f.path)
        except (psutil.Error, OSError):
            continue
    return used


def test_stop_store_leaves_no_processes_or_shared_memory(procs_can_import_tests):
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    shm_before = _shm_entries()

    async def lifecycle():
        store = await start_store()
        trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
        trainer = trainer_procs.spawn("trainer", Trainer)
        await trainer.publish.call_one(store, 1)
        state_dict, _ = await store.fetch(1)
        assert_bit_exact(state_dict, policy_state_dict(1))
        assert {p.pid for p in me.children(recursive=True)} - children_before
        await trainer_procs.stop()
        await stop_store(store)

    asyncio.run(lifecycle())
    assert {p.pid for p in me.children(recursive=True)} - children_before == set()
    assert (_shm_entries() - shm_before) - _shm_in_use() == set()


RUN_SCRIPT = textwrap.dedent(
    """
    import asyncio, psutil
    from monarch.actor import this_host
    from runtime.weights.store import start_store, stop_store
    from test_weights import Trainer, assert_bit_exact, policy_state_dict

    async def main():
        store = await start_store()
        trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
        trainer = trainer_procs.spawn("trainer", Trainer)
        for version in (1, 2):
            await trainer.publish.call_one(store, version)
            got, _ = await store.fetch(version)
            assert_bit_exact(got, policy_state_dict(version))
        await trainer_procs.stop()
        await stop_store(store)
        print("children", [p.pid for p in psutil.Process().children(recursive=True)])

    asyncio.run(main())
    print("done")
    """
)


def _procs_with_marker(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FORGESKY_TEST_RUN") == marker:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.slow
def test_two_runs_on_one_host_are_isolated_and_exit_cleanly():
    shm_before = _shm_entries()
    markers = [uuid.uuid4().hex for _ in range(2)]
    runs = []
    for marker in markers:
        env = dict(os.environ, FORGESKY_TEST_RUN=marker)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, env.get("PYTHONPATH")) if p)
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", RUN_SCRIPT],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for run in runs:
        out, err = run.communicate(timeout=400)
        assert run.returncode == 0, err
        assert "children []" in out and out.rstrip().endswith("done"), out
        for noise in ("Traceback", "SupervisionError", "resource_tracker", "Warning", "Error"):
            assert noise not in err, err
    for marker in markers:
        assert _procs_with_marker(marker) == []
    assert (_shm_entries() - shm_before) - _shm_in_use() == set()


def test_a_version_handed_over_a_group_at_a_time_fetches_like_one_dict(cluster):
    """What a sharded trainer publishes: one group (a gathered block) after another, each
    written before the next is asked for; readers see the same version as from one dict."""
    from runtime.weights.transport import Publisher

    small = dataclasses.replace(cluster.store, bucket_bytes=4096)
    want = mixed_state_dict(12)
    names = list(want)
    chunks = [names[:3], [], names[3:8], names[8:]]
    asked: list[int] = []

    def groups():
        for i, chunk in enumerate(chunks):
            asked.append(i)
            yield {n: want[n] for n in chunk}

    publisher = Publisher(small, ["store"], torch.device("cpu"))
    stats = cluster.run(publisher.publish_groups(12, groups()))
    assert asked == [0, 1, 2, 3]
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in want.values())
    raw = cluster.run(_raw_manifest(small, 12))
    assert cluster.run(_version_keys(small, 12)) == {
        *(bucket_key(12, i) for i in range(len(raw["buckets"]))),
        manifest_key(12),
    }
    assert_bit_exact(cluster.run(cluster.generator.fetch.call_one(small, 12)), want)
    # the next version must hold the same tensors
    with pytest.raises(ValueError, match="changed its tensors"):
        cluster.run(publisher.publish_groups(13, iter([{names[0]: want[names[0]]}])))
    assert cluster.run(_version_keys(small, 13)) == set()  # nothing of it left behind
