"""Weight paths (runtime/weights/): flat layout, path choice, and the push protocol over gloo.

The push tests run the real sender and receiver threads, TCPStore rendezvous and gloo broadcasts
(what NCCL does between GPUs), in one process; the end-to-end test runs the tiny recipe through
the runtime with every generator on the push path.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import finish, metrics, start

from runtime.weights.flat import cast_together, fill, flat_layout, views
from runtime.weights.push import PushReceiver, PushSender
from runtime.weights.transport import Endpoint, Publisher, choose, connections


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(5, generator=g),
        "proj.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "count": torch.tensor([seed], dtype=torch.int64),
    }


def test_flat_layout_aligns_and_views_round_trip():
    sd = state(1)
    entries, total = flat_layout(sd)
    assert all(e.offset % 256 == 0 for e in entries.values())
    assert total >= sum(t.numel() * t.element_size() for t in sd.values())
    buffer = torch.zeros(total, dtype=torch.uint8)
    fill(buffer, entries, sd)
    for name, view in views(buffer, entries).items():
        assert view.dtype == sd[name].dtype and torch.equal(view, sd[name]), name
    # views share the buffer's bytes
    views(buffer, entries)["norm.weight"].fill_(2.0)
    assert torch.equal(views(buffer, entries)["norm.weight"], torch.full((5,), 2.0))


def test_views_of_a_buffer_inside_a_larger_one_and_of_entries_outside_it():
    """A buffer that is itself a view of a larger one gives the same tensors; an entry past its
    end is refused, not read from the storage beyond."""
    sd = state(2)
    entries, total = flat_layout(sd)
    for at in (0, 8, 256):
        backing = torch.zeros(at + total + 64, dtype=torch.uint8)
        buffer = backing[at : at + total]
        fill(buffer, entries, sd)
        got = views(buffer, entries)
        for name, tensor in sd.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (at, name)
            assert got[name].is_contiguous() and got[name].shape == tensor.shape
        got["proj.weight"].fill_(3.0)  # views, not copies
        assert torch.equal(
            views(buffer, entries)["proj.weight"], torch.full((3, 5), 3.0).bfloat16()
        )
    last = max(entries, key=lambda n: entries[n].offset)
    with pytest.raises(ValueError, match=f"{last} .* is not in the buffer"):
        views(torch.zeros(entries[last].offset + 4, dtype=torch.uint8), entries)


def test_cast_together_is_each_tensors_own_cast_in_one_buffer():
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(4, 6, generator=g),
        "b": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "c": torch.randn(5, generator=g, dtype=torch.float64),
    }
    out = cast_together(tensors, torch.bfloat16)
    assert list(out) == ["a", "b", "c"] and out["b"] is tensors["b"]  # as .to gives it
    for name, tensor in tensors.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensor.bfloat16())
    cast = [out["a"], out["c"]]
    assert cast[0].untyped_storage().data_ptr() == cast[1].untyped_storage().data_ptr()
    assert all(t.is_contiguous() for t in cast)
    assert cast_together({"b": tensors["b"]}, torch.bfloat16)["b"] is tensors["b"]


def test_choose_paths():
    t = Endpoint("h1", "GPU-a")
    gens = [Endpoint("h1", "GPU-a"), Endpoint("h1", "GPU-b"), Endpoint("h2", "GPU-c", tp=2)]
    # a TP group takes the direct paths too: its workers open the buffer by CUDA IPC
    assert choose(t, gens, "auto") == ["ipc", "push", "push"]
    assert choose(t, [Endpoint("h1", "GPU-a", tp=2)], "auto") == ["ipc"]
    assert choose(t, gens, "store") == ["store"] * 3
    cpu = Endpoint("h1", None)
    assert choose(cpu, [Endpoint("h1", None)], "auto") == ["store"]
    assert choose(cpu, [Endpoint("h1", None), Endpoint("h1", None, tp=2)], "push") == [
        "push",
        "push",
    ]
    # the same GPU uuid on another host is another GPU
    assert choose(t, [Endpoint("h2", "GPU-a")], "auto") == ["push"]


def test_transport_mode_is_a_recipe_setting():
    from recipes import UserError, apply_overrides, load_recipe, plan

    recipe = load_recipe("tiny")
    with pytest.raises(
        UserError, match="weight_sync.transport: Input should be 'auto', 'store' or 'push'"
    ):
        apply_overrides(recipe, ["weight_sync.transport=carrier-pigeon"])
    pushed = plan(apply_overrides(recipe, ["weight_sync.transport=push"]), 0)
    assert pushed.settings.weight_sync.transport == "push"
    assert pushed.settings.weight_sync.expected == ("push",)
    with pytest.raises(ValueError, match="unknown weight transport mode"):
        choose(Endpoint("h", None), [Endpoint("h", None)], "pigeon")


def stage(sender: PushSender, version: int, sd: dict[str, torch.Tensor]) -> dict:
    import asyncio

    entries, _ = flat_layout(sd)
    return asyncio.run(sender.stage(version, sd, entries))


def test_connections_give_each_push_receiver_its_rank():
    paths = ["push", "store", "ipc", "push"]
    links = connections(paths, {"push": ("10.0.0.1", 7), "store": None, "ipc": [1]})
    assert links == [("10.0.0.1", 7, 1, 3), None, (0, 1), ("10.0.0.1", 7, 2, 3)]


@pytest.mark.parametrize("groups", [False, True], ids=["version", "groups"])
def test_push_over_gloo_delivers_each_version_to_every_receiver(groups: bool):
    """Whole versions from one staging buffer, or (weight_sync.push_buffer groups) each
    group's tensors broadcast as they come, the layout announced first: each receiver takes
    them into their places in its buffer."""
    source = PushSender(torch.device("cpu"), receivers=2)
    if groups:
        source.stream_groups()
    address, port = source.open()
    receivers = [PushReceiver(address, port, r, 3, torch.device("cpu")) for r in (1, 2)]
    try:
        for version in range(3):
            sd = state(version)
            entries, _ = flat_layout(sd)
            if groups:
                source.begin(version, entries)
                for group in _groups(sd):  # a tensor at a time, each a fresh copy
                    source.fill(group)
                    assert source.own_bytes == 0  # no buffer of a version on the sending side
                assert source.finish(version) == {"direct": {"push": True}}
            else:
                assert stage(source, version, sd) == {"direct": {"push": True}}
            for r in receivers:
                assert r.wait_for(version, timeout=60) == version
                with r.lock:
                    got = views(r.buffer, entries)
                    for name, tensor in sd.items():
                        assert torch.equal(got[name], tensor), (version, name)
        assert source.wait_pushed(60)
        assert source.pushes == 3 and source.last_push_s > 0
        # alone and whole, the push path keeps its own buffer of a version (reused by the next)
        entries, _ = flat_layout(state(0))
        whole = max(e.offset + e.nbytes for e in entries.values())
        assert source.own_bytes == (0 if groups else whole)
    finally:
        source.close()
    for r in receivers:
        r._thread.join(10)
        assert not r._thread.is_alive(), "receiver did not stop at close"
        r.close()


def test_a_push_a_group_at_a_time_takes_the_groups_in_the_layouts_order():
    # groups out of the layout's order, or a version missing some, are refused (a sender not
    # opened: nothing goes out)
    lone = PushSender(torch.device("cpu"), receivers=1)
    lone.stream_groups()
    entries, _ = flat_layout(state(3))
    lone.begin(3, entries)
    with pytest.raises(ValueError, match="in the layout's order"):
        lone.fill({"proj.weight": state(3)["proj.weight"]})
    with pytest.raises(ValueError, match="got 0 of the version's 4 tensors"):
        lone.finish(3)


def test_a_publisher_streams_a_push_alone_a_group_at_a_time():
    import asyncio

    store = _Manifests()
    publisher = Publisher(store, ["push"], torch.device("cpu"), push_groups=True)
    address, port = publisher.open()["push"]
    receiver = PushReceiver(address, port, 1, 2, torch.device("cpu"))
    push = publisher.senders[0]
    try:
        publisher.set_layout({k: v.to("meta") for k, v in state(0).items()})
        for version in range(2):
            sd = state(version)
            stats = asyncio.run(publisher.publish_groups(version, _groups(sd)))
            assert "stage_direct_s" in stats and push.groups and push.own_bytes == 0
            assert set(store.manifests[version]["direct"]) == {"tensors", "push"}
            assert receiver.wait_for(version, timeout=60) == version
            entries, _ = flat_layout(sd)
            with receiver.lock:
                got = views(receiver.buffer, entries)
                assert all(torch.equal(got[n], t) for n, t in sd.items()), version
        # beside the ipc path the push sends that path's buffer: a whole version
        both = Publisher(_Manifests(), ["ipc", "push"], torch.device("cpu"), push_groups=True)
        assert not next(s for s in both.senders if s.name == "push").groups
    finally:
        publisher.close()
        receiver.close()


def test_a_push_source_of_another_size_is_refused():
    class Lender:
        def buffer(self, version):
            return torch.zeros(3, dtype=torch.uint8)

    source = PushSender(torch.device("cpu"), receivers=1)
    source.lend_from(Lender())
    entries, total = flat_layout(state(0))
    source.begin(0, entries)
    with pytest.raises(ValueError, match="push of 3 bytes"):
        source.finish(0)
    assert total > 3


def test_a_receiver_behind_gets_the_newest_version_and_a_late_one_times_out():
    source = PushSender(torch.device("cpu"), receivers=1)
    address, port = source.open()
    receiver = PushReceiver(address, port, 1, 2, torch.device("cpu"))
    began = time.monotonic()
    try:
        with receiver.lock:  # the generator is loading: pushes wait for it
            stage(source, 0, state(0))
            staged = threading.Event()

            def second() -> None:
                stage(source, 1, state(1))  # waits until push 0 is through
                staged.set()

            threading.Thread(target=second, daemon=True).start()
            time.sleep(0.3)
            assert receiver.version == -1 and not staged.is_set()
        assert staged.wait(30)
        assert receiver.wait_for(1, timeout=30) == 1
        # each receive's time is kept: a window over both counts them, one before none
        received = receiver.receiving_between(began, time.monotonic())
        assert received > 0 and len(receiver.receives) == 2
        assert received == pytest.approx(sum(b - a for a, b in receiver.receives))
        assert receiver.receiving_between(began - 10, began) == 0.0
        assert receiver.wait_for(0, timeout=1) == 1  # asked for 0, holds the newer 1
        with pytest.raises(TimeoutError, match="version 5 was not pushed"):
            receiver.wait_for(5, timeout=0.3)
    finally:
        source.close()
        receiver.close()


def test_changed_tensors_between_versions_are_refused():
    import asyncio

    publisher = Publisher(None, ["ipc"], torch.device("cpu"))
    publisher.entries, _ = flat_layout(state(0))
    sd = state(1)
    sd["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="changed its tensors"):
        asyncio.run(publisher.publish(1, sd))


@pytest.mark.slow
@pytest.mark.parametrize("buffer", ["version", "groups"])
def test_tiny_run_with_pushed_weights(tmp_path: Path, buffer: str):
    run_dir = tmp_path / "run"
    proc = start(
        ["--recipe", "tiny", "--run-dir", str(run_dir), "--set", "grpo.steps=12"]
        + ["--set", "weight_sync.transport=push", "--set", f"weight_sync.push_buffer={buffer}"]
        # groups: two gloo trainer ranks, whose sharded weights are gathered a group at a time
        + (["--set", "trainer.ranks=2"] if buffer == "groups" else []),
    )
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    how = " (the push a group at a time, as the trainer gathers it)" if buffer == "groups" else ""
    assert f"weights reach the generators by: push{how}\n" in out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["time/push_s"] > 0 for r in rows[1:]), [r.get("time/push_s") for r in rows]
    # each generate call's record says how long a push was received while the engine ran
    overlaps = [r["generator/push_overlap_s"] for r in rows if "generator/push_overlap_s" in r]
    assert overlaps and all(x >= 0 for x in overlaps), rows
    # versions still advance one per step on the generator side
    assert rows[-1]["policy_version"] == 12
    # the generators' busy share is measured every step (rollouts overlap training)
    assert all(r["generator/busy_share"] > 0 for r in rows[1:])


@pytest.mark.parametrize("path", ["push", "push_groups"])
def test_weight_push_bench_between_two_procs_over_gloo(path: str):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import weight_push

    # Two spawned procs; every tensor of every version is checked on the receiving side.
    result = weight_push.run_path("tiny", path, versions=3, device="cpu")
    assert result["versions"] == 3 and result["tensors"] > 10
    assert result["transfer_s"] > 0 and result["end_to_end_s"] >= result["transfer_s"] * 0.5


def test_weight_push_bench_takes_the_store_path_a_tensor_at_a_time():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import weight_push

    # TorchStore started here, its storage volume a proc; every tensor of every version fetched
    # back and checked (a wrong one raises)
    result = weight_push.run_store("tiny", versions=3, device="cpu")
    assert result["path"] == "store" and result["versions"] == 3 and result["tensors"] > 10
    assert 0 < result["stage_s"] <= result["end_to_end_s"] and result["load_s"] > 0
    assert all(r["publish_gpu_extra_bytes"] is None for r in result["rows"])  # no GPU here


class _Manifests:
    """The one store call a publish over direct paths alone makes: the version's manifest."""

    def __init__(self) -> None:
        self.manifests: dict[int, dict] = {}

    async def put_manifest(self, version: int, manifest: dict, *, check: bool = False) -> None:
        assert not (check and version in self.manifests), version
        self.manifests[version] = manifest


