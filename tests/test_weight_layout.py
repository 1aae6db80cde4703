"""runtime.weights.layout: a state dict as capped one-dtype byte buckets, and back, bit-exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.weights.layout import (
    BUCKET_BYTES,
    Packer,
    TensorEntry,
    Unpacker,
    bucket_segments,
    one_intra_op_thread,
    parse_dtype,
    plan_buckets,
)

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads, infinities, subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(_INTS[dtype.itemsize]).view(dtype).view(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def check_layout(
    state_dict: dict[str, torch.Tensor], entries: dict[str, TensorEntry], sizes: list[int], cap: int
) -> None:
    """Buckets hold one dtype each, within the cap, packed without gaps; every tensor's bytes
    lie in them exactly once, in order, starting where its entry says."""
    assert list(entries) == list(state_dict)
    segments = bucket_segments(entries, sizes)
    pieces: dict[str, list[tuple[int, int]]] = {}
    for index, bucket in enumerate(segments):
        dtypes = {entries[s.name].dtype for s in bucket}
        assert len(dtypes) == 1, index
        itemsize = parse_dtype(dtypes.pop()).itemsize
        assert 0 < sizes[index] <= max(cap // itemsize, 1) * itemsize
        end = 0
        for s in bucket:
            assert s.dst == end and s.dst % itemsize == 0
            end += s.length
            pieces.setdefault(s.name, []).append((s.src, s.length))
        assert end == sizes[index]
    for name, entry in entries.items():
        tensor = state_dict[name]
        assert (entry.numel, entry.shape) == (tensor.numel(), tuple(tensor.shape)), name
        assert parse_dtype(entry.dtype) == tensor.dtype and entry.nbytes == tensor.nbytes
        if not tensor.numel():
            assert (entry.bucket, entry.offset) == (-1, 0) and name not in pieces
            continue
        start = [s for s in segments[entry.bucket] if s.name == name and s.src == 0]
        assert [s.dst for s in start] == [entry.offset], name
        src = 0
        for piece_src, length in pieces[name]:
            assert piece_src == src
            src += length
        assert src == tensor.nbytes, name


def round_trip(
    state_dict: dict[str, torch.Tensor], cap: int, into: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    packer = Packer(state_dict, cap)
    check_layout(state_dict, packer.entries, packer.sizes, cap)
    buckets = [packer.bucket(i) for i in range(len(packer.sizes))]
    unpacker = Unpacker(packer.entries, packer.sizes, into or {})
    for index in reversed(range(len(buckets))):  # arrival order does not matter
        unpacker.add(index, buckets[index])
    return unpacker.state_dict(), buckets


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(bits(got[name]), bits(tensor)), name


def test_tensors_fill_buckets_in_order_and_split_across_them():
    state_dict = {
        "a": random_bits((1500,), torch.bfloat16, 0),  # 3000 bytes
        "norm": random_bits((10,), torch.float32, 1),
        "b": random_bits((1500,), torch.bfloat16, 2),  # continues into the second bucket
        "c": random_bits((1500,), torch.bfloat16, 3),
    }
    packer = Packer(state_dict, 4096)
    assert packer.sizes == [4096, 4096, 808, 40]
    assert packer.entries["a"][:2] == (0, 0)
    assert packer.entries["b"][:2] == (0, 3000)
    assert packer.entries["c"][:2] == (1, 1904)
    assert packer.entries["norm"][:2] == (3, 0)

    got, buckets = round_trip(state_dict, 4096)
    assert_bit_exact(got, state_dict)
    # Inside one bucket: a view of it. Split: a tensor of its own.
    assert got["a"].untyped_storage().data_ptr() == buckets[0].untyped_storage().data_ptr()
    assert got["norm"].untyped_storage().data_ptr() == buckets[3].untyped_storage().data_ptr()
    assert got["b"].untyped_storage().nbytes() == 3000


def test_mixed_dtypes_strided_views_and_odd_shapes_round_trip_bit_exactly():
    base = torch.randn(24, 40)
    state_dict = {
        "embed": random_bits((96, 32), torch.bfloat16, 0),
        "q_proj": random_bits((32, 48), torch.bfloat16, 1).t(),
        "up_proj": base.t(),
        "row": base[3],
        "every_other": base[::2, 1::3],
        "inv_freq": random_bits((16,), torch.float64, 2),
        "scale": random_bits((), torch.bfloat16, 3),
        "step": torch.tensor(7),
        "half": torch.tensor([float("nan"), float("inf"), -0.0, 1e-7], dtype=torch.float16),
        "mask": random_bits((5, 3), torch.bool, 4),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "lm_head": random_bits((96, 32), torch.bfloat16, 5),
    }
    assert not state_dict["up_proj"].is_contiguous()
    for cap in (1, 7, 100, 4096, BUCKET_BYTES):
        got, buckets = round_trip(state_dict, cap)
        assert_bit_exact(got, state_dict)
        assert sum(b.numel() for b in buckets) == sum(t.nbytes for t in state_dict.values())
    # The comparison can fail: NaN payloads and -0.0 are really there.
    assert torch.isnan(state_dict["half"]).any() and torch.signbit(state_dict["half"][2])


def test_default_cap_is_32_mib_with_one_bucket_per_dtype_below_it():
    big = torch.zeros(10 * 2**20)  # 40 MiB of float32
    _, sizes = plan_buckets({"big": big, "small": torch.zeros(3, dtype=torch.bfloat16)})
    assert sizes == [32 * 2**20, 8 * 2**20, 6]


@pytest.mark.parametrize(
    ("cap", "dtype", "chunk"),
    [(4097, torch.float32, 4096), (1, torch.float64, 8), (9, torch.bfloat16, 8)],
)
def test_buckets_end_on_element_boundaries(cap, dtype, chunk):
    _, sizes = plan_buckets({"t": torch.zeros(1100, dtype=dtype)}, cap)
    assert set(sizes[:-1]) == {chunk} and 0 < sizes[-1] <= chunk
    assert sum(sizes) == 1100 * dtype.itemsize


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_caps_are_refused(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets({"a": torch.ones(1)}, bad)


def test_fetch_into_given_tensors_also_when_split_or_strided():
    state_dict = {f"w{i}": random_bits((33, 17), torch.bfloat16, i) for i in range(4)}
    into = {name: torch.empty_like(t) for name, t in state_dict.items()}
    into["w1"] = torch.empty(17, 33, dtype=torch.bfloat16).t()  # strided target
    got, _ = round_trip(state_dict, 1000, into)
    assert all(got[name] is target for name, target in into.items())
    assert_bit_exact(got, state_dict)


def test_fetch_into_model_parameters():
    model = torch.nn.Linear(40, 30)
    want = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    into = dict(model.named_parameters())
    got, _ = round_trip(want, 1000, into)  # the weight spans buckets, the bias does not
    assert all(got[name] is p for name, p in into.items())
    assert_bit_exact({n: t.detach() for n, t in got.items()}, want)


def test_unpacker_refuses_a_bucket_that_is_not_the_listed_one():
    packer = Packer({"a": torch.ones(4)}, 1024)
    unpacker = Unpacker(packer.entries, packer.sizes, {})
    with pytest.raises(ValueError, match="bucket 0 is not the 16-byte uint8 tensor"):
        unpacker.add(0, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bucket 0 is not"):
        unpacker.add(0, torch.zeros(4))


def test_a_manifest_pointing_outside_its_buckets_is_refused():
    entry = TensorEntry(0, 12, 4, (4,), "float32")
    with pytest.raises(ValueError, match="places 'a' outside its buckets"):
        bucket_segments({"a": entry}, [16])


def test_single_thread_section_restores_the_thread_count():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), one_intra_op_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before


_DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.uint8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from(_DTYPES),
            st.integers(min_value=0, max_value=40),
            st.integers(min_value=1, max_value=9),
            st.booleans(),
        ),
        min_size=1,
        max_size=25,
    ),
    cap=st.integers(min_value=1, max_value=3000),
)
def test_any_state_dict_round_trips_bit_exactly(tensors, cap):
    state_dict = {}
    for i, (dtype, rows, cols, transposed) in enumerate(tensors):
        tensor = random_bits((rows, cols), dtype, i)
        state_dict[f"p{i}"] = tensor.t() if transposed else tensor
    got, _ = round_trip(state_dict, cap)
    assert_bit_exact(got, state_dict)