def _groups(sd: dict[str, torch.Tensor]):
    """`sd` a tensor at a time, each group a fresh copy (as a trainer gathers them)."""
    for name, tensor in sd.items():
        yield {name: tensor.clone()}


def test_direct_paths_take_a_version_a_group_at_a_time_and_free_it_once_loaded():
    import asyncio

    store = _Manifests()
    publisher = Publisher(store, ["ipc", "push"], torch.device("cpu"))
    address, port = publisher.open()["push"]
    receiver = PushReceiver(address, port, 1, 2, torch.device("cpu"))
    ipc = next(s for s in publisher.senders if s.name == "ipc")
    push = next(s for s in publisher.senders if s.name == "push")
    try:
        for version in range(3):
            sd = state(version)
            stats = asyncio.run(publisher.publish_groups(version, _groups(sd)))
            entries, _ = flat_layout(sd)
            assert stats["bytes"] == sum(e.nbytes for e in entries.values())
            # version 0 fixed the layout from the joined state; later ones were streamed
            assert ("stage_direct_s" in stats) == (version > 0), stats
            manifest = store.manifests[version]
            assert set(manifest["direct"]) == {"tensors", "ipc", "push"}
            got = views(ipc._buffers[version], entries)
            assert all(torch.equal(got[n], t) for n, t in sd.items()), version
            assert receiver.wait_for(version, timeout=60) == version
            with receiver.lock:
                pushed = views(receiver.buffer, entries)
                assert all(torch.equal(pushed[n], t) for n, t in sd.items()), version
            # the push went out of the ipc path's buffer: rank 0 kept no second copy
            assert push.own_bytes == 0
            publisher.loaded(version)  # every generator has it: the ipc buffer goes
            assert version not in ipc._buffers
        fewer = dict(list(state(3).items())[:1])
        more = state(3) | {"extra": torch.zeros(1)}
        for wrong in (fewer, more):
            with pytest.raises(ValueError, match="changed its tensors"):
                asyncio.run(publisher.publish_groups(3, _groups(wrong)))
    finally:
        publisher.close()
        receiver.close()


def test_each_process_that_opens_an_ipc_version_gets_an_export_of_its_own():
    """torch frees a shared CUDA block once each export's counter is back at 0, and one export
    opened by two processes never gets there: a TP=2 generator's workers take a handle each."""
    import asyncio

    from runtime.weights.transport import connections

    store = _Manifests()
    paths = ["ipc", "store", "ipc"]
    publisher = Publisher(store, paths, torch.device("cpu"), ipc_opens=[2, 1, 1])
    ipc = next(s for s in publisher.senders if s.name == "ipc")
    assert ipc.opens == [2, 1] and ipc.exports == 3
    opened = publisher.open()
    assert connections(paths, opened) == [(0, 2), None, (2, 1)]
    store.manifests.clear()
    publisher.senders = [ipc]  # the manifest alone, no TorchStore here
    sd = state(0)
    asyncio.run(publisher.publish(0, sd))
    handles = store.manifests[0]["direct"]["ipc"]
    assert len(handles) == 3
    with pytest.raises(ValueError, match="2 counts of openers for 3 generators"):
        Publisher(store, paths, torch.device("cpu"), ipc_opens=[2, 1])
    with pytest.raises(ValueError, match="at least once, not 0"):
        Publisher(store, ["ipc"], torch.device("cpu"), ipc_opens=[0])
    publisher.close()


def test_a_known_layout_streams_the_first_version_too():
    """With the layout given up front (a sharded trainer's `hf_layout`, meta tensors), even
    version 0 goes into the flat buffer a group at a time: a resumed run's first publish has
    the optimizer state beside it, and the whole joined version on top would not fit."""
    import asyncio

    store = _Manifests()
    publisher = Publisher(store, ["ipc"], torch.device("cpu"))
    ipc = publisher.senders[0]
    sd = state(0)
    publisher.set_layout(
        {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in sd.items()}
    )
    stats = asyncio.run(publisher.publish_groups(0, _groups(sd)))
    assert "stage_direct_s" in stats, stats
    entries, _ = flat_layout(sd)
    got = views(ipc._buffers[0], entries)
    assert all(torch.equal(got[n], t) for n, t in sd.items())
    publisher.close()


def test_a_receiver_handed_the_manifest_loads_without_the_store():
    """The publish returns its manifest's `direct` entry; the controller hands it to each
    generator with the load, and the CUDA IPC receiver then asks the store for nothing."""
    import asyncio

    from runtime.weights.flat import entries_of
    from runtime.weights.ipc import IpcReceiver

    store = _Manifests()
    publisher = Publisher(store, ["ipc"], torch.device("cpu"))
    publisher.open()
    sd = state(0)
    published = asyncio.run(publisher.publish_groups(0, _groups(sd)))
    assert published["direct"] == store.manifests[0]["direct"]  # what the store holds too
    publisher.set_layout({k: v.to("meta") for k, v in sd.items()})
    streamed = asyncio.run(publisher.publish_groups(1, _groups(state(1))))
    assert streamed["direct"] == store.manifests[1]["direct"]

    class NoStore:
        async def direct(self, version: int, *, wait_s: float = 0.0):
            raise AssertionError("the receiver went to the store for a manifest it was handed")

    class Backend:  # opens its handles itself, as vLLM's engine does
        def load_ipc(self, handles, entries):
            self.handles, self.entries = handles, entries

    backend = Backend()
    receiver = IpcReceiver(NoStore())
    assert asyncio.run(receiver.load(1, backend, streamed["direct"]))[0] == 1
    assert backend.handles == streamed["direct"]["ipc"][:1]
    assert backend.entries == entries_of(streamed["direct"])
    publisher.close()
